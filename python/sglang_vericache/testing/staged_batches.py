"""Drive staged (streamed-verification) and MIXED forwards on a ModelRunner without a scheduler.

A reference for how the staggering scheduler fills ForwardBatch.staged and builds a MIXED batch;
builds on forward_batches.py (a DriverReq's exact KV covers positions [0, kv_len)) and
draft_batches.py (DRAFT_DECODE batches).
"""

from __future__ import annotations

import dataclasses

import torch

from sglang_vericache.mem_cache.kv_stager import LayerwiseKVStager
from sglang_vericache.model_executor.forward_batch import ForwardBatch, ForwardMode, StagedVerify
from sglang_vericache.testing.forward_batches import DriverReq, prepare_forward_batch


def staged_slots(runner, reqs: list[DriverReq]) -> tuple[torch.Tensor, list[int], list[int]]:
    """-> (slots to stage, offsets, prefix_lens): each request's committed exact KV [0, kv_len),
    concatenated request by request."""
    r2t = runner.req_to_token_pool.req_to_token
    prefix_lens = [r.kv_len for r in reqs]
    offsets = [sum(prefix_lens[:i]) for i in range(len(reqs))]
    slots = [r2t[r.pool_idx, : r.kv_len] for r in reqs]
    return torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64), offsets, prefix_lens


def prepare_staged_batch(
    runner, stager: LayerwiseKVStager, reqs: list[DriverReq], new_ids: list[list[int]],
    mode: ForwardMode = ForwardMode.TARGET_VERIFY, logits_indices: torch.Tensor | None = None,
) -> ForwardBatch:
    """A batch whose every request reads its context from a StagedKV begun here (the copies of the
    first layers start now, before the forward). mode TARGET_VERIFY (x+1 tokens each: streamed
    verify) or DECODE (1 token each: full mode with the exact KV offloaded to host)."""
    slots, offsets, prefix_lens = staged_slots(runner, reqs)
    staged = StagedVerify(stager.begin(slots), offsets, prefix_lens)
    fb = prepare_forward_batch(runner, reqs, new_ids, mode, logits_indices)
    fb.staged = staged
    return fb


def mixed_batch(draft_fb: ForwardBatch | None, staged_fb: ForwardBatch | None,
                resident_fb: ForwardBatch | None = None) -> ForwardBatch:
    """One MIXED batch: draft_fb's DRAFT_DECODE rows first, then resident_fb's rows (context in the
    pool: a TARGET_VERIFY / DECODE batch), then staged_fb's staged rows; any part may be None.
    logits_indices: None (each request's last token), or every token of the verifying parts shifted
    past the draft rows, after each draft row."""
    assert draft_fb is None or draft_fb.forward_mode.is_draft_decode()
    assert staged_fb is None or staged_fb.staged is not None
    assert resident_fb is None or resident_fb.staged is None
    parts = [fb for fb in (draft_fb, resident_fb, staged_fb) if fb is not None]
    nd = 0 if draft_fb is None else draft_fb.batch_size
    verifying = [fb for fb in (resident_fb, staged_fb) if fb is not None]
    logits_indices = None
    if verifying and all(fb.logits_indices is not None for fb in verifying):
        idx, base = [torch.arange(nd)], nd
        for fb in verifying:
            idx.append(fb.logits_indices + base)
            base += fb.num_tokens
        logits_indices = torch.cat(idx)
    cat = dict(
        (f, torch.cat([getattr(fb, f) for fb in parts]))
        for f in ("input_ids", "positions", "req_pool_indices", "seq_lens", "extend_prefix_lens",
                  "extend_seq_lens", "out_cache_loc")
    )
    lists = dict(
        (f, [x for fb in parts for x in getattr(fb, f)])
        for f in ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu")
    )
    return dataclasses.replace(
        parts[-1], forward_mode=ForwardMode.MIXED, batch_size=sum(fb.batch_size for fb in parts),
        draft_ctx=None if draft_fb is None else draft_fb.draft_ctx, logits_indices=logits_indices,
        staged=None if staged_fb is None else staged_fb.staged,
        num_resident=0 if resident_fb is None else resident_fb.batch_size, **cat, **lists,
    )
