"""Drive a ModelRunner directly (no scheduler): allocate slots, build ForwardBatches, greedy-decode.

This is the minimal correct way to build a ForwardBatch for the torch backend; the scheduler
does the same with a radix cache and chunking on top.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_vericache.model_executor.forward_batch import ForwardBatch, ForwardMode


@dataclass
class DriverReq:
    pool_idx: int
    kv_len: int = 0  # positions [0, kv_len) have KV in the pool
    output_ids: list[int] = field(default_factory=list)


def new_req(runner) -> DriverReq:
    idx = runner.req_to_token_pool.alloc()
    assert idx is not None, "req_to_token_pool is full"
    return DriverReq(idx)


def prepare_forward_batch(
    runner, reqs: list[DriverReq], new_ids: list[list[int]], mode: ForwardMode = ForwardMode.EXTEND,
    logits_indices: torch.Tensor | None = None,
) -> ForwardBatch:
    """Allocate KV slots for each request's new tokens, record them in req_to_token, build the batch."""
    r2t = runner.req_to_token_pool
    alloc = runner.token_to_kv_pool_allocator
    locs, positions, prefix_lens, ext_lens, seq_lens = [], [], [], [], []
    for req, ids in zip(reqs, new_ids):
        last_slot = int(r2t.req_to_token[req.pool_idx, req.kv_len - 1]) if req.kv_len else 0
        slots = alloc.alloc_extend(last_slot, req.kv_len, len(ids))
        assert slots is not None, "KV pool is full"
        r2t.write(req.pool_idx, req.kv_len, slots)
        locs.append(slots)
        positions.append(torch.arange(req.kv_len, req.kv_len + len(ids)))
        prefix_lens.append(req.kv_len)
        ext_lens.append(len(ids))
        req.kv_len += len(ids)
        seq_lens.append(req.kv_len)
    i64 = dict(dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(reqs),
        input_ids=torch.tensor([t for ids in new_ids for t in ids], **i64),
        positions=torch.cat(positions),
        req_pool_indices=torch.tensor([r.pool_idx for r in reqs], **i64),
        seq_lens=torch.tensor(seq_lens, **i64),
        extend_prefix_lens=torch.tensor(prefix_lens, **i64),
        extend_seq_lens=torch.tensor(ext_lens, **i64),
        out_cache_loc=torch.cat(locs),
        seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefix_lens,
        extend_seq_lens_cpu=ext_lens,
        logits_indices=logits_indices,
    )


def greedy_generate(runner, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """EXTEND all prompts in one batch, then DECODE the whole batch step by step (argmax)."""
    reqs = [new_req(runner) for _ in prompts]
    logits = runner.forward(prepare_forward_batch(runner, reqs, prompts, ForwardMode.EXTEND))
    for _ in range(max_new_tokens):
        next_ids = logits.argmax(-1).tolist()
        for req, t in zip(reqs, next_ids):
            req.output_ids.append(t)
        if len(reqs[0].output_ids) == max_new_tokens:
            break
        fb = prepare_forward_batch(runner, reqs, [[t] for t in next_ids], ForwardMode.DECODE)
        logits = runner.forward(fb)
    return [r.output_ids for r in reqs]
