"""--log-requests: one line per request when it arrives and one when it finishes (SGLang's
"Receive:" / "Finish:" lines), at INFO on the sglang_vericache.requests logger."""

from __future__ import annotations

import dataclasses
import logging

from sglang_vericache.managers.req_state import ReqState
from sglang_vericache.sampling.sampling_params import SamplingParams

logger = logging.getLogger("sglang_vericache.requests")

MAX_LOGGED_CHARS = 2048  # longer texts are cut, with how much was left out


def _changed_params(params: SamplingParams) -> dict:
    """The sampling parameters that differ from their defaults."""
    default = SamplingParams()
    return {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(default, f.name)
    }


def _cut(text: str) -> str:
    if len(text) <= MAX_LOGGED_CHARS:
        return repr(text)
    return f"{text[:MAX_LOGGED_CHARS]!r}... ({len(text) - MAX_LOGGED_CHARS} more chars)"


def log_receive(state: ReqState) -> None:
    logger.info("Receive: rid=%s prompt_tokens=%d stream=%s sampling_params=%s",
                state.rid, len(state.prompt_ids), state.stream, _changed_params(state.params))


def log_finish(state: ReqState) -> None:
    text = _cut(state.text) if state.detok is not None else "(no tokenizer)"
    logger.info("Finish: rid=%s prompt_tokens=%d completion_tokens=%d cached_tokens=%d finish_reason=%s "
                "e2e_latency=%.3fs text=%s",
                state.rid, state.prompt_tokens, state.completion_tokens, state.cached_tokens,
                state.finished_reason, (state.finish_time or state.created) - state.created, text)
