"""What this server does with each field of SGLang's GenerateReqInput, and with fields it does not know.

SGLang's /generate parses its body into a dataclass (pydantic drops keys it does not know); routers
such as sglang-router send every field they have. Each field of SGLang's GenerateReqInput
(sglang 0.5.23) is one of:

  USED     implemented here (checked, then honoured);
  IGNORED  accepted; it has no effect here (multimodal knobs with no multimodal input, routing,
           tracing and cache hints): a value other than its default logs one warning per field name;
  REFUSED  accepted only at its default; set, it asks for output this server cannot produce, and the
           request gets a 400 naming the field.

A key SGLang does not know is ignored as SGLang's server ignores it, with one warning per name (as
vLLM's server does). Every field's type is still checked: a wrong type is a 400 naming the field.
test/test_request_compat.py reads the installed sglang's field list and fails on a field with no rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from sglang_vericache.sampling.sampling_params import InvalidRequest

logger = logging.getLogger(__name__)


class Policy(Enum):
    USED = "used"
    IGNORED = "ignored"
    REFUSED = "refused"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _one_or_list(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """SGLang's Union[X, List[X]] (one value, or one per prompt of a batch); None is the default."""
    return lambda v: v is None or ok(v) or (isinstance(v, list) and all(x is None or ok(x) for x in v))


_BOOL = (lambda v: isinstance(v, bool), "a boolean")
_OPT_BOOL = (_one_or_list(lambda v: isinstance(v, bool)), "a boolean")
_OPT_INT = (_one_or_list(_is_int), "an integer")
_OPT_STR = (_one_or_list(lambda v: isinstance(v, str)), "a string")
_OPT_NUM = (lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)), "a number")
_OPT_DICT = (_one_or_list(lambda v: isinstance(v, dict)), "a JSON object")
_OPT_LIST = (lambda v: v is None or isinstance(v, list), "a list")
_STR_MAP = (
    lambda v: v is None or (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
    "an object of strings",
)
_ANY = (lambda v: True, "anything")
_HIDDEN_STATES_MODE = (_one_or_list(lambda v: isinstance(v, (bool, str))), 'a boolean or "last"')


@dataclass(frozen=True, slots=True)
class FieldRule:
    policy: Policy
    check: tuple[Callable[[Any], bool], str]  # (type check, what it wants) for the 400 message
    why: str = ""  # IGNORED: why it has no effect; REFUSED: what it would need
    default: Any = None


def _used(check=_ANY, default=None) -> FieldRule:
    return FieldRule(Policy.USED, check, default=default)


def _ignored(why: str, check=_ANY, default=None) -> FieldRule:
    return FieldRule(Policy.IGNORED, check, why, default)


def _refused(why: str, check=_ANY, default=None) -> FieldRule:
    return FieldRule(Policy.REFUSED, check, why, default)


_MM = "a multimodal-processing option; this server takes text only (image/video/audio data are refused)"
_EPD = "an encoder-disaggregation (EPD) internal; this server has no encoder workers"
_PD = "prefill/decode disaggregation through a bootstrap server is not supported (see --disagg-prefill)"
_MULTIMODAL_INPUT = "this server takes text and token ids only"
_EXTRA_OUTPUT = "this server does not compute it"
_CACHE_ISOLATION = "this server's prefix cache has no per-request namespaces"
_FLAT = _EXTRA_OUTPUT + " (logprobs come as SGLang's nested lists)"

# The checks of the USED fields' values (types, ranges, batch lengths) are GenerateReqInput.normalize's.
GENERATE_FIELDS: dict[str, FieldRule] = {
    "rid": _used(),
    "session_id": _ignored("a session-cache hint; every request's prefix is cached here anyway", _OPT_STR),
    "text": _used(),
    "input_ids": _used(),
    "input_embeds": _refused(_MULTIMODAL_INPUT, _OPT_LIST),
    "image_data": _refused(_MULTIMODAL_INPUT),
    "video_data": _refused(_MULTIMODAL_INPUT),
    "audio_data": _refused(_MULTIMODAL_INPUT),
    "mm_hashes": _ignored(_MM, _OPT_LIST),
    "mm_content_hashes": _ignored(_MM, _OPT_LIST),
    "use_audio_in_video": _ignored(_MM, _BOOL, False),
    "video_config": _ignored(_MM, _OPT_DICT),
    "sampling_params": _used(),
    "watermark": _refused("watermarked sampling is not implemented"),
    "return_logprob": _used(),
    "logprob_start_len": _used(),
    "top_logprobs_num": _used(),
    "token_ids_logprob": _refused(_EXTRA_OUTPUT + " (logprobs of chosen token ids)", _OPT_LIST),
    "return_sampling_mask": _refused(_EXTRA_OUTPUT, _OPT_BOOL),
    "sampling_logprobs_mode": _refused(_EXTRA_OUTPUT, _OPT_STR),
    "return_text_in_logprobs": _used(default=False),
    "return_flat_raw_top_logprobs": _refused(_FLAT, _BOOL, False),
    "return_flat_raw_output_top_logprobs": _refused(_FLAT, _BOOL, False),
    "return_flat_raw_top_logprobs_b64": _refused(_FLAT, _BOOL, False),
    "stream": _used(default=False),
    "log_metrics": _used(_BOOL, True),
    "return_hidden_states": _refused(_EXTRA_OUTPUT, _HIDDEN_STATES_MODE, False),
    "return_routed_experts": _refused(_EXTRA_OUTPUT + " (no mixture-of-experts model)", _BOOL, False),
    "routed_experts_start_len": _ignored("only read with return_routed_experts", _OPT_INT, 0),
    "return_indexer_topk": _refused(_EXTRA_OUTPUT + " (no sparse-attention indexer)", _BOOL, False),
    "modalities": _ignored(_MM, _OPT_LIST),
    "session_params": _refused("sessions (continual prompting) are not implemented", _OPT_DICT),
    "lora_path": _refused("LoRA adapters are not supported", _OPT_STR),
    "lora_id": _refused("LoRA adapters are not supported", _OPT_STR),
    "custom_logit_processor": _refused("custom logit processors are not supported", _OPT_STR),
    "positional_embed_overrides": _refused(_MULTIMODAL_INPUT + " (no embedding overrides)"),
    "bootstrap_host": _refused(_PD, _OPT_STR),
    "bootstrap_port": _refused(_PD, _OPT_INT),
    "bootstrap_room": _refused(_PD, _OPT_INT),
    "bootstrap_pair_key": _refused(_PD, _OPT_STR),
    "decode_tp_size": _ignored("a prefill/decode disaggregation hint", _OPT_INT),
    "routed_dp_rank": _used(_OPT_INT),
    "data_parallel_rank": _used(_OPT_INT),
    "disagg_prefill_dp_rank": _ignored("a prefill/decode disaggregation hint", _OPT_INT),
    "routing_key": _ignored("a label for the routing-key schedule policy, which this server does not have",
                            _OPT_STR),
    "conversation_id": _ignored("a tracking label; this server keeps no conversations", _OPT_STR),
    "http_worker_ipc": _ignored("an internal of SGLang's multi-tokenizer mode", _OPT_STR),
    "background": _refused("background requests are not supported", _BOOL, False),
    "require_reasoning": _refused("the model is not a hybrid reasoning model", _BOOL, False),
    "max_thinking_tokens": _refused("thinking budgets need strict thinking, which this server does not have",
                                    _OPT_INT),
    "priority": _ignored(
        "it orders scheduling only; SGLang too ignores it without --enable-priority-scheduling", _OPT_INT
    ),
    "extra_key": _refused(_CACHE_ISOLATION, _OPT_STR),
    "no_logs": _used(_BOOL, False),
    "custom_labels": _ignored("this server's metrics have no per-request labels", _STR_MAP),
    "return_bytes": _ignored("it is for image generation", _BOOL, False),
    "return_entropy": _ignored("no entropy is computed (SGLang 0.5.23 passes it on and computes none either)",
                               _BOOL, False),
    "return_prompt_token_ids": _used(_BOOL, False),
    "external_trace_header": _ignored("this server has no request tracing", _OPT_DICT),
    "received_time": _ignored("an internal arrival timestamp; latency is measured from arrival here",
                              _OPT_NUM),
    "need_wait_for_mm_inputs": _ignored(_EPD, _OPT_BOOL),
    "num_items_assigned": _ignored(_EPD, _OPT_DICT),
    "encoder_urls": _ignored(_EPD, _OPT_LIST),
    "max_dynamic_patch": _ignored(_MM, _OPT_INT),
    "min_dynamic_patch": _ignored(_MM, _OPT_INT),
    "image_max_dynamic_patch": _ignored(_MM, _OPT_INT),
    "video_max_dynamic_patch": _ignored(_MM, _OPT_INT),
    "images_config": _ignored(_MM, _OPT_DICT),
    "mm_processor_kwargs": _ignored(_MM, _OPT_DICT),
    "multi_item_delimiter_indices": _refused("multi-item scoring is not supported", _OPT_LIST),
    "token_indices_to_pool": _refused("pooling readouts are not supported", _OPT_LIST),
    "cache_salt": _refused(_CACHE_ISOLATION, _OPT_STR),
    "kv_hints": _ignored("advisory HiCache storage hints; this server's storage tiers take none", _OPT_DICT),
}

# Top-level keys that are not GenerateReqInput fields but that clients send on purpose: sglang-router
# adds "model" (SGLang's /generate drops it; one server serves one model).
SILENT_EXTRA_FIELDS = frozenset({"model"})

_MAX_WARNED_NAMES = 256  # warn once per name, for at most this many names (no log flood from garbage)
_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Logs `message` the first time `key` is seen in this process."""
    if key in _warned or len(_warned) > _MAX_WARNED_NAMES:
        return
    _warned.add(key)
    if len(_warned) > _MAX_WARNED_NAMES:
        message = f"more than {_MAX_WARNED_NAMES} ignored request fields; no more are logged"
    logger.warning(message)


def _safe_name(name: str) -> str:
    return repr(name[:64] + ("..." if len(name) > 64 else ""))


def is_unset(value: Any, default: Any = None) -> bool:
    """The field asks for nothing: null, false, empty, its default, or a per-prompt list of those."""
    if value is None or value is False or value in ("", [], {}):
        return True
    if default is not None and type(value) is type(default) and value == default:
        return True
    if isinstance(value, list):
        return all(is_unset(v, default) for v in value)
    return False


def check_field(name: str, value: Any, where: str) -> None:
    """Type-checks one known field; refuses it or warns that it is ignored where its rule says so."""
    rule = GENERATE_FIELDS[name]
    ok, what = rule.check
    if not ok(value):
        raise InvalidRequest(f"{name} must be {what}, got {value!r}")
    _apply(rule, name, value, where)


def _apply(rule: FieldRule, name: str, value: Any, where: str) -> None:
    if rule.policy is Policy.USED or is_unset(value, rule.default):
        return
    if rule.policy is Policy.REFUSED:
        raise InvalidRequest(f"{name} is not supported by this server: {rule.why}")
    warn_once(f"{where}:{name}", f"{where}: request field {name!r} is accepted and ignored: {rule.why}")


def warn_unknown(names: list[str], where: str) -> None:
    for name in names:
        warn_once(f"{where}:{name}", f"{where}: unknown request field {_safe_name(name)} ignored "
                                     "(as SGLang's server ignores it)")


def check_dp_rank(name: str, value: Any) -> None:
    """SGLang's routed_dp_rank (data_parallel_rank is its old name): this server is one DP rank."""
    if value is not None and value != 0:
        raise InvalidRequest(f"{name}={value} out of range [0, 1): this server has one data-parallel rank")


# SGLang's OpenAI request models carry some GenerateReqInput fields as extensions. Our OpenAI
# endpoints read these ones themselves; for the others the /generate rule holds, except where the
# OpenAI endpoint does not pass a field on that /generate implements.
OPENAI_READ = frozenset({"stream", "text", "background"})
OPENAI_RULES: dict[str, FieldRule] = {
    "rid": _ignored("the OpenAI endpoints make their own response ids"),
    "input_ids": _refused("the prompt comes from messages on this endpoint"),
    "return_prompt_token_ids": _refused(_EXTRA_OUTPUT + " on this endpoint"),
}


# The OpenAI request models' own fields (not GenerateReqInput's; SGLang's CompletionRequest and
# ChatCompletionRequest, sglang 0.5.23): read by serving_completions.py / serving_chat.py (USED,
# their values checked there), or ignored / refused as above. test/test_request_compat.py fails on
# a field of the installed models with no rule here.
_OPENAI_SAMPLING = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
                    "stop_regex", "seed", "logprobs", "logit_bias", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "min_tokens", "ignore_eos", "no_stop_trim", "skip_special_tokens",
                    "regex", "ebnf", "response_format", "stream_options")
_OPENAI_UNHANDLED: dict[str, FieldRule] = {
    "user": _ignored("an end-user id for the provider's abuse monitoring; nothing here uses it"),
    "custom_params": _refused("custom logit processors are not supported"),
    "return_cached_tokens_details": _refused(_EXTRA_OUTPUT + " (usage.prompt_tokens_details.cached_tokens: "
                                             "--enable-cache-report)"),
    "return_spec_tokens_details": _refused(_EXTRA_OUTPUT + " (per-request VeriCache counters are in /generate's "
                                           "meta_info)"),
    "return_token_ids": _refused(_EXTRA_OUTPUT + " on this endpoint (/generate returns output_ids)"),
}
OPENAI_ONLY_FIELDS: dict[str, dict[str, FieldRule]] = {
    "CompletionRequest": {
        **{name: _used() for name in (*_OPENAI_SAMPLING, "prompt", "echo", "suffix", "best_of", "json_schema")},
        **_OPENAI_UNHANDLED,
    },
    "ChatCompletionRequest": {
        **{name: _used() for name in (*_OPENAI_SAMPLING, "messages", "max_completion_tokens", "top_logprobs",
                                      "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                      "separate_reasoning", "stream_reasoning")},
        **_OPENAI_UNHANDLED,
        "reasoning_effort": _ignored("read by some reasoning models' chat templates; not passed to the "
                                     "template here (chat_template_kwargs is)"),
        "thinking": _ignored("read by some models' chat templates; not passed to the template here "
                             "(chat_template_kwargs is)"),
        "continue_final_message": _refused("the chat template always opens a new assistant message here"),
        "task": _refused("DeepSeek-V4's quick-instruction prompts are not built here"),
        "return_meta_info": _refused(_EXTRA_OUTPUT + " on this endpoint (/generate returns meta_info)"),
        "return_input_ids_in_sglext": _refused(_EXTRA_OUTPUT + " on this endpoint"),
        "return_output_ids_in_sglext": _refused(_EXTRA_OUTPUT + " on this endpoint"),
    },
}


def check_openai_body(body: dict, model_cls: Any, where: str) -> None:
    """After the pydantic model accepted `body`: warns about keys it does not know, applies the
    /generate rules to the SGLang extension fields it carries, and OPENAI_ONLY_FIELDS' rules to its
    own (their types pydantic checked)."""
    known: set[str] = set()
    for name, info in model_cls.model_fields.items():
        known.add(name)
        if info.alias:
            known.add(info.alias)
    warn_unknown(sorted(k for k in body if k not in known and k not in SILENT_EXTRA_FIELDS), where)
    for name in sorted(set(body) & known & set(GENERATE_FIELDS) - OPENAI_READ):
        value = body[name]
        if name in ("routed_dp_rank", "data_parallel_rank"):
            check_dp_rank(name, value)
        else:
            _apply(OPENAI_RULES.get(name, GENERATE_FIELDS[name]), name, value, where)
    own = OPENAI_ONLY_FIELDS.get(model_cls.__name__, {})
    for name in sorted(set(body) & set(own) - set(GENERATE_FIELDS)):
        _apply(own[name], name, body[name], where)
