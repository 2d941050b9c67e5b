"""TritonAttnBackend: the sgl-kernel-ext Triton kernels where one covers the forward, the torch
reference backend (TorchNativeAttnBackend, subclassed) everywhere else.

Kernel paths (metadata planned once per forward in init_forward_metadata, shared by every layer):
- DECODE over the exact pool: `decode_attention` (split-K flash decoding over req_to_token);
- TARGET_VERIFY over the exact pool: `verify_attention` (T new tokens per request, causal);
- DRAFT_DECODE, per layer by the compressed layout: token-drop layouts (streamingllm, snapkv,
  pyramidkv, h2o, knorm) -> `token_drop_decode_attention`; int8 / kivi2 / kivi4 ->
  `quantized_decode_attention` (dequantized in registers); kvquant2-4 / rotatekv2/4 (pre-RoPE keys) ->
  `prerope_decode_attention` (dequantized, rotated back and RoPE'd in registers, with the quantizer's
  own RoPE table). A dropper followed by one of these quantizers (snapkv+kivi4, knorm+kvquant4) takes
  its quantizer's kernel over the kept rows. All read [compressed rows | exact tail | draft-pool rows]
  in one launch chain; lossy mode (new_kv="exact") has no draft part.

Explicit fallbacks to the torch path (same results, same code as the `torch` backend):
- EXTEND (prefill, chunked prefill, prefix-cache extend);
- any batch with staged rows (streamed verification / naive offload) and MIXED batches;
- DRAFT_DECODE layers whose compressed layout no kernel reads (fp8), head-tagged cells (head-adaptive and
  global budgets) and a segment's chunks dealt to the layers (PyramidKV's per-segment budgets);
- models the kernels cannot shape (every mode): head_dim not a power of two >= 16, or a non-float dtype.
`path_counts` counts the layer calls per path ("decode", "verify", "draft_token_drop",
"draft_quantized", "draft_prerope", "torch", "fixed_split"), so a test can check no silent fallback happened.

Under --enable-deterministic-inference every attention row goes through one kernel,
sgl_kernel_ext.fixed_split_attention (chunks of 64 keys at absolute positions, folded in order; its
docstring states the invariant): DECODE, TARGET_VERIFY and EXTEND read the pool through req_to_token
directly (row t sees positions [0, positions[t]]); the torch-path layouts (MIXED, staged rows,
DRAFT_DECODE over its assembled context) call the same kernel in place of the CPU one. So a verify row
equals the decode row at that position and a prefix's KV is the same however it was computed, bitwise,
as on the torch backend; the two backends agree with each other only to rounding. The split-K and
compressed-layout kernels above are not used then (the draft step gathers its context), nor CUDA graphs.

On CPU the kernels run only under TRITON_INTERPRET=1 (set before triton is imported; slow, for
tests); on a GPU they compile. sgl_kernel_ext is imported in __init__, never at module import.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.draft_metadata import DraftMetadata, build_draft_metadata
from sglang_vericache.layers.attention.torch_backend import TorchNativeAttnBackend
from sglang_vericache.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.model_executor.forward_batch import ForwardBatch

QUANTIZED_KINDS = ("int8", "kivi2", "kivi4")  # compressor names the quantized kernel reads
# quantizer names the pre-RoPE kernel reads (not captured in CUDA graphs: eager forwards; the RoPE
# table it reads grows with the context)
PREROPE_KINDS = ("kvquant2", "kvquant3", "kvquant4", "rotatekv2", "rotatekv4")
BLOCK_N = 64  # the decode kernels' key block (sizes the split counts below)


@dataclass
class DecodeKernelMetadata:
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    max_seq_len: int
    splits: dict[int, int] = field(default_factory=dict)  # num KV heads -> split-K count


@dataclass
class VerifyKernelMetadata:
    batch_size: int
    q_len: int  # T_max = the longest request's new tokens
    q_lens: torch.Tensor  # [B] new tokens (its last q_lens positions)
    seq_lens: torch.Tensor  # [B] including the new tokens
    req_pool_indices: torch.Tensor
    q_index: torch.Tensor | None  # [B*T_max] token row of each padded query row (None: identity)
    out_index: torch.Tensor | None  # [T] padded row of each real token (None: identity)


@dataclass
class FixedSplitMetadata:
    """Deterministic DECODE / TARGET_VERIFY / EXTEND: token row t reads req_to_token[row_table[t]]'s
    first row_len[t] slots."""

    row_table: torch.Tensor  # [T]
    row_len: torch.Tensor  # [T] = positions + 1
    rows_per_request: list[int] | None  # None in DECODE (one row each)
    form: str | None  # fixed_split_attention's form: "split" for DECODE on a GPU, else its default


@dataclass
class DraftKernelMetadata:
    draft: DraftMetadata | None  # the torch path's (fallback layers); None in a CUDA graph (none falls back)
    chunk_ids: torch.Tensor  # [B, max(1, C_max)] int64, 0 = padding
    num_chunks: torch.Tensor  # [B]
    max_chunks: int
    req_pool_indices: torch.Tensor
    tail_starts: torch.Tensor  # [B] first tail position in req_to_token
    tail_lens: torch.Tensor  # [B]
    max_tail: int
    draft_table: torch.Tensor | None  # [B, S_d] draft-pool slots in position order (None: lossy)
    draft_lens: torch.Tensor | None  # [B]
    splits: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # (Hkv, rows) -> splits
    rope_tables: dict[int, tuple] = field(default_factory=dict)  # id(pre-RoPE quantizer) -> its cos, sin


class TritonAttnBackend(TorchNativeAttnBackend):
    supports_sliding_window = False  # its kernels have no window: models with one are refused

    def __init__(self, model_runner=None):
        super().__init__(model_runner)
        try:
            import sgl_kernel_ext
            from sgl_kernel_ext._common import default_splits
        except ImportError as e:  # triton or the kernel package missing
            raise RuntimeError(
                "--attention-backend triton needs the triton and sgl-kernel-ext packages "
                f"(pip install -e sgl-kernel-ext): {e}"
            ) from e
        device = str(getattr(model_runner, "device", "cpu"))
        if not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "--attention-backend triton runs its kernels on CUDA; on CPU only under TRITON_INTERPRET=1 "
                "(set before triton is imported; slow, meant for tests)"
            )
        self.kernels = sgl_kernel_ext
        self.default_splits = default_splits
        self.path_counts: Counter[str] = Counter()
        cfg = getattr(model_runner, "model_config", None)
        d = getattr(cfg, "head_dim", 16)
        dtype = getattr(model_runner, "dtype", torch.float32)
        # the kernels need head_dim a power of two >= 16 (K and V share it) and a float query dtype
        float_dtypes = (torch.float32, torch.float16, torch.bfloat16)
        self.kernels_fit = d >= 16 and d & (d - 1) == 0 and dtype in float_dtypes
        if self.deterministic:  # one kernel for every row (module docstring); any head_dim
            from sgl_kernel_ext.fixed_split_attention import fixed_split_attention, fixed_split_attention_masked

            self.fixed_split = fixed_split_attention
            self.invariant_kernel = self._fixed_split_masked
            self.fused_draft = False  # the draft step's torch path, through the same kernel
            self.on_gpu = device.startswith("cuda")
            self._masked = fixed_split_attention_masked

    def uses_fused_draft(self) -> bool:
        return not self.deterministic

    def _fixed_split_masked(self, *args):
        self.path_counts["fixed_split"] += 1
        return self._masked(*args)

    # ---- metadata -------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb, mode = forward_batch, forward_batch.forward_mode
        if self.deterministic:
            direct = mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND)
            if direct and fb.staged is None:
                self.forward_metadata = self._fixed_split_metadata(fb)
                return
            return super().init_forward_metadata(fb)  # MIXED, staged, DRAFT_DECODE: torch path, this kernel
        kernel_mode = mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_DECODE)
        if not (kernel_mode and self.kernels_fit) or fb.staged is not None:
            return super().init_forward_metadata(fb)  # torch path (see the module docstring)
        dev = fb.token_to_kv_pool.get_key_buffer(0).device
        if mode.is_draft_decode():
            self.forward_metadata = self._draft(fb, dev)
        elif mode.is_decode():
            seq = fb.seq_lens_cpu or fb.seq_lens.tolist()
            self.forward_metadata = DecodeKernelMetadata(
                fb.req_pool_indices.to(dev), fb.seq_lens.to(dev), max(seq))
        else:
            self.forward_metadata = self._verify(fb, dev)

    def _fixed_split_metadata(self, fb: ForwardBatch) -> FixedSplitMetadata:
        dev = fb.token_to_kv_pool.get_key_buffer(0).device
        ext = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        decode = fb.forward_mode.is_decode()
        row_table = fb.req_pool_indices.to(dev)
        if not decode:
            row_table = row_table.repeat_interleave(torch.tensor(ext, device=dev), output_size=sum(ext))
        return FixedSplitMetadata(row_table, fb.positions.to(dev) + 1, None if decode else list(ext),
                                  "split" if decode and self.on_gpu else None)

    def _verify(self, fb: ForwardBatch, dev) -> VerifyKernelMetadata:
        ext = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
        bs, max_q = fb.batch_size, max(ext)
        q_index = out_index = None
        if any(e != max_q for e in ext):  # pad each request's rows to T_max (as the torch padded layout)
            e = torch.tensor(ext, dtype=torch.int64, device=dev)
            i = torch.arange(max_q, device=dev)[None, :]
            valid = i < e[:, None]
            q_index = torch.where(valid, (torch.cumsum(e, 0) - e)[:, None] + i, torch.zeros_like(i)).flatten()
            out_index = valid.flatten().nonzero().squeeze(1)
        return VerifyKernelMetadata(bs, max_q, fb.extend_seq_lens.to(dev), fb.seq_lens.to(dev),
                                    fb.req_pool_indices.to(dev), q_index, out_index)

    def _draft(self, fb: ForwardBatch, dev) -> DraftKernelMetadata:
        md = build_draft_metadata(fb)
        ctx = fb.draft_ctx
        i64 = dict(dtype=torch.int64, device=dev)
        num_chunks = [len(ids) for ids in ctx.comp_ids]
        chunk_ids = md.chunk_ids.to(dev)
        if chunk_ids.shape[1] == 0:  # no request has chunks: one padding column keeps the layout
            chunk_ids = torch.zeros((fb.batch_size, 1), **i64)
        draft_table = draft_lens = None
        if md.draft_index is not None:
            draft_table = md.draft_index.to(dev).contiguous()
            draft_lens = torch.tensor([len(s) for s in ctx.draft_slots], **i64)
        return DraftKernelMetadata(
            md, chunk_ids.contiguous(), torch.tensor(num_chunks, **i64), max(num_chunks),
            fb.req_pool_indices.to(dev), torch.tensor(ctx.tail_starts(), **i64),
            torch.tensor(ctx.tail_lens, **i64), max(ctx.tail_lens), draft_table, draft_lens,
        )

    # ---- forward --------------------------------------------------------------------------
    def forward_with(self, md, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                     fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if isinstance(md, FixedSplitMetadata):
            return self._forward_fixed_split(q, k, v, layer, fb, md, save_kv_cache)
        if not isinstance(md, (DecodeKernelMetadata, VerifyKernelMetadata, DraftKernelMetadata)):
            self.path_counts["torch"] += 1
            return super().forward_with(md, q, k, v, layer, fb, save_kv_cache)
        t, h, hkv, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        q = q.reshape(t, h, d)
        if isinstance(md, DraftKernelMetadata):
            return self._forward_draft_kernel(q, k, v, layer, fb, md, save_kv_cache)
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            self.save_kv(pool, layer, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        r2t = fb.req_to_token_pool.req_to_token
        if isinstance(md, DecodeKernelMetadata):
            self.path_counts["decode"] += 1
            if hkv not in md.splits:
                md.splits[hkv] = self.default_splits(t, hkv, md.max_seq_len, BLOCK_N)
            out = self.kernels.decode_attention(q, k_buf, v_buf, r2t, md.req_pool_indices, md.seq_lens,
                                                layer.scaling, md.splits[hkv])
            return out.reshape(t, h * d)
        self.path_counts["verify"] += 1
        qp = q if md.q_index is None else q.index_select(0, md.q_index)
        qp = qp.view(md.batch_size, md.q_len, h, d)
        out = self.kernels.verify_attention(
            qp, md.q_lens, k_buf, v_buf, r2t, md.req_pool_indices, md.seq_lens, layer.scaling)
        out = out.reshape(md.batch_size * md.q_len, h * d)
        return out if md.out_index is None else out.index_select(0, md.out_index)

    def _forward_fixed_split(self, q, k, v, layer, fb: ForwardBatch, md: FixedSplitMetadata, save_kv_cache: bool):
        t, h, hkv, d = q.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            self.save_kv(pool, layer, fb.out_cache_loc, k, v)
        self.path_counts["fixed_split"] += 1
        out = self.fixed_split(q.reshape(t, h, d), pool.get_key_buffer(layer.layer_id),
                               pool.get_value_buffer(layer.layer_id), fb.req_to_token_pool.req_to_token,
                               md.row_table, md.row_len, layer.scaling, md.rows_per_request, md.form)
        return out.to(q.dtype).reshape(t, -1)

    def _torch_draft(self, q, k, v, layer, fb: ForwardBatch, md: DraftKernelMetadata, save_kv_cache: bool):
        self.path_counts["torch"] += 1
        q = q.reshape(q.shape[0], layer.num_heads, layer.head_dim)
        return self._forward_draft(q, k, v, layer, fb.draft_ctx, fb.token_to_kv_pool, fb.out_cache_loc,
                                   md.draft, save_kv_cache)

    def _forward_draft_kernel(self, q, k, v, layer, fb: ForwardBatch, md: DraftKernelMetadata, save_kv_cache):
        """One query per request over [compressed rows | exact tail | draft rows] -> [B, H*D]."""
        ctx, lid = fb.draft_ctx, layer.layer_id
        comp = ctx.compressed_pool
        layout, quant = comp.layouts[lid], comp.compressor
        if hasattr(quant, "stage"):  # DROP+QUANT: this layer's quantizer (of its kept-row count)
            quant = quant.stage(lid)
        name = getattr(quant, "name", "")
        tagged = any(s.name == "head" for s in layout.tensors)  # head-adaptive cells: the torch path reads them
        dealt = ctx.layer_chunks is not None  # layer budgets per segment: each layer's chunks, the torch path's
        if tagged or dealt or (layout.kind != "token_drop" and name not in QUANTIZED_KINDS + PREROPE_KINDS):
            return self._torch_draft(q, k, v, layer, fb, md, save_kv_cache)  # e.g. fp8 chunks
        bs, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        exact = fb.token_to_kv_pool
        if save_kv_cache:  # the new token's K/V first: it attends to itself
            self.save_kv(ctx.draft_pool if ctx.new_kv == "draft" else exact, layer, fb.out_cache_loc, k, v)
        key = (hkv, layout.rows)
        if key not in md.splits:
            md.splits[key] = (self.default_splits(bs, hkv, md.max_chunks * layout.rows, BLOCK_N),
                              self.default_splits(bs, hkv, md.max_tail, BLOCK_N))
        splits, tail_splits = md.splits[key]
        drafts = {}
        if md.draft_table is not None:
            dp = ctx.draft_pool
            drafts = dict(draft_k_buffer=dp.get_key_buffer(lid), draft_v_buffer=dp.get_value_buffer(lid),
                          draft_table=md.draft_table, draft_lens=md.draft_lens)
        tail = (exact.get_key_buffer(lid), exact.get_value_buffer(lid), fb.req_to_token_pool.req_to_token,
                md.req_pool_indices, md.tail_starts, md.tail_lens)
        bufs = comp.buffers[lid]
        opts = dict(sm_scale=layer.scaling, num_kv_splits=splits, num_tail_splits=tail_splits, **drafts)
        if layout.kind == "token_drop":
            self.path_counts["draft_token_drop"] += 1
            out = self.kernels.token_drop_decode_attention(
                q, bufs["k"], bufs["v"], md.chunk_ids, md.num_chunks, *tail, **opts)
        elif name in QUANTIZED_KINDS:
            self.path_counts["draft_quantized"] += 1
            out = self.kernels.quantized_decode_attention(
                q, name, bufs, md.chunk_ids, md.num_chunks, *tail, **opts)
        else:
            self.path_counts["draft_prerope"] += 1
            out = self.kernels.prerope_decode_attention(
                q, name, bufs, self._rope_table(quant, comp, md, q.device), md.chunk_ids, md.num_chunks,
                *tail, key_heads=getattr(quant, "key_heads", 1), **opts)
        return out.reshape(bs, -1)

    @staticmethod
    def _rope_table(quant, comp, md: DraftKernelMetadata, dev) -> tuple:
        """The quantizer's float32 cos, sin covering every position the batch's chunks hold (chunk i of a
        request holds positions below (i + 1) * chunk_size), once per forward."""
        if id(quant) not in md.rope_tables:
            bound = max(1, md.max_chunks * comp.compressor.config.chunk_size)
            md.rope_tables[id(quant)] = quant.rope.table(torch.tensor([bound], device=dev))
        return md.rope_tables[id(quant)]
