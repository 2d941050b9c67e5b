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


def mixed_batch(draft_fb: ForwardBatch, staged_fb: ForwardBatch) -> ForwardBatch:
    """One MIXED batch: draft_fb's DRAFT_DECODE rows first, then staged_fb's staged rows.
    logits_indices: None (each request's last token: draft rows, then each staged request's last),
    or staged_fb's rows shifted past the draft rows, after each draft row."""
    assert draft_fb.forward_mode.is_draft_decode() and staged_fb.staged is not None
    nd = draft_fb.batch_size
    logits_indices = None
    if staged_fb.logits_indices is not None:
        logits_indices = torch.cat([torch.arange(nd), staged_fb.logits_indices + nd])
    cat = dict(
        (f, torch.cat([getattr(draft_fb, f), getattr(staged_fb, f)]))
        for f in ("input_ids", "positions", "req_pool_indices", "seq_lens", "extend_prefix_lens",
                  "extend_seq_lens", "out_cache_loc")
    )
    lists = dict(
        (f, list(getattr(draft_fb, f)) + list(getattr(staged_fb, f)))
        for f in ("seq_lens_cpu", "extend_prefix_lens_cpu", "extend_seq_lens_cpu")
    )
    return dataclasses.replace(
        staged_fb, forward_mode=ForwardMode.MIXED, batch_size=nd + staged_fb.batch_size,
        draft_ctx=draft_fb.draft_ctx, logits_indices=logits_indices, **cat, **lists,
    )
