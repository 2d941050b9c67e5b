"""Batch-invariant arithmetic: deterministic inference (the default; --disable-deterministic-inference
turns it off).

Invariant (what every layer below guarantees when it is on): a token row's result is computed by
the same arithmetic in the same order whatever else shares the forward (how many rows, which
rows, where the row sits, how many threads). Then a request's output is one function of
(checkpoint, prompt, seed): alone or batched, chunked or not, cache hit or miss, full mode or a
VeriCache verify pass.

- Matrix products: a library GEMM picks its kernel, blocking and summation order by the row count
  (on an AVX2 EPYC, MKL float32 changes a row's bits for M = 1, 2, 3, 5, ... against M = 16; a
  Sapphire Rapids Xeon's one-row bfloat16 kernel rounds about one output in 30 000 differently), so
  on a CPU every linear layer goes through sgl_kernel_ext.cpu_linear instead (`pack_linear_layers`):
  each output element is one float32 fused multiply-add chain over k in order, rounded once, whatever
  the row count, the thread count or the vector width. Invariant by construction: nothing is probed.
  Its weights are packed once at load, in their stored dtype (no float32 copies; half values are
  converted in registers).
- Element-wise ops: torch's vectorized loops finish each thread's range with scalar code, and
  float32 silu's scalar and vector paths differ in ~4% of inputs (exp does not); `silu_and_mul`
  uses x / (1 + exp(-x)) in float32.
  With the triton backend (`enable_batch_invariance(model, "triton")`) every linear layer is
  sgl_kernel_ext.batch_invariant_matmul instead (TRITON_MODE): fixed tiles, one in-order pass over K,
  invariant by construction.
- Attention: sgl_kernel_ext.cpu_attention (fixed chunks of visible keys, float32 statistics); with the
  triton backend sgl_kernel_ext.fixed_split_attention (the same chunking, as Triton tiles).
- Norms, softmax, log_softmax and the sampler work per row on a CPU (checked in the tests). On a GPU
  torch's CUDA reductions pick their split from the tensor's shape, so on the triton backend
  (`row_kernels`, by default when the model is on CUDA) RMSNorm is sgl_kernel_ext.batch_invariant_rmsnorm
  and the sampler's log_softmax / logsumexp sgl_kernel_ext.batch_invariant_softmax (one program per
  row, fixed block order); `uses_triton_row_kernels` says when. On a CPU they stay torch's: the
  interpreter would run them one row-program at a time.
- Host overhead on a CPU (otherwise ~50 torch ops per decoder layer, whose dispatch costs more than their
  arithmetic at batch 1):
  RMSNorm, SiLU-and-mul and RoPE go through sgl_kernel_ext.cpu_rowwise, one call each computing the
  torch chain's bits (its mean and exp are torch's own); decoder layers with `enable_cpu_fusion`
  (models/llama.py) run their two halves around attention as one call each, the same kernels in order.
"""

from __future__ import annotations

import logging
import time

import torch

logger = logging.getLogger(__name__)

TRITON_MODE = ("triton", 0)  # sgl_kernel_ext.batch_invariant_matmul (the triton backend's linear mode)
CPU_MODE = ("packed", 16)  # sgl_kernel_ext.cpu_linear: weights in panels of 16 output features


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: tuple[str, int]) -> torch.Tensor:
    """F.linear through the triton backend's batch-invariant matmul (mode TRITON_MODE)."""
    if mode != TRITON_MODE:
        raise ValueError(f"batch_invariant.linear: unknown mode {mode!r} (CPU layers use packed_linear)")
    from sgl_kernel_ext.batch_invariant_matmul import batch_invariant_linear

    return batch_invariant_linear(x, weight, bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """x @ W^T (+ bias) from W packed by pack_linear_layers, rounded to x's dtype."""
    from sgl_kernel_ext.cpu_linear import packed_linear as kernel

    return kernel(x, packed, bias, n)


pack_version = 0  # counts pack_linear_layers calls: operands cached from packed weights are stale when it moved


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Packs every linear layer's weight for sgl_kernel_ext.cpu_linear (its bias kept in float32);
    -> the packed bytes. Call again after the weights change."""
    global pack_version
    pack_version += 1
    from sgl_kernel_ext import cpu_linear

    from sglang_vericache.layers.linear import Linear

    cpu_linear.load()
    start, total, layers = time.perf_counter(), 0, 0
    for mod in model.modules():
        if isinstance(mod, Linear):
            mod.packed = cpu_linear.pack_weight(mod.weight)
            mod.packed_bias = None if mod.bias is None else mod.bias.detach().float().contiguous()
            mod.packed_bias_arg = torch.empty(0) if mod.packed_bias is None else mod.packed_bias
            mod.packed_op = torch.ops.sgl_kernel_ext_linear.packed_linear
            mod.gemm_weight = mod.gemm_bias = None
            total += mod.packed.numel() * mod.packed.element_size()
            layers += 1
    logger.info("deterministic inference: %d linear layers packed for the %s kernel (%.1f MB in their dtype) in %.2f s",
                layers, cpu_linear.isa(), total / 2**20, time.perf_counter() - start)
    return total


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate, up] -> silu(gate) * up, silu in float32 as x / (1 + exp(-x)), rounded as F.silu's is."""
    d = x.shape[-1] // 2
    g = x[..., :d].float()
    return (g / (1.0 + torch.exp(-g))).to(x.dtype) * x[..., d:]


def uses_triton_row_kernels(enable_deterministic_inference: bool, attention_backend: str, device) -> bool:
    """RMSNorm and the sampler's log_softmax / logsumexp through the Triton kernels (module docstring)?"""
    return enable_deterministic_inference and attention_backend == "triton" and str(device).startswith("cuda")


def enable_batch_invariance(model: torch.nn.Module, attention_backend: str = "torch",
                            row_kernels: bool | None = None) -> tuple[str, int]:
    """Switch the model's linear layers and activations (and with row_kernels its RMSNorms; None:
    on the triton backend with the model on CUDA) to batch-invariant arithmetic; -> the linear
    mode (TRITON_MODE with the triton backend, else CPU_MODE: weights packed for cpu_linear)."""
    from sglang_vericache.layers.activation import SiluAndMul
    from sglang_vericache.layers.layernorm import RMSNorm
    from sglang_vericache.layers.linear import Linear

    mode = TRITON_MODE if attention_backend == "triton" else CPU_MODE
    rowwise = None
    if mode == CPU_MODE:
        pack_linear_layers(model)
        from sglang_vericache.layers.rotary_embedding import use_cpu_kernel

        use_cpu_kernel()  # loads sgl_kernel_ext.cpu_rowwise
        rowwise = torch.ops.sgl_kernel_ext_rowwise  # rms_norm and silu_and_mul: the same bits as the torch chains
    if row_kernels is None:
        row_kernels = uses_triton_row_kernels(True, attention_backend, next(model.parameters(), torch.empty(0)).device)
    norm_kernel = rowwise.rms_norm if rowwise is not None else None
    if row_kernels:
        from sgl_kernel_ext.batch_invariant_rmsnorm import rms_norm as norm_kernel
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            mod.batch_invariant_kernel = norm_kernel
        elif isinstance(mod, Linear):
            mod.batch_invariant_mode = mode if mode == TRITON_MODE else None
        elif isinstance(mod, SiluAndMul):
            mod.batch_invariant = True
            mod.kernel = None if rowwise is None else rowwise.silu_and_mul
        elif isinstance(mod, torch.nn.Linear):
            raise TypeError(f"{type(mod).__name__} is a plain nn.Linear: use layers.linear.Linear")
    if mode == CPU_MODE:  # decoder layers that fuse their CPU ops (models/llama.py's) turn that on
        for mod in model.modules():
            if callable(getattr(mod, "enable_cpu_fusion", None)):
                mod.enable_cpu_fusion()
    return mode
