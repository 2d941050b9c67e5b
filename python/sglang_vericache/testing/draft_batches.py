"""Drive DRAFT_DECODE on a ModelRunner without a scheduler: compress a request's first pages,
keep a draft pool, build DRAFT_DECODE ForwardBatches (drafting, and lossy mode).

A reference for how the VeriCache scheduler fills DraftContext; builds on forward_batches.py
(a DriverReq's exact KV covers positions [0, kv_len)).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_vericache.compress import CompressorConfig, get_compressor
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool, compress_pages
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.model_executor.forward_batch import DraftContext, ForwardBatch, ForwardMode
from sglang_vericache.testing.forward_batches import DriverReq


@dataclass
class DraftReq:
    req: DriverReq  # exact KV for positions [0, req.kv_len)
    comp_ids: torch.Tensor  # chunks covering positions [0, len(comp_ids) * T)
    draft_slots: list[int] = field(default_factory=list)  # draft-pool slots of positions kv_len, kv_len+1..

    @property
    def next_position(self) -> int:
        return self.req.kv_len + len(self.draft_slots)


class DraftPool:
    """A KV pool shaped like the runner's exact pool, with a trivial slot allocator (slot 0 = padding)."""

    def __init__(self, runner, num_slots: int):
        exact = runner.token_to_kv_pool
        self.kv = MHATokenToKVPool(
            num_slots, exact.num_layers, exact.num_kv_heads, exact.head_dim, exact.dtype, exact.device,
            exact.v_head_dim,
        )
        self.free_slots = list(range(num_slots - 1, 0, -1))

    def alloc(self) -> int:
        assert self.free_slots, "draft pool is full"
        return self.free_slots.pop()

    def free(self, slots: list[int]) -> None:
        self.free_slots.extend(slots)


def make_compressed_pool(runner, name: str, ratio: float, num_chunks: int, **options) -> CompressedKVPool:
    cfg = CompressorConfig.from_model_config(name, ratio, runner.page_size, runner.model_config, **options)
    comp = get_compressor(name, cfg)
    return CompressedKVPool(comp, runner.model_config.num_hidden_layers, num_chunks)


def compress_prefix(
    runner, cpool: CompressedKVPool, req: DriverReq, num_pages: int, random_queries: torch.Generator | None = None
) -> DraftReq:
    """Compress the first num_pages pages of req's exact KV.

    Query-scored compressors (snapkv, pyramidkv, h2o) need the pages' own queries, which only the
    forward that computed them has (kvzip: its reconstruction pass, kvzap: the hidden states): with
    random_queries they score with random_scoring_input instead, so the rows kept are arbitrary
    but the layout (and so the attention cost) is the real one.
    """
    t = cpool.chunk_size
    assert num_pages * t <= req.kv_len, "only pages with exact KV can be compressed"
    ids = cpool.alloc(num_pages)
    assert ids is not None, "compressed pool is full"
    slots = runner.req_to_token_pool.req_to_token[req.pool_idx, : num_pages * t]
    comp = cpool.compressor
    queries = None
    if random_queries is not None:
        queries = [random_scoring_input(comp, layer, (num_pages,), random_queries) for layer in range(cpool.num_layers)]
    compress_pages(comp, runner.token_to_kv_pool, cpool, slots, ids, torch.arange(num_pages * t), queries)
    return DraftReq(req, ids)


def prepare_draft_batch(
    runner, cpool: CompressedKVPool, dreqs: list[DraftReq], input_ids: list[int], draft_pool: DraftPool | None
) -> ForwardBatch:
    """One DRAFT_DECODE step: request i feeds input_ids[i] at its next position.

    draft_pool given (drafting): the new K/V go to a fresh draft slot, appended to dreq.draft_slots.
    draft_pool None (lossy): the new K/V go to the exact pool at the next tail slot (kv_len grows).
    """
    r2t, alloc = runner.req_to_token_pool, runner.token_to_kv_pool_allocator
    t = cpool.chunk_size
    locs, positions, tail_lens, draft_slots = [], [], [], []
    for d in dreqs:
        req = d.req
        positions.append(d.next_position)
        if draft_pool is not None:
            d.draft_slots.append(draft_pool.alloc())
            locs.append(d.draft_slots[-1])
            draft_slots.append(torch.tensor(d.draft_slots, dtype=torch.int64))
        else:
            assert not d.draft_slots, "lossy mode keeps no drafts"
            last_slot = int(r2t.req_to_token[req.pool_idx, req.kv_len - 1]) if req.kv_len else 0
            slot = alloc.alloc_extend(last_slot, req.kv_len, 1)
            assert slot is not None, "KV pool is full"
            r2t.write(req.pool_idx, req.kv_len, slot)
            req.kv_len += 1
            locs.append(int(slot[0]))
        tail_lens.append(req.kv_len - len(d.comp_ids) * t)
    ctx = DraftContext(
        compressed_pool=cpool,
        comp_ids=[d.comp_ids for d in dreqs],
        tail_lens=tail_lens,
        draft_pool=None if draft_pool is None else draft_pool.kv,
        draft_slots=draft_slots if draft_pool is not None else None,
        new_kv="draft" if draft_pool is not None else "exact",
    )
    i64 = dict(dtype=torch.int64)
    pos = torch.tensor(positions, **i64)
    bs = len(dreqs)
    return ForwardBatch(
        forward_mode=ForwardMode.DRAFT_DECODE,
        batch_size=bs,
        input_ids=torch.tensor(input_ids, **i64),
        positions=pos,
        req_pool_indices=torch.tensor([d.req.pool_idx for d in dreqs], **i64),
        seq_lens=pos + 1,
        extend_prefix_lens=pos.clone(),
        extend_seq_lens=torch.ones(bs, **i64),
        out_cache_loc=torch.tensor(locs, **i64),
        seq_lens_cpu=[p + 1 for p in positions],
        extend_prefix_lens_cpu=list(positions),
        extend_seq_lens_cpu=[1] * bs,
        draft_ctx=ctx,
    )


def random_scoring_input(comp, layer: int, lead: tuple[int, ...], gen: torch.Generator, dtype=None):
    """A random stand-in for what comp.compress() scores a chunk with (q), leading dims lead: the
    trailing queries [*lead, W, H_q, D]; kvzip's ReconstructionPass (R = T + 8 rows, no sinks);
    kvzap's hidden states [*lead, T, hidden]; or None for methods that score nothing."""
    cfg = comp.config
    dtype = dtype or cfg.dtype
    rand = lambda *shape: torch.randn((*lead, *shape), generator=gen).to(dtype)  # noqa: E731
    if comp.needs_reconstruction:
        from sglang_vericache.compress.kvzip import ReconstructionPass

        r = cfg.chunk_size + 8
        return ReconstructionPass(rand(r, cfg.num_q_heads, cfg.head_dim), rand(r, cfg.num_kv_heads, cfg.head_dim))
    if getattr(comp, "reads_hidden", False):
        return rand(cfg.chunk_size, comp.surrogate.hidden_size)
    w = comp.query_window(layer)
    return rand(w, cfg.num_q_heads, cfg.head_dim) if w else None
