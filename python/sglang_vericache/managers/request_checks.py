"""Checks a tokenized request must pass before it reaches the scheduler (bad input -> a 4xx)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_vericache.sampling.sampling_params import InvalidRequest, SamplingParams


@dataclass(frozen=True)
class Limits:
    """What the TokenizerManager learned from SchedulerReady (and its own tokenizer)."""

    vocab_size: int
    context_len: int
    max_req_input_len: int
    has_tokenizer: bool
    supports_grammar: bool


def check_prompt(input_ids: list[int], max_new_tokens: int, lim: Limits) -> None:
    if not input_ids:
        raise InvalidRequest("the prompt is empty")
    bad = [t for t in input_ids if not 0 <= t < lim.vocab_size]
    if bad:
        raise InvalidRequest(
            f"input_ids contain token ids outside the vocabulary [0, {lim.vocab_size}): {bad[:8]}"
        )
    n = len(input_ids)
    if n >= lim.context_len:
        raise InvalidRequest(
            f"The input ({n} tokens) is longer than the model's context length ({lim.context_len} tokens)."
        )
    if n > lim.max_req_input_len:
        raise InvalidRequest(
            f"The input ({n} tokens) is longer than this server's limit ({lim.max_req_input_len} tokens)."
        )
    if n + max_new_tokens > lim.context_len:  # SGLang's message, word for word
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of {lim.context_len} tokens. "
            f"You requested a total of {n + max_new_tokens} tokens: {n} tokens from the input and "
            f"{max_new_tokens} tokens for the completion."
        )


def check_features(params: SamplingParams, lim: Limits) -> None:
    """Rejects what the scheduler would otherwise drop silently or choke on."""
    for name in ("regex", "json_schema", "ebnf"):
        if getattr(params, name) is not None and not lim.supports_grammar:
            raise InvalidRequest(
                f"constrained decoding ({name}) needs the tokenizer; this server runs with --skip-tokenizer-init"
            )
    if (params.stop or params.stop_regex) and not lim.has_tokenizer:
        raise InvalidRequest("stop strings need a tokenizer; this server runs with --skip-tokenizer-init")
    if params.logit_bias is not None:
        if not isinstance(params.logit_bias, dict):
            raise InvalidRequest("logit_bias must be an object mapping token ids to biases")
        for key, bias in params.logit_bias.items():
            if not (str(key).isdigit() and int(key) < lim.vocab_size):
                raise InvalidRequest(f"logit_bias key {key!r} is not a token id in [0, {lim.vocab_size})")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise InvalidRequest(f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r}")


def check_logprob_start_len(start: int | None, prompt_len: int) -> int:
    """-1 (or None) means no prompt logprobs; otherwise a prompt position."""
    if start is None or start == -1:
        return -1
    if not 0 <= start < prompt_len:
        raise InvalidRequest(
            f"logprob_start_len ({start}) must be in [0, {prompt_len}) (the prompt length) or -1"
        )
    return start
