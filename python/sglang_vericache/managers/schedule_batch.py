"""Req: one sequence's state inside the scheduler, and its finish checks."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_vericache.managers.io_struct import TokenizedGenerateReqInput
from sglang_vericache.sampling.sampling_params import SamplingParams
from sglang_vericache.speculative.round_state import VeriCacheState

if TYPE_CHECKING:
    from sglang_vericache.disagg.remote_prefill import RemotePrefillState

_EMPTY = torch.empty(0, dtype=torch.int64)


@dataclass(eq=False)
class Req:
    """A request's tokens and its KV bookkeeping.

    KV invariant: positions 0..kv_committed_len-1 of `fill_ids` have computed KV in slots
    `req_to_token[req_pool_idx, :kv_committed_len]`; the first len(prefix_indices) of those slots
    belong to the radix tree (locked through `last_node`), the rest to this request, which owns
    whole pages up to kv_allocated_len. While decoding, kv_committed_len == len(fill_ids) - 1:
    the last emitted token has no KV yet.
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    output_ids: list[int] = field(default_factory=list)

    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)
    last_node: object = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0

    finished_reason: dict | None = None
    to_abort: str | None = None
    cached_tokens: int = 0
    num_retractions: int = 0

    # What has been reported to the TokenizerManager.
    sent_output_len: int = 0
    input_logprobs_done: bool = False
    # Accumulated while (chunked) prefill runs, for return_logprob.
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    # Mode-specific counters reported in meta_info (e.g. speculative rounds).
    meta: dict = field(default_factory=dict)

    # Two-tier modes (see mem_cache/two_tier.py): compressed chunk ids of pages [0, C), of which the
    # first comp_prefix_len // page_size are the radix tree's; under global budgets each layer's flat
    # chunks of those ids (None: chunk id c of layer l, as everywhere else); queries awaiting a fold.
    comp_indices: torch.Tensor = field(default_factory=lambda: _EMPTY)
    comp_prefix_len: int = 0
    comp_layer_chunks: list[torch.Tensor] | None = None
    q_hist: dict = field(default_factory=dict)
    # VeriCache (speculative/round_state.py): this round's drafts, their grammar masks, and the rest
    # of the request's round state.
    spec: VeriCacheState = field(default_factory=VeriCacheState)
    # Constrained decoding (constrained/grammar.py): the matcher (it has accepted output_ids + drafts).
    grammar: object = None
    # --disagg-prefill verifier (disagg/remote_prefill.py): its admission by RemotePrefill.
    remote_prefill: RemotePrefillState | None = None

    @classmethod
    def from_input(cls, r: TokenizedGenerateReqInput) -> Req:
        return cls(
            rid=r.rid,
            origin_input_ids=list(r.input_ids),
            sampling_params=r.sampling_params,
            seed=r.seed,
            return_logprob=r.return_logprob,
            logprob_start_len=r.logprob_start_len,
            top_logprobs_num=r.top_logprobs_num,
            stream=r.stream,
        )

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob
            and not self.input_logprobs_done
            and 0 <= self.logprob_start_len < len(self.origin_input_ids)
        )

    def prefill_target_len(self) -> int:
        """Positions whose KV prefill must compute before the next token can be sampled.

        A fresh request computes its whole prompt. A retracted one recomputes prompt + outputs
        (its last output token included), and the last row's logits give the next token.
        """
        return self.seqlen

    def max_prefix_len(self) -> int:
        """Prefix-cache matches stop here: one token is always computed (for logits), and
        input logprobs need the rows from logprob_start_len on."""
        limit = self.seqlen - 1
        if self.wants_input_logprobs:
            limit = min(limit, self.logprob_start_len)
        return max(limit, 0)

    def reset_for_retract(self) -> None:
        self.req_pool_idx = None
        self.prefix_indices = _EMPTY
        self.last_node = None
        self.kv_committed_len = 0
        self.kv_allocated_len = 0
        self.comp_indices = _EMPTY
        self.comp_prefix_len = 0
        self.comp_layer_chunks = None
        self.q_hist = {}
        self.spec.retract(self.grammar)
        self.num_retractions += 1

    # ------------------------------------------------------------------ finish checks

    def check_finished(self, eos_token_ids: set[int], tokenizer, context_len: int) -> None:
        """Checks the stop conditions on the last emitted token; sets finished_reason."""
        if self.finished:
            return
        sp = self.sampling_params
        n_out = len(self.output_ids)
        if n_out >= sp.max_new_tokens:
            self.finished_reason = {"type": "length", "length": sp.max_new_tokens}
            return
        if self.seqlen >= context_len:
            self.finished_reason = {"type": "length", "length": n_out}
            return
        if n_out == 0:
            return
        last = self.output_ids[-1]
        if self.grammar is not None and last in self.grammar.stop_token_ids:
            self.finished_reason = {"type": "stop", "matched": last}  # the grammar is complete
            return
        if n_out < sp.min_new_tokens:
            return
        if last in sp.stop_token_ids or (not sp.ignore_eos and last in eos_token_ids):
            self.finished_reason = {"type": "stop", "matched": last}
            return
        if tokenizer is None or not (sp.stop or sp.stop_regex):
            return
        if sp.stop:
            max_len = max(len(s) for s in sp.stop)
            tail = tokenizer.decode(self.output_ids[-(max_len + 1):], skip_special_tokens=False)
            for s in sp.stop:
                if s and s in tail:
                    self.finished_reason = {"type": "stop", "matched": s}
                    return
        if sp.stop_regex:
            text = tokenizer.decode(self.output_ids, skip_special_tokens=False)
            for pattern in sp.stop_regex:
                m = re.search(pattern, text)
                if m:
                    self.finished_reason = {"type": "stop", "matched": m.group(0)}
                    return
