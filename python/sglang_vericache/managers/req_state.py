"""ReqState: what the TokenizerManager knows about one running sequence, and its response dicts."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from sglang_vericache.managers.detokenizer import IncrementalDetokenizer, held_back_len
from sglang_vericache.managers.io_struct import ReqOutput
from sglang_vericache.sampling.sampling_params import SamplingParams
from sglang_vericache.speculative.round_state import SPEC_META_DEFAULTS


def _with_text(entries, tokenizer, with_text: bool) -> list[list]:
    """(logprob, token_id) pairs -> SGLang's [logprob, token_id, token_text | None] entries."""
    entries = list(entries or [])
    if not with_text or tokenizer is None or not entries:
        return [[lp, tid, None] for lp, tid in entries]
    texts = tokenizer.batch_decode([[tid] for _, tid in entries])
    return [[lp, tid, text] for (lp, tid), text in zip(entries, texts)]


@dataclass
class ReqState:
    rid: str
    index: int  # position in the request's flattened (prompt, sample) list
    stream: bool
    params: SamplingParams
    prompt_ids: list[int]
    return_logprob: bool
    top_logprobs_num: int
    return_text_in_logprobs: bool
    tokenizer: Any = None
    log_metrics: bool = True  # false: not observed in the request metrics (health checks)
    no_logs: bool = False  # true: no --log-requests lines
    return_prompt_token_ids: bool = False
    created: float = field(default_factory=time.perf_counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    disconnect_checked: float = field(default_factory=time.perf_counter)  # last is_disconnected() poll

    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    meta: dict = field(default_factory=dict)
    error: Exception | None = None
    finished: bool = False
    finish_time: float | None = None
    first_token_time: float | None = None

    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    # Streaming: how many output logprob entries earlier events already carried.
    sent_logprobs: int = 0
    sent_ids: int = 0  # output ids covered by streamed events
    detok: IncrementalDetokenizer | None = None
    final_text: str | None = None

    def __post_init__(self) -> None:
        self.prompt_tokens = len(self.prompt_ids)
        if self.tokenizer is not None:
            self.detok = IncrementalDetokenizer(
                self.tokenizer,
                self.prompt_ids,
                self.params.skip_special_tokens,
                self.params.spaces_between_special_tokens,
            )

    def update(self, out: ReqOutput, tokenizer) -> None:
        if out.new_output_ids and self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_ids.extend(out.new_output_ids)
        self.prompt_tokens = out.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        self.meta.update(out.meta or {})
        if self.return_logprob:
            with_text = self.return_text_in_logprobs
            # Input logprobs come once (on a request's first message); a repeat replaces them.
            if out.input_token_logprobs is not None:
                self.input_token_logprobs = _with_text(out.input_token_logprobs, tokenizer, with_text)
            if out.input_top_logprobs is not None:
                self.input_top_logprobs = [
                    None if row is None else _with_text(row, tokenizer, with_text)
                    for row in out.input_top_logprobs
                ]
            if out.output_token_logprobs is not None:
                self.output_token_logprobs.extend(_with_text(out.output_token_logprobs, tokenizer, with_text))
            if out.output_top_logprobs is not None:
                self.output_top_logprobs.extend(
                    _with_text(row, tokenizer, with_text) for row in out.output_top_logprobs
                )
        if self.detok is not None:
            self.detok.add(self._text_ids(out))
        if out.finished_reason is not None:
            self.finished_reason = out.finished_reason
            self.finished = True
            self.finish_time = time.perf_counter()
            if self.detok is not None:
                self.final_text = self.detok.finish(out.finished_reason, self.params.no_stop_trim)

    def _text_ids(self, out: ReqOutput) -> list[int]:
        """The new ids whose text belongs in the output: a matched stop token is left out (SGLang)."""
        ids = out.new_output_ids
        matched = (out.finished_reason or {}).get("matched")
        if (
            ids
            and isinstance(matched, int)
            and not isinstance(matched, bool)
            and ids[-1] == matched
            and not self.params.no_stop_trim
        ):
            return ids[:-1]
        return ids

    @property
    def text(self) -> str:
        """Output text so far: final (stop-trimmed) once finished, else the committed text
        minus any tail that could still become a stop string."""
        if self.final_text is not None:
            return self.final_text
        text = self.detok.text if self.detok is not None else ""
        hold = held_back_len(text, self.params.stop)
        return text[: len(text) - hold] if hold else text

    def make_output(self, final: bool) -> dict:
        """The SGLang response dict. Streaming events (final=False) carry only the output logprob
        entries that earlier events did not; everything else is cumulative."""
        now = self.finish_time or time.perf_counter()
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finished_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": now - self.created,
        }
        if self.return_logprob:
            start = 0 if final else self.sent_logprobs
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["output_token_logprobs"] = self.output_token_logprobs[start:]
            meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
            if self.top_logprobs_num > 0:
                meta["input_top_logprobs"] = self.input_top_logprobs
                meta["output_top_logprobs"] = self.output_top_logprobs[start:]
            if not final:
                self.sent_logprobs = len(self.output_token_logprobs)
        meta.update(SPEC_META_DEFAULTS)  # zero where no VeriCache round ran
        meta.update(self.meta)
        out: dict[str, Any] = {}
        if self.detok is not None:
            out["text"] = self.text
        out["output_ids"] = list(self.output_ids)
        out["meta_info"] = meta
        if self.return_prompt_token_ids:
            out["prompt_token_ids"] = list(self.prompt_ids)
        return out
