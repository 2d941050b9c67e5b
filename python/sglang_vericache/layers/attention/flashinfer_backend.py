"""FlashInferAttnBackend: FlashInfer's paged attention wrappers over the exact pool.

NOT RUN ON A GPU YET: written against FlashInfer 0.7.4's wrapper API (plan() once, run() per layer)
on a machine without a GPU. Tested on CPU (test/test_flashinfer_backend.py) against that version:
every constructor / plan() / run() call binds to 0.7.4's real signatures (extracted from its sources
into test/fixtures/flashinfer-0.7.4-signatures.json), and with a fake flashinfer that implements
0.7.4's documented semantics in torch (int32 page table, NHD (k, v) cache, planned dtypes and
sm_scale, GQA, causal aligned to the end of the KV) the Scheduler's greedy tokens and logits equal
the torch backend's: full mode, VeriCache (TARGET_VERIFY), partly filled last pages, prefix-cache
hits. FlashInfer's kernels themselves are unverified here: run the backend on a GPU before use.

- DECODE: BatchDecodeWithPagedKVCacheWrapper over the exact pool (fp16 / bf16 only: FlashInfer has
  no float32 kernels, and ServerArgs keeps the pool in the model dtype for this backend);
- TARGET_VERIFY and EXTEND: BatchPrefillWithPagedKVCacheWrapper, causal, the new tokens being the
  last extend_seq_lens[i] positions of request i (FlashInfer aligns the causal mask to the end of
  the KV, which is exactly that);
- planned once per forward in init_forward_metadata (page table built from req_to_token), run by
  every layer;
- DRAFT_DECODE, MIXED and staged batches fall back to the torch path (TorchNativeAttnBackend).

Paging: the pool's slot s is token s % page_size of page s // page_size (PagedTokenAllocator hands
out whole aligned pages), so the per-layer buffers [num_slots, Hkv, D] are viewed as
[num_pages + 1, page_size, Hkv, D] (NHD) with no copy, and request i's pages are
req_to_token[r, 0 : seq_len : page_size] // page_size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.torch_backend import TorchNativeAttnBackend
from sglang_vericache.model_executor.forward_batch import ForwardMode

if TYPE_CHECKING:
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.model_executor.forward_batch import ForwardBatch

NEEDS = "--attention-backend flashinfer needs an NVIDIA GPU with the flashinfer package installed"
WORKSPACE_BYTES = 256 * 1024 * 1024
# FlashInfer builds kernels for fp16 / bf16 queries only (0.7.4: float32 is not in jit/utils.py's
# dtype_map, so plan() would fail with a KeyError deep in its JIT): --dtype float32 is refused here.
DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class FlashInferMetadata:
    wrapper: object  # the planned decode or prefill wrapper
    decode: bool


class FlashInferAttnBackend(TorchNativeAttnBackend):
    supports_sliding_window = False  # its kernels have no window: models with one are refused

    def __init__(self, model_runner=None):
        super().__init__(model_runner)
        device = str(getattr(model_runner, "device", "cpu"))
        _check_device(device)
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(f"{NEEDS} ({e})") from e
        cfg = model_runner.model_config
        self.page_size = model_runner.page_size
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.sm_scale = _model_scaling(model_runner.model, self.head_dim)  # planned once: one scale per model
        self.q_dtype = model_runner.dtype
        if self.q_dtype not in DTYPES:
            raise RuntimeError(f"--attention-backend flashinfer needs --dtype float16 or bfloat16 "
                               f"(FlashInfer has no {self.q_dtype} kernels)")
        self.kv_dtype = model_runner.token_to_kv_pool.dtype
        # zeros: the decode wrapper's float workspace "must be initialized to 0 for its first use"
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        group = self.num_heads // self.num_kv_heads
        # tensor cores pay off for decode once a KV head serves several query heads (or fp8 KV)
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=group >= 4 or self.kv_dtype.itemsize == 1)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    # ---- metadata -------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb, mode = forward_batch, forward_batch.forward_mode
        planned = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.EXTEND)
        if fb.staged is not None or mode not in planned:
            return super().init_forward_metadata(fb)  # DRAFT_DECODE, MIXED, staged rows: torch path
        dev = self.workspace.device
        indptr, indices, last_page_len = self._page_table(fb, dev)
        dtypes = dict(q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)
        if mode == ForwardMode.DECODE:
            self.decode_wrapper.plan(indptr, indices, last_page_len, self.num_heads, self.num_kv_heads,
                                     self.head_dim, self.page_size, pos_encoding_mode="NONE", **dtypes)
            self.forward_metadata = FlashInferMetadata(self.decode_wrapper, True)
            return
        ext = fb.extend_seq_lens.to(dev, torch.int32)
        qo_indptr = torch.zeros(fb.batch_size + 1, dtype=torch.int32, device=dev)
        qo_indptr[1:] = torch.cumsum(ext, 0)
        self.prefill_wrapper.plan(qo_indptr, indptr, indices, last_page_len, self.num_heads,
                                  self.num_kv_heads, self.head_dim, self.page_size, causal=True,
                                  pos_encoding_mode="NONE", **dtypes)
        self.forward_metadata = FlashInferMetadata(self.prefill_wrapper, False)

    def _page_table(self, fb: ForwardBatch, dev):
        """(kv_indptr [B+1], kv_indices [pages], kv_last_page_len [B]) int32, from req_to_token."""
        ps = self.page_size
        seq = fb.seq_lens_cpu or fb.seq_lens.tolist()
        r2t = fb.req_to_token_pool.req_to_token
        pages = [-(-s // ps) for s in seq]
        rows = fb.req_pool_indices.tolist()
        indices = torch.cat([r2t[r, 0 : n * ps : ps] for r, n in zip(rows, pages)]).to(dev) // ps
        indptr = torch.tensor([0] + pages, dtype=torch.int32, device=dev).cumsum(0, dtype=torch.int32)
        last = torch.tensor([s - (n - 1) * ps for s, n in zip(seq, pages)], dtype=torch.int32, device=dev)
        return indptr, indices.to(torch.int32), last

    # ---- forward --------------------------------------------------------------------------
    def forward_with(self, md, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                     fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if not isinstance(md, FlashInferMetadata):
            return super().forward_with(md, q, k, v, layer, fb, save_kv_cache)
        t, hkv, d = q.shape[0], layer.num_kv_heads, layer.head_dim
        pool = fb.token_to_kv_pool
        if save_kv_cache:
            self.save_kv(pool, layer, fb.out_cache_loc, k, v)
        paged = (
            pool.get_key_buffer(layer.layer_id).view(-1, self.page_size, hkv, d),
            pool.get_value_buffer(layer.layer_id).view(-1, self.page_size, hkv, d),
        )
        assert layer.scaling == self.sm_scale, "FlashInfer plans one sm_scale for every layer"
        out = md.wrapper.run(q.reshape(t, layer.num_heads, d), paged)
        return out.reshape(t, layer.num_heads * d)


def _check_device(device: str) -> None:
    """FlashInfer's kernels are CUDA only (a seam: the CPU tests replace it to run a fake flashinfer)."""
    if not torch.cuda.is_available() or not device.startswith("cuda"):
        raise RuntimeError(f"{NEEDS} (no CUDA device here: device={device!r})")


def _model_scaling(model, head_dim: int) -> float:
    """The attention scale of the model's layers (the first RadixAttention's; 1/sqrt(D) if none)."""
    from sglang_vericache.layers.radix_attention import RadixAttention

    return next((m.scaling for m in model.modules() if isinstance(m, RadixAttention)), head_dim**-0.5)
