"""Typed messages between the TokenizerManager (main process) and the Scheduler (its own process).

Everything here is pickled over ZMQ; keep it plain data (ints, strs, lists, dicts, dataclasses).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_vericache.sampling.sampling_params import SamplingParams

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
