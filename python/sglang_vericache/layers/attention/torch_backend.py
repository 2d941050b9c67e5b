"""TorchNativeAttnBackend: reference attention over the paged KV pool, in plain torch ops.

Attention itself is torch's scaled_dot_product_attention with a boolean mask (on CPU a
fused kernel that keeps softmax statistics in float32: about 2x faster than eager matmuls
for decode, and float32 results within ~1e-6 of HF's eager attention), except that on a CPU a
DECODE step reads the pool in place through the batch-invariant C++ kernel whether or not
inference is deterministic (faster than gathering for SDPA: `kernel_decode`). GQA is done by
grouping the query heads that share a KV head (head h uses KV head h // group, as HF's
repeat_kv), never by copying K/V. The arithmetic (SDPA with a mask, grouped SDPA, the batch-invariant
kernel) is in torch_attend.py; this module plans layouts and assembles contexts.

Two layouts (torch_metadata.py), chosen per forward in init_forward_metadata: padded (one batched
matmul for the whole batch: DECODE, TARGET_VERIFY, and any EXTEND whose padding waste is small) and
ragged (one matmul per request, in query blocks: EXTEND with very uneven lengths).

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

from functools import partial
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.base import AttentionBackend
from sglang_vericache.layers.attention.cpu_decode import CpuDecodePlan, cpu_decode_plan
from sglang_vericache.layers.attention.draft_kernel import fused_draft_attention, fused_draft_available
from sglang_vericache.layers.attention.draft_metadata import DraftMetadata, build_draft_metadata, windowed_draft
from sglang_vericache.layers.attention.head_tagged import tagged_draft_attention
from sglang_vericache.layers.attention.sliding_window import windowed
from sglang_vericache.layers.attention.staged_metadata import StagedMetadata, staged_context
from sglang_vericache.layers.attention.torch_attend import (
    cpu_kernel_available,
    gather_parts,
    grouped_sdpa,
    invariant_attend,
    invariant_context,
    invariant_kernel,
    sdpa_attend,
    sdpa_mask,
)
from sglang_vericache.layers.attention.torch_metadata import (
    MAX_SCORE_BYTES,
    MixedMetadata,
    PaddedMetadata,
    RaggedMetadata,
    mixed_metadata,
    padded_metadata,
    ragged_metadata,
)

if TYPE_CHECKING:
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.model_executor.forward_batch import ForwardBatch


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
        # this forward's DECODE attention operands for a fused CPU decoder layer (cpu_decode.py), or None
        self.cpu_decode: CpuDecodePlan | None = None
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
        self.cpu_decode = None
        if fb.forward_mode.is_draft_decode():
            self.forward_metadata = build_draft_metadata(fb)
            return
        if fb.forward_mode.is_mixed() or fb.staged is not None:
            self.forward_metadata = mixed_metadata(fb)
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
            self.forward_metadata = padded_metadata(fb, req_to_token, ext_lens, max_q, max_s)
            if fb.forward_mode.is_decode() and type(self).forward is TorchNativeAttnBackend.forward:
                self.cpu_decode = cpu_decode_plan(fb, self.forward_metadata, self._decode_in_place())
        else:
            self.forward_metadata = ragged_metadata(fb, req_to_token, seq_lens, ext_lens, prefix_lens,
                                                   self.num_heads, self.max_score_bytes)

    # ---- forward --------------------------------------------------------------------------
    def forward_with(self, md, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                     fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        q = q.reshape(q.shape[0], layer.num_heads, layer.head_dim)
        if isinstance(md, DraftMetadata):
            return self._forward_draft(
                q, k, v, layer, fb.draft_ctx, fb.token_to_kv_pool, fb.out_cache_loc, md, save_kv_cache
            )
        if isinstance(md, MixedMetadata):
            return self._forward_mixed(q, k, v, layer, fb, md, save_kv_cache)
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            self.save_kv(pool, layer, fb.out_cache_loc, k, v)
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        attend = sdpa_attend
        if self.deterministic or (fb.forward_mode.is_decode() and self._decode_in_place()):
            attend = partial(invariant_attend, kernel=self.invariant_kernel)
        if isinstance(md, PaddedMetadata):
            return _attend_padded(attend, q, k_buf, v_buf, md, layer)
        blocks = [windowed(b, layer.sliding_window, b.kv_index.shape[1]) for b in md.blocks]
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
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            self.save_kv(pool, layer, out_loc, k, v)
        attend = sdpa_attend
        if self.deterministic:
            attend = partial(invariant_attend, kernel=self.invariant_kernel)
        return _attend_padded(attend, q, pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id),
                              md, layer)

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
            self.save_kv(ctx.draft_pool if md.new_kv == "draft" else exact, layer, out_loc, k, v)
        if self.fused_draft is None:
            self.fused_draft = q.device.type == "cpu" and fused_draft_available()
        md = md.at_layer(lid)  # global budgets: the layer's own chunks
        full_md, md = md, windowed_draft(md, layer.sliding_window, ctx.compressed_pool.chunk_size)
        if self.fused_draft:
            out = fused_draft_attention(q, layer, ctx, exact, md, full_md)
            if out is not None:
                return out
        layout = ctx.compressed_pool.layouts[lid]
        ci = md.compressed_index(layout)
        bufs = ctx.compressed_pool.flat if md.flat else ctx.compressed_pool.buffers[lid]
        if "head" in bufs and ci.valid.shape[1]:  # head-adaptive budgets: cells tagged with their KV head
            rest = [(exact.get_key_buffer(lid), exact.get_value_buffer(lid), md.tail_flat)]
            if md.draft_flat is not None:
                rest.append((ctx.draft_pool.get_key_buffer(lid), ctx.draft_pool.get_value_buffer(lid), md.draft_flat))
            return tagged_draft_attention(q, layer, bufs, ci, md, rest, self.deterministic, self.invariant_kernel)
        # (K source, V source, position-major flat index) per part; sources are [rows, Hkv, D]
        parts = []
        if ci.valid.shape[1]:
            if layout.kind == "token_drop":  # rows stored as they were (exact dtype): gather them
                parts.append((bufs["k"].flatten(0, 1), bufs["v"].flatten(0, 1), ci.flat_index))
            else:  # quantized: dequantize (float32) each distinct chunk once
                parts.append((*ctx.compressed_pool.decompress(lid, ci.chunk_ids), ci.flat_index))
        parts.append((exact.get_key_buffer(lid), exact.get_value_buffer(lid), md.tail_flat))
        if md.draft_flat is not None:
            draft = ctx.draft_pool
            parts.append((draft.get_key_buffer(lid), draft.get_value_buffer(lid), md.draft_flat))
        k_ctx, v_ctx, s = gather_parts(parts, bs, q)  # position-major [S, B, Hkv, D]
        mask = md.mask(layout)  # [B, 1, 1, S] or None
        if self.deterministic:  # key j of request b is row j * bs + b of the context
            index = torch.arange(s * bs, device=q.device).view(s, bs).T
            allowed = None if mask is None else mask[:, 0]
            return invariant_kernel(q.view(bs, 1, *q.shape[1:]), k_ctx, v_ctx, index, allowed, layer,
                                    self.invariant_kernel)
        keys = k_ctx.view(s, bs, hkv, d).permute(1, 2, 0, 3)  # [B, Hkv, S, D]
        values = v_ctx.view(s, bs, hkv, dv).permute(1, 2, 0, 3)
        return grouped_sdpa(q, keys, values, mask, bs, 1, layer)


def _attend_padded(attend, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, md: PaddedMetadata,
                   layer: RadixAttention) -> torch.Tensor:
    """The padded layout's attention (its window's copy for a sliding-window layer) -> [T, H*Dv]."""
    md = windowed(md, layer.sliding_window, md.kv_index.shape[1])
    qp = q if md.q_index is None else q.index_select(0, md.q_index)
    out = attend(qp, k_buf, v_buf, md, md.batch_size, md.q_len, layer)
    return out if md.out_index is None else out.index_select(0, md.out_index)
