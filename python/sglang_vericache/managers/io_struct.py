"""Typed messages between the TokenizerManager (main process) and the Scheduler (its own process).

Everything here is pickled over ZMQ; keep it plain data (ints, strs, lists, dicts, dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sglang_vericache.sampling.sampling_params import InvalidRequest, SamplingParams

# A logprob entry as the scheduler sends it: (logprob or None, token_id). The TokenizerManager adds text.
LogprobEntry = tuple  # (float | None, int)


# ---------------------------------------------------------------- TokenizerManager -> Scheduler


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    # Noise seed of the counter-based sampler: the request's sampling_seed, or one the TokenizerManager drew.
    seed: int
    return_logprob: bool = False
    # First prompt position whose logprob is returned (-1 = none of the prompt).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    input_text: str | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetStatsReq:
    pass


# SGLang ProfileReq fields honoured here, and those accepted only at their default (off) value.
PROFILE_ACTIVITIES = ("CPU", "GPU")
_PROFILE_FIELDS = {"output_dir": str, "num_steps": int, "activities": list, "with_stack": bool,
                   "record_shapes": bool, "profile_id": str}
_PROFILE_UNSUPPORTED_IF_SET = ("start_step", "profile_by_stage", "merge_profiles", "profile_prefix",
                               "profile_stages", "detailed_annotations")


@dataclass
class ProfileReq:
    """/start_profile (kind "start") and /stop_profile ("stop"): torch.profiler in the scheduler
    (managers/scheduler_profiler.py). None fields take the scheduler's defaults."""

    kind: str
    output_dir: str | None = None  # default: $SGLANG_TORCH_PROFILER_DIR, else /tmp
    num_steps: int | None = None  # stop by itself after this many scheduler steps with work
    activities: list[str] | None = None  # CPU, GPU; default: CPU, and GPU on CUDA
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_id: str | None = None  # the trace file's name stem; default: the start time

    @staticmethod
    def from_json(kind: str, body: Any) -> ProfileReq:
        """SGLang's ProfileReq body (or none); InvalidRequest names a bad or unsupported field."""
        if body is None or kind == "stop":
            return ProfileReq(kind)
        if not isinstance(body, dict):
            raise InvalidRequest("the profile request body must be a JSON object")
        unsupported = [k for k in _PROFILE_UNSUPPORTED_IF_SET if body.get(k) not in (None, False, [], "")]
        if unsupported:
            raise InvalidRequest(f"profile field(s) not supported by this runtime: {', '.join(unsupported)}")
        unknown = sorted(set(body) - set(_PROFILE_FIELDS) - set(_PROFILE_UNSUPPORTED_IF_SET))
        if unknown:
            raise InvalidRequest(f"unknown profile field(s): {', '.join(unknown)}")
        fields = {}
        for name, typ in _PROFILE_FIELDS.items():
            value = body.get(name)
            if value is None:
                continue
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise InvalidRequest(f"profile field {name} must be a {typ.__name__}, got {value!r}")
            fields[name] = value
        if fields.get("num_steps", 1) < 1:
            raise InvalidRequest(f"num_steps must be >= 1, got {fields['num_steps']}")
        pid = fields.get("profile_id")
        if pid is not None and (not pid or "/" in pid or "\\" in pid or pid.startswith(".")):
            raise InvalidRequest(f"profile_id names the trace file: no path separators or leading dot, got {pid!r}")
        if "activities" in fields:
            bad = [a for a in fields["activities"] if a not in PROFILE_ACTIVITIES]
            if bad or not fields["activities"]:
                raise InvalidRequest(f"activities must be a non-empty list of {', '.join(PROFILE_ACTIVITIES)} "
                                     f"(SGLang's MEM, RPD and others are not supported here), got {bad or []}")
        return ProfileReq(kind, **fields)


@dataclass
class ProfileReqOutput:
    success: bool
    message: str = ""


@dataclass
class SchedulerStats:
    """A snapshot for /metrics and /server_info."""

    num_running_reqs: int
    num_waiting_reqs: int
    num_used_tokens: int
    max_total_num_tokens: int
    token_usage: float
    cache_hit_rate: float
    gen_throughput: float  # output tokens/s over the recent window
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    num_cached_tokens_total: int
    num_requests_total: int
    num_retracted_total: int
    extra: dict = field(default_factory=dict)


# ---------------------------------------------------------------- Scheduler -> TokenizerManager


@dataclass
class ReqOutput:
    """What one request produced since the last message about it.

    `new_output_ids` are only the tokens emitted since the previous ReqOutput of this rid;
    the TokenizerManager accumulates them. `finished_reason` is None while running.
    """

    rid: str
    new_output_ids: list[int]
    finished_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Filled only on the first message of a request that asked for input logprobs.
    input_token_logprobs: list[LogprobEntry] | None = None
    input_top_logprobs: list[list[LogprobEntry] | None] | None = None
    # One entry per token in new_output_ids when return_logprob.
    output_token_logprobs: list[LogprobEntry] | None = None
    output_top_logprobs: list[list[LogprobEntry]] | None = None
    # Mode-specific counters (e.g. speculative rounds) merged into meta_info.
    meta: dict = field(default_factory=dict)


@dataclass
class BatchTokenIDOut:
    outputs: list[ReqOutput]


@dataclass
class SchedulerError:
    """A request the scheduler could not take (e.g. too long for the pool); finishes it with an error."""

    rid: str
    message: str
    status_code: int = 400


@dataclass
class SchedulerReady:
    """Sent once at start-up, after the model is loaded and the pools are allocated."""

    max_total_num_tokens: int
    max_req_input_len: int
    context_length: int
    vocab_size: int
    server_info: dict
