"""CudaGraphRunner: DECODE and DRAFT_DECODE forwards captured once per padded batch size, replayed.

A decode or draft step of a small batch is bound by kernel launches (a dozen per layer); a CUDA
graph replays the whole forward, embedding to logits, as one launch. A forward is captured only
where every shape is fixed by its batch size:
- the triton attention backend (its kernels read lengths from tensors; split counts are fixed
  at capture from capacities, never from one step's lengths);
- DECODE over the exact pool, and DRAFT_DECODE whose every layer a kernel reads (token-drop and
  int8 / kivi layouts); VeriCache drafting (new K/V to the draft pool) and lossy drafting (new
  K/V to the exact tail) are separate graphs;
- no staged rows, no logits_indices, batch size <= the largest graph's. Queries captured for a
  query-scored compressor (lossy snapkv) are graph outputs too, copied out after each replay.
The rest runs eagerly (ModelRunner.forward), with the same kernels.

Static inputs, padded to the graph's batch size B: input_ids, positions, out_cache_loc,
req_pool_indices, then seq_lens (DECODE) or chunk_ids [B, C_cap], num_chunks, tail_starts,
tail_lens, draft_table [B, X+1], draft_lens (DRAFT_DECODE). A padding row writes its K/V to slot
0 (every pool's padding slot) and attends to one key there: finite, never read back.
Invariant: replay(fb) returns a view of the graph's logits buffer, valid until the next replay of
any graph (graphs share one memory pool: a later capture may reuse an earlier graph's scratch
memory); callers sample from it at once. Captured queries are copied out for that reason.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_vericache.layers.attention.triton_backend import (
    BLOCK_N,
    QUANTIZED_KINDS,
    DecodeKernelMetadata,
    DraftKernelMetadata,
)
from sglang_vericache.model_executor.forward_batch import DraftContext, ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from sglang_vericache.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

def default_capture_bs(max_bs: int) -> list[int]:
    """SGLang's ladder: 1, 2, 4, 8, then every 8, up to max_bs (always included)."""
    ladder = [b for b in [1, 2, 4, 8] + list(range(16, max_bs + 1, 8)) if b <= max_bs]
    return sorted(set(ladder + [max_bs]))


# ---- graphs -----------------------------------------------------------------------------------


class CudaGraph:
    """torch.cuda.CUDAGraph behind capture(fn) -> outputs and replay(); graphs share one memory pool."""

    pool = None

    def __init__(self) -> None:
        self.graph = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        # Warm-up on a side stream first: Triton compiles, cuBLAS sets up its workspaces.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        if CudaGraph.pool is None:
            CudaGraph.pool = torch.cuda.graph_pool_handle()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the transfer engine's and prefetch threads keep copying while this captures
        with torch.cuda.graph(self.graph, pool=CudaGraph.pool, capture_error_mode="thread_local"):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A CUDA graph's contract without CUDA (tests on a CPU): capture runs fn once with host syncs
    forbidden (what capture forbids), replay runs it again over the same static buffers and copies
    into the captured outputs, so stale or unfilled static inputs show as wrong logits."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn = fn
        with NoHostSync():
            self.out = fn()
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.fn())


class HostSyncError(RuntimeError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raises on ops whose result a CUDA graph cannot hold: device-to-host reads (.item(), bool(t),
    .tolist()) and data-dependent output shapes (nonzero, unique, masked_select)."""

    FORBIDDEN = ("_local_scalar_dense", "nonzero", "unique", "masked_select", "repeat_interleave")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if any(name.startswith(f) for f in self.FORBIDDEN):
            raise HostSyncError(f"{func} inside a captured forward (a host sync or a data-dependent shape)")
        return func(*args, **(kwargs or {}))


# ---- static buffers ---------------------------------------------------------------------------


@dataclass
class _Graph:
    graph: object
    bs: int
    mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor | None = None  # DECODE
    chunk_ids: torch.Tensor | None = None  # DRAFT_DECODE from here on
    num_chunks: torch.Tensor | None = None
    tail_starts: torch.Tensor | None = None
    tail_lens: torch.Tensor | None = None
    draft_table: torch.Tensor | None = None
    draft_lens: torch.Tensor | None = None
    tail_lens_pad: int = 0  # a padding row's tail length (lossy: 1, its one key)
    logits: torch.Tensor | None = None
    captured_q: dict[int, torch.Tensor] | None = None  # layer id -> [B, Hq*D] post-RoPE queries


class CudaGraphRunner:
    def __init__(self, model_runner: ModelRunner, capture_bs: list[int] | None = None,
                 graph_factory: Callable[[], object] = CudaGraph):
        self.mr = model_runner
        args = model_runner.server_args
        max_bs = args.cuda_graph_max_bs or min(args.max_running_requests, 64)
        self.capture_bs = sorted(capture_bs or args.cuda_graph_bs or default_capture_bs(max_bs))
        self.graph_factory = graph_factory
        self.max_draft_rows = args.max_draft_tokens + 1  # a round's draft-pool rows: t_n and X drafts
        self.graphs: dict[tuple, _Graph] = {}
        self.replay_counts: Counter[tuple[str, int]] = Counter()
        self.failed: set[tuple] = set()

    # ---- when ------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        backend = self.mr.attn_backend
        if not getattr(backend, "kernels_fit", False) or not hasattr(backend, "kernels"):
            return False  # triton backend only
        if fb.staged is not None or fb.logits_indices is not None or fb.capture_hidden:
            return False  # (graphs capture queries, not kvzap's hidden states)
        if fb.batch_size > self.capture_bs[-1]:
            return False
        if fb.forward_mode.is_decode():
            return True
        if not fb.forward_mode.is_draft_decode():
            return False
        ctx = fb.draft_ctx
        comp = ctx.compressed_pool
        name = getattr(comp.compressor, "name", "")
        if not all(lay.kind == "token_drop" or name in QUANTIZED_KINDS for lay in comp.layouts):
            return False  # a layer on the torch path (e.g. fp8 chunks)
        if any(s.name == "head" for lay in comp.layouts for s in lay.tensors):
            return False  # head-tagged cells (--kv-head-budget adaptive): the torch path reads them
        if ctx.layer_chunks is not None:
            return False  # layer budgets per segment (PyramidKV's): each layer's own chunks, on the torch path
        if ctx.new_kv == "draft" and max(len(s) for s in ctx.draft_slots) > self.max_draft_rows:
            return False
        return max(len(c) for c in ctx.comp_ids) <= self._chunk_cap(comp)

    def _chunk_cap(self, comp) -> int:
        return -(-self.mr.req_to_token_pool.req_to_token.shape[1] // comp.chunk_size)

    def _key(self, fb: ForwardBatch, bs: int) -> tuple:
        queries = fb.captured_q is not None
        if fb.forward_mode.is_decode():
            return ("DECODE", bs, queries)
        ctx = fb.draft_ctx
        return ("DRAFT_DECODE", bs, queries, ctx.new_kv, id(ctx.compressed_pool), id(ctx.draft_pool))

    # ---- replay ----------------------------------------------------------------------------
    def replay(self, fb: ForwardBatch) -> torch.Tensor | None:
        """-> float32 logits [bs, vocab] (a view of the graph's buffer), or None when this shape
        could not be captured (the caller runs the forward eagerly)."""
        bs = fb.batch_size
        padded = next(b for b in self.capture_bs if b >= bs)
        key = self._key(fb, padded)
        if key in self.failed:
            return None
        g = self.graphs.get(key)
        if g is None:
            try:
                g = self.graphs[key] = self._capture(fb, padded)
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager forwards
                logger.warning("CUDA graph capture of %s failed, running it eagerly: %s", key[:3], e)
                self.failed.add(key)
                return None
        self._fill(g, fb)
        g.graph.replay()
        self.replay_counts[(g.mode.name, padded)] += 1
        if g.captured_q is not None:  # copies: the next replay overwrites the graph's buffers
            fb.captured_q.update({lid: q[:bs].clone() for lid, q in g.captured_q.items()})
        return g.logits[:bs]

    def _fill(self, g: _Graph, fb: ForwardBatch) -> None:
        bs = fb.batch_size
        for dst, src in ((g.input_ids, fb.input_ids), (g.positions, fb.positions),
                         (g.out_cache_loc, fb.out_cache_loc), (g.req_pool_indices, fb.req_pool_indices)):
            dst[:bs].copy_(src)
            dst[bs:].zero_()
        if g.mode.is_decode():
            g.seq_lens[:bs].copy_(fb.seq_lens)
            g.seq_lens[bs:].fill_(1)
            return
        ctx = fb.draft_ctx
        small = torch.tensor([[len(c) for c in ctx.comp_ids], ctx.tail_starts(), ctx.tail_lens])
        pads = (0, 0, g.tail_lens_pad)
        for dst, src, pad in zip((g.num_chunks, g.tail_starts, g.tail_lens), small, pads, strict=True):
            dst[:bs].copy_(src)
            dst[bs:].fill_(pad)
        chunks = pad_sequence([c.to(torch.int64) for c in ctx.comp_ids], batch_first=True)
        g.chunk_ids[:bs, : chunks.shape[1]].copy_(chunks)  # columns past num_chunks are never read
        if g.draft_table is not None:
            slots = pad_sequence([s.to(torch.int64) for s in ctx.draft_slots], batch_first=True)
            g.draft_table[:bs, : slots.shape[1]].copy_(slots)
            g.draft_table[bs:, 0] = 0
            g.draft_lens[:bs].copy_(torch.tensor([len(s) for s in ctx.draft_slots], dtype=torch.int64))
            g.draft_lens[bs:].fill_(1)

    # ---- capture ---------------------------------------------------------------------------
    def _capture(self, fb: ForwardBatch, bs: int) -> _Graph:
        mr, backend = self.mr, self.mr.attn_backend
        dev = mr.token_to_kv_pool.get_key_buffer(0).device
        i64 = dict(dtype=torch.int64, device=dev)
        g = _Graph(self.graph_factory(), bs, fb.forward_mode, torch.zeros(bs, **i64), torch.zeros(bs, **i64),
                   torch.zeros(bs, **i64), torch.zeros(bs, **i64))
        cfg = mr.model_config
        hkv, max_ctx = cfg.num_key_value_heads, mr.req_to_token_pool.req_to_token.shape[1]
        ctx = None
        if g.mode.is_decode():
            g.seq_lens = torch.ones(bs, **i64)
            md = DecodeKernelMetadata(g.req_pool_indices, g.seq_lens, max_ctx,
                                      {hkv: backend.default_splits(bs, hkv, max_ctx, BLOCK_N)})
        else:
            src = fb.draft_ctx
            comp = src.compressed_pool
            cap = self._chunk_cap(comp)
            g.chunk_ids, g.num_chunks = torch.zeros((bs, cap), **i64), torch.zeros(bs, **i64)
            g.tail_starts = torch.zeros(bs, **i64)
            # a padding row needs one key: its draft slot 0, or (lossy) tail slot req_to_token[0, 0]
            g.tail_lens_pad = 0 if src.new_kv == "draft" else 1
            g.tail_lens = torch.full((bs,), g.tail_lens_pad, **i64)
            if src.new_kv == "draft":
                g.draft_table = torch.zeros((bs, self.max_draft_rows), **i64)
                g.draft_lens = torch.ones(bs, **i64)
            tail_cap = 2 * comp.chunk_size  # sizes the tail's split count only
            splits = {(hkv, lay.rows): (backend.default_splits(bs, hkv, cap * lay.rows, BLOCK_N),
                                        backend.default_splits(bs, hkv, tail_cap, BLOCK_N))
                      for lay in comp.layouts}
            md = DraftKernelMetadata(None, g.chunk_ids, g.num_chunks, cap, g.req_pool_indices, g.tail_starts,
                                     g.tail_lens, tail_cap, g.draft_table, g.draft_lens, splits)
            ctx = DraftContext(comp, [torch.zeros(0, dtype=torch.int64)] * bs, [g.tail_lens_pad] * bs,
                               src.draft_pool, [torch.zeros(1, dtype=torch.int64)] * bs if src.draft_pool
                               is not None else None, src.new_kv)
        static = ForwardBatch(
            g.mode, bs, g.input_ids, g.positions, g.req_pool_indices, g.seq_lens if g.seq_lens is not None
            else g.positions + 1, g.positions, torch.ones(bs, **i64), g.out_cache_loc, draft_ctx=ctx,
            captured_q={} if fb.captured_q is not None else None)
        static.req_to_token_pool, static.token_to_kv_pool = mr.req_to_token_pool, mr.token_to_kv_pool
        static.attn_backend = backend

        def forward() -> torch.Tensor:
            backend.forward_metadata = md  # every layer reads the static metadata
            hidden = mr.model.forward(static.input_ids, static.positions, static)
            return mr.model.compute_logits(hidden)

        logger.info("Capturing a CUDA graph: %s, batch size %d", g.mode.name, bs)
        with torch.inference_mode():
            g.logits = g.graph.capture(forward)
        g.captured_q = static.captured_q  # filled by the capture (an EagerGraph: by every replay)
        return g
