"""TorchNativeAttnBackend: reference attention over the paged KV pool, in plain torch ops.

Attention itself is torch's scaled_dot_product_attention with a boolean mask (on CPU a
fused kernel that keeps softmax statistics in float32: about 2x faster than eager matmuls
for decode, and float32 results within ~1e-6 of HF's eager attention), except that on a CPU a
DECODE step reads the pool in place through the batch-invariant C++ kernel whether or not
inference is deterministic (faster than gathering for SDPA: `kernel_decode`). GQA is done by
grouping the query heads that share a KV head (head h uses KV head h // group, as HF's
repeat_kv), never by copying K/V. The arithmetic (SDPA with a mask, grouped SDPA, the batch-invariant
kernel) is in torch_attend.py; this module plans layouts and assembles contexts.

Two layouts, chosen per forward in init_forward_metadata:
- padded: every request's queries padded to Lq = max new tokens and its KV gathered to
  S = max seq_len, one batched matmul for the whole batch (DECODE, TARGET_VERIFY, and any
  EXTEND whose padding waste is small);
- ragged: one matmul per request (EXTEND with very uneven lengths), queries split into blocks
  so the score tensor stays below MAX_SCORE_BYTES.

DRAFT_DECODE (drafting over the compressed tier; lossy mode) uses DraftMetadata. On a CPU each layer
is one call of the fused kernel (draft_kernel.py: chunks read and dequantized in place). The torch
path (the fallback and the reference): per layer,
one gather per context part (compressed rows, exact tail, draft rows) into a padded
[B, S_c + S_t + S_d] context, one mask, one SDPA for the batch. Token-drop chunks are gathered
as stored (exact dtype); quantized chunks are dequantized per layer per forward through
CompressedKVPool.decompress (each distinct chunk once).

Staged rows (ForwardBatch.staged: streamed verification, naive offload) use StagedMetadata: the
padded layout above, but each request's keys are assembled as [its rows of the StagedKV | its new
tokens' K/V] (the same [B, S] order as the pool layout, so results match it exactly); layer l's
StagedKV rows are taken right before its attention and released as soon as they are copied out.
A batch with staged rows, or a MIXED batch, gets MixedMetadata: draft rows first (DraftMetadata),
then resident rows (ForwardBatch.num_resident: verify or decode rows whose exact KV is read from the
pool, the padded layout), then staged rows; linear layers see all tokens at once, attention runs per
group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.base import AttentionBackend
from sglang_vericache.layers.attention.draft_kernel import fused_draft_attention, fused_draft_available
from sglang_vericache.layers.attention.draft_metadata import (
    DraftMetadata,
    build_draft_metadata,
    draft_metadata_for,
    windowed_draft,
)
from sglang_vericache.layers.attention.sliding_window import query_positions, windowed
from sglang_vericache.layers.attention.staged_metadata import (
    StagedMetadata,
    build_staged_metadata,
    staged_context,
)
from sglang_vericache.layers.attention.torch_attend import (
    cpu_kernel_available,
    gather_into,
    grouped_sdpa,
    invariant_attend,
    invariant_context,
    invariant_kernel,
    sdpa_attend,
    sdpa_mask,
)

if TYPE_CHECKING:
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.model_executor.forward_batch import ForwardBatch

MAX_SCORE_BYTES = 256 * 1024 * 1024


@dataclass
class PaddedMetadata:
    batch_size: int
    q_len: int  # Lq
    kv_index: torch.Tensor  # [B, S] slots; 0 (the padding slot) beyond seq_len
    allowed: torch.Tensor | None  # [B, Lq, S] bool attention mask; None = every key visible
    q_index: torch.Tensor | None  # [B*Lq] token row of each padded query (None: identity)
    out_index: torch.Tensor | None  # [T] padded row of each real token (None: identity)
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # group size -> SDPA mask
    causal: bool = False  # allowed is exactly tril(Lq, S) with Lq == S: SDPA's is_causal kernel
    q_pos: torch.Tensor | None = None  # [B, Lq] position of each padded query (sliding-window layers)
    windows: dict = field(default_factory=dict)  # window -> this layout for that window (sliding_window.py)
    start: torch.Tensor | None = None  # [B, Lq] first visible key of each query (a windowed copy's)


@dataclass
class MixedMetadata:
    """Requests [0, num_draft) are draft rows (one token each), the next num_resident requests read
    their context from the pool (padded layout), the rest are staged rows."""

    num_draft: int
    draft: DraftMetadata | None
    staged: StagedMetadata | None
    resident: PaddedMetadata | None = None
    resident_tokens: int = 0  # token rows of the resident requests


@dataclass
class RaggedBlock:
    q_start: int  # first token row of this block
    q_len: int
    kv_index: torch.Tensor  # [1, S_block]
    allowed: torch.Tensor  # [1, q_len, S_block]
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)
    causal: bool = False  # as PaddedMetadata.causal
    q_pos: torch.Tensor | None = None  # as PaddedMetadata's
    windows: dict = field(default_factory=dict)
    start: torch.Tensor | None = None


@dataclass
class RaggedMetadata:
    blocks: list[RaggedBlock]


def _causal_mask(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """[B, q_len, kv_len] bool: query i of request b (position prefix_b + i) sees keys j <= prefix_b + i,
    j < seq_len_b. Padded query rows (i >= extend len) see the whole request, so no row is empty."""
    dev = seq_lens.device
    i = torch.arange(q_len, device=dev)[None, :, None]
    j = torch.arange(kv_len, device=dev)[None, None, :]
    return (j <= prefix_lens[:, None, None] + i) & (j < seq_lens[:, None, None])


class TorchNativeAttnBackend(AttentionBackend):
    supports_sliding_window = True  # RadixAttention.sliding_window: sliding_window.py
    def __init__(self, model_runner=None):
        self.model_runner = model_runner
        self.forward_metadata: PaddedMetadata | RaggedMetadata | DraftMetadata | MixedMetadata | None = None
        num_heads = getattr(getattr(model_runner, "model_config", None), "num_attention_heads", 32)
        self.num_heads = num_heads
        self.force_layout: str | None = None  # "padded" / "ragged" to override the choice (tests)
        self.max_score_bytes = MAX_SCORE_BYTES  # ragged layout: query block size bound
        # --enable-deterministic-inference: every attention goes through the batch-invariant kernel.
        args = getattr(model_runner, "server_args", None)
        self.deterministic = bool(getattr(args, "enable_deterministic_inference", False))
        # its kernel, fixed_chunk_attention's interface; None: the CPU kernel (the triton backend sets its own)
        self.invariant_kernel = None
        # DECODE on a CPU reads the pool in place through the CPU kernel, deterministic inference or not:
        # it is faster than gathering the KV for SDPA at every batch and context measured (bundled model,
        # bf16, 2 threads: 2.0 vs 2.8 ms a step at batch 1 x 256, 12.8 vs 24.5 ms of attention at 16 x 1600,
        # 13.7 vs 84.7 ms at 64 x 512). None: decided at the first DECODE (False on CUDA, or if it does not
        # build); False: SDPA (benchmarks set it to time SDPA).
        self.kernel_decode: bool | None = None
        self._on_cpu = not str(getattr(model_runner, "device", "cpu")).startswith("cuda")
        # DRAFT_DECODE on a CPU: the fused kernel (draft_kernel.py) when it builds; False = torch path.
        self.fused_draft: bool | None = None  # None: decided at the first draft forward
        if getattr(args, "kv_compressor", None) and self._on_cpu and self.uses_fused_draft():
            self.fused_draft = fused_draft_available()  # built at start, not at the first draft

    def uses_fused_draft(self) -> bool:
        """Whether DRAFT_DECODE may use the CPU's fused draft kernel (the triton backend under
        deterministic inference says no: its draft rows go through its own kernel)."""
        return True

    # ---- metadata -------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        if fb.forward_mode.is_draft_decode():
            self.forward_metadata = build_draft_metadata(fb)
            return
        if fb.forward_mode.is_mixed() or fb.staged is not None:
            self.forward_metadata = self._mixed(fb)
            return
        seq_lens = fb.seq_lens_cpu or fb.seq_lens.tolist()
        ext_lens = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        prefix_lens = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
        req_to_token = fb.req_to_token_pool.req_to_token
        bs = fb.batch_size
        max_q, max_s = max(ext_lens), max(seq_lens)
        padded_cost = bs * max_q * max_s
        ragged_cost = sum(e * s for e, s in zip(ext_lens, seq_lens))
        padded = fb.forward_mode.is_decode() or padded_cost <= 2 * ragged_cost + 4096
        if self.force_layout is not None and not fb.forward_mode.is_decode():
            padded = self.force_layout == "padded"
        if padded:
            self.forward_metadata = self._padded(fb, req_to_token, ext_lens, max_q, max_s)
        else:
            self.forward_metadata = self._ragged(fb, req_to_token, seq_lens, ext_lens, prefix_lens)

    def _padded(self, fb, req_to_token, ext_lens, max_q, max_s, rows: slice = slice(None)) -> PaddedMetadata:
        """The padded layout of requests `rows` of fb (all of them by default)."""
        dev = fb.input_ids.device
        seq_lens = fb.seq_lens[rows].to(dev)
        seq_cpu = (fb.seq_lens_cpu or fb.seq_lens.tolist())[rows]
        prefix_lens = (fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist())[rows]
        kv_index = req_to_token[fb.req_pool_indices[rows], :max_s]
        in_range = torch.arange(max_s, device=dev)[None, :] < seq_lens[:, None]
        kv_index = torch.where(in_range, kv_index, torch.zeros_like(kv_index))
        if max_q == 1 and min(seq_cpu) == max_s:
            allowed = None  # one row per request, every request sees all max_s keys (a decode step)
        else:
            allowed = _causal_mask(fb.extend_prefix_lens[rows].to(dev), seq_lens, max_q, max_s)
        q_index = out_index = None
        if any(e != max_q for e in ext_lens):
            ext = fb.extend_seq_lens[rows].to(dev)
            starts = torch.cumsum(ext, 0) - ext
            i = torch.arange(max_q, device=dev)[None, :]
            valid = i < ext[:, None]  # [B, Lq]
            q_index = torch.where(valid, starts[:, None] + i, torch.zeros_like(i)).flatten()
            out_index = valid.flatten().nonzero().squeeze(1)
        causal = (allowed is not None and q_index is None and max_q == max_s and not any(prefix_lens)
                  and min(seq_cpu) == max_s)
        q_pos = query_positions(fb.extend_prefix_lens[rows].to(dev), seq_lens, max_q)
        return PaddedMetadata(len(seq_cpu), max_q, kv_index, allowed, q_index, out_index, causal=causal,
                              q_pos=q_pos)

    def _mixed(self, fb: ForwardBatch) -> MixedMetadata:
        nd, bs, dev = fb.num_draft, fb.batch_size, fb.input_ids.device
        ext_lens = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        prefix_lens = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
        if fb.forward_mode.is_mixed() and fb.draft_ctx is None and fb.staged is None and not fb.num_resident:
            raise ValueError("a MIXED ForwardBatch needs draft rows (draft_ctx), resident rows (num_resident) "
                             "and/or staged rows (staged)")
        if any(e != 1 for e in ext_lens[:nd]):
            raise ValueError("draft rows of a MIXED batch take exactly one new token each")
        n_staged = 0 if fb.staged is None else fb.staged.batch_size
        nr = fb.num_resident
        if nd + nr + n_staged != bs:
            raise ValueError(f"{nd} draft + {nr} resident + {n_staged} staged requests != batch size {bs}")
        r2t = fb.req_to_token_pool.req_to_token
        draft = None
        if nd:
            draft = draft_metadata_for(fb.draft_ctx, fb.req_pool_indices[:nd], r2t, dev)
        resident = None
        if nr:
            rows = slice(nd, nd + nr)
            seq = (fb.seq_lens_cpu or fb.seq_lens.tolist())[rows]
            resident = self._padded(fb, r2t, ext_lens[rows], max(ext_lens[rows]), max(seq), rows)
        staged = None
        if n_staged:
            staged = build_staged_metadata(fb.staged, ext_lens[nd + nr:], prefix_lens[nd + nr:], dev)
        return MixedMetadata(nd, draft, staged, resident, sum(ext_lens[nd : nd + nr]))

    def _ragged(self, fb, req_to_token, seq_lens, ext_lens, prefix_lens) -> RaggedMetadata:
        dev = fb.input_ids.device
        pool_idx = fb.req_pool_indices.tolist()
        blocks: list[RaggedBlock] = []
        q_start = 0
        for r, seq_len, ext, prefix in zip(pool_idx, seq_lens, ext_lens, prefix_lens):
            block = max(1, self.max_score_bytes // (4 * self.num_heads * seq_len))
            for b0 in range(0, ext, block):
                q_len = min(block, ext - b0)
                kv_len = prefix + b0 + q_len  # keys this block can see
                allowed = _causal_mask(
                    torch.tensor([prefix + b0], device=dev), torch.tensor([kv_len], device=dev), q_len, kv_len
                )
                q_pos = torch.arange(prefix + b0, kv_len, device=dev)[None, :]
                blocks.append(RaggedBlock(q_start + b0, q_len, req_to_token[r : r + 1, :kv_len], allowed,
                                          causal=prefix + b0 == 0, q_pos=q_pos))
            q_start += ext
        return RaggedMetadata(blocks)

    # ---- forward --------------------------------------------------------------------------
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, layer.num_heads, layer.head_dim)
        md = self.forward_metadata
        fb = forward_batch
        if isinstance(md, DraftMetadata):
            return self._forward_draft(
                q, k, v, layer, fb.draft_ctx, fb.token_to_kv_pool, fb.out_cache_loc, md, save_kv_cache
            )
        if isinstance(md, MixedMetadata):
            return self._forward_mixed(q, k, v, layer, fb, md, save_kv_cache)
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache:
            k = k.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)
            v = v.reshape(num_tokens, layer.num_kv_heads, layer.v_head_dim)
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        attend = sdpa_attend
        if self.deterministic or (fb.forward_mode.is_decode() and self._decode_in_place()):
            attend = partial(invariant_attend, kernel=self.invariant_kernel)
        window = layer.sliding_window
        if isinstance(md, PaddedMetadata):
            md = windowed(md, window, md.kv_index.shape[1])
            qp = q if md.q_index is None else q.index_select(0, md.q_index)
            out = attend(qp, k_buf, v_buf, md, md.batch_size, md.q_len, layer)
            return out if md.out_index is None else out.index_select(0, md.out_index)
        blocks = [windowed(b, window, b.kv_index.shape[1]) for b in md.blocks]
        outs = [attend(q[b.q_start : b.q_start + b.q_len], k_buf, v_buf, b, 1, b.q_len, layer) for b in blocks]
        return torch.cat(outs, 0)

    def _decode_in_place(self) -> bool:
        """Whether a DECODE step goes through the CPU kernel (see kernel_decode)."""
        if self.kernel_decode is None:
            self.kernel_decode = self._on_cpu and self.invariant_kernel is None and cpu_kernel_available()
        return self.kernel_decode

    def _forward_mixed(self, q, k, v, layer, fb: ForwardBatch, md: MixedMetadata, save_kv_cache: bool):
        """Draft rows first, then resident rows (their attention overlaps the staged layer's copy),
        then staged rows."""
        nd, outs = md.num_draft, []
        if md.draft is not None:
            outs.append(self._forward_draft(q[:nd], k[:nd], v[:nd], layer, fb.draft_ctx, fb.token_to_kv_pool,
                                            fb.out_cache_loc[:nd], md.draft, save_kv_cache))
        t0, t1 = nd, nd + md.resident_tokens
        if md.resident is not None:
            outs.append(self._forward_resident(q[t0:t1], k[t0:t1], v[t0:t1], layer, fb, md.resident,
                                               fb.out_cache_loc[t0:t1], save_kv_cache))
        if md.staged is not None:
            outs.append(self._forward_staged(
                q[t1:], k[t1:], v[t1:], layer, fb, md.staged, fb.out_cache_loc[t1:], save_kv_cache
            ))
        return outs[0] if len(outs) == 1 else torch.cat(outs, 0)

    def _forward_resident(self, q, k, v, layer, fb: ForwardBatch, md: PaddedMetadata, out_loc: torch.Tensor,
                          save_kv_cache: bool):
        """Rows whose exact KV is in the pool (resident): the padded layout, as TARGET_VERIFY."""
        t, pool = q.shape[0], fb.token_to_kv_pool
        if save_kv_cache:
            pool.set_kv_buffer(layer.layer_id, out_loc, k.reshape(t, layer.num_kv_heads, layer.head_dim),
                               v.reshape(t, layer.num_kv_heads, layer.v_head_dim))
        attend = sdpa_attend
        if self.deterministic:
            attend = partial(invariant_attend, kernel=self.invariant_kernel)
        md = windowed(md, layer.sliding_window, md.kv_index.shape[1])
        qp = q if md.q_index is None else q.index_select(0, md.q_index)
        out = attend(qp, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id), md,
                     md.batch_size, md.q_len, layer)
        return out if md.out_index is None else out.index_select(0, md.out_index)

    def _forward_staged(
        self, q, k, v, layer, fb: ForwardBatch, md: StagedMetadata, out_loc: torch.Tensor, save_kv_cache: bool
    ):
        """New tokens over [StagedKV rows | own K/V], causal -> [T, H*Dv]. The new K/V go to the pool."""
        lid, t = layer.layer_id, q.shape[0]
        hkv, d, dv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        md = windowed(md, layer.sliding_window, md.kv_len)
        k, v = k.reshape(t, hkv, d), v.reshape(t, hkv, dv)
        if save_kv_cache:  # the host tier keeps the exact KV of every verified token
            fb.token_to_kv_pool.set_kv_buffer(lid, out_loc, k, v)
        # The new tokens see their own K/V as stored (--kv-cache-dtype), as a decode step would.
        kv_dtype = fb.token_to_kv_pool.dtype
        k, v = k.to(kv_dtype), v.to(kv_dtype)
        staged = fb.staged.kv
        k_rows, v_rows = staged.layer(lid)
        try:
            keys = staged_context(k_rows, k, md, q.dtype)  # [B, S, Hkv, D]
            values = staged_context(v_rows, v, md, q.dtype)
        finally:
            staged.release(lid)  # copied out: the ring slot can take layer lid + depth now
        qp = q if md.q_index is None else q.index_select(0, md.q_index)
        if self.deterministic:
            out = invariant_context(qp, keys, values, md.allowed, md.batch_size, md.q_len, layer,
                                    self.invariant_kernel, md.start)
        else:
            out = grouped_sdpa(qp, keys.transpose(1, 2), values.transpose(1, 2),
                               sdpa_mask(md, layer.num_heads // hkv), md.batch_size, md.q_len, layer)
        return out if md.out_index is None else out.index_select(0, md.out_index)

    def _forward_draft(self, q, k, v, layer, ctx, exact, out_loc, md: DraftMetadata, save_kv_cache: bool):
        """One query per request over [compressed rows | exact tail | draft rows] -> [B, H*Dv]."""
        lid, bs = layer.layer_id, md.batch_size
        hkv, d, dv = layer.num_kv_heads, layer.head_dim, layer.v_head_dim
        if save_kv_cache:  # the new token's K/V first: it attends to itself
            pool = ctx.draft_pool if md.new_kv == "draft" else exact
            pool.set_kv_buffer(lid, out_loc, k.reshape(bs, hkv, d), v.reshape(bs, hkv, dv))
        if self.fused_draft is None:
            self.fused_draft = q.device.type == "cpu" and fused_draft_available()
        full_md, md = md, windowed_draft(md, layer.sliding_window, ctx.compressed_pool.chunk_size)
        if self.fused_draft:
            out = fused_draft_attention(q, layer, ctx, exact, md, full_md)
            if out is not None:
                return out
        layout = ctx.compressed_pool.layouts[lid]
        ci = md.compressed_index(layout)
        # (K source, V source, position-major flat index) per part; sources are [rows, Hkv, D]
        parts = []
        if ci.valid.shape[1]:
            if layout.kind == "token_drop":  # rows stored as they were (exact dtype): gather them
                bufs = ctx.compressed_pool.buffers[lid]
                parts.append((bufs["k"].flatten(0, 1), bufs["v"].flatten(0, 1), ci.flat_index))
            else:  # quantized: dequantize (float32) each distinct chunk once
                parts.append((*ctx.compressed_pool.decompress(lid, ci.chunk_ids), ci.flat_index))
        parts.append((exact.get_key_buffer(lid), exact.get_value_buffer(lid), md.tail_flat))
        if md.draft_flat is not None:
            draft = ctx.draft_pool
            parts.append((draft.get_key_buffer(lid), draft.get_value_buffer(lid), md.draft_flat))
        # Position-major [S, B, Hkv, D]: each part is gathered straight into its slice (no concat).
        s = sum(len(p[2]) for p in parts) // bs
        k_ctx = torch.empty((s * bs, hkv, d), dtype=q.dtype, device=q.device)
        v_ctx = torch.empty((s * bs, hkv, dv), dtype=q.dtype, device=q.device)
        row = 0
        for k_src, v_src, flat in parts:
            gather_into(k_ctx[row : row + len(flat)], k_src, flat)
            gather_into(v_ctx[row : row + len(flat)], v_src, flat)
            row += len(flat)
        mask = md.mask(layout)  # [B, 1, 1, S] or None
        if self.deterministic:  # key j of request b is row j * bs + b of the context
            index = torch.arange(s * bs, device=q.device).view(s, bs).T
            allowed = None if mask is None else mask[:, 0]
            return invariant_kernel(q.view(bs, 1, *q.shape[1:]), k_ctx, v_ctx, index, allowed, layer,
                                    self.invariant_kernel)
        keys = k_ctx.view(s, bs, hkv, d).permute(1, 2, 0, 3)  # [B, Hkv, S, D]
        values = v_ctx.view(s, bs, hkv, dv).permute(1, 2, 0, 3)
        return grouped_sdpa(q, keys, values, mask, bs, 1, layer)
