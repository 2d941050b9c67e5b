"""Batch-invariant RMSNorm for the GPU path of --enable-deterministic-inference.

One program per row; the row's sum of squares is accumulated in BLOCK float32 lanes over the hidden
size in BLOCK steps from 0 upward, then the lanes are added in one fixed reduction; BLOCK depends on
the hidden size alone. A row's result is therefore a function of that row and the weight: not of the
number of rows, the row's place or the device's occupancy (torch's CUDA reduction picks its split from
the tensor's shape). The arithmetic is Hugging Face's LlamaRMSNorm (layers/layernorm.py): float32
statistics, x * rsqrt(mean(x^2) + eps), cast to x's dtype, then times the weight (one rounding to the
result dtype; a bfloat16 / float16 product is exact in float32). Reference: `rms_norm_ref` (equal to
rounding: rsqrt may differ in the last bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import row_sum

MAX_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x, w, y, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for n0 in range(0, N, BLOCK):  # in order: the reduction order is fixed
        c = n0 + cols
        v = tl.load(x + row * stride_x + c, mask=c < N, other=0.0).to(tl.float32)
        acc += v * v
    inv = 1.0 / tl.sqrt(row_sum(acc, 0) / N + eps)
    for n0 in range(0, N, BLOCK):
        c = n0 + cols
        v = tl.load(x + row * stride_x + c, mask=c < N, other=0.0).to(tl.float32)
        h = (v * inv).to(x.dtype.element_ty).to(tl.float32)
        wv = tl.load(w + c, mask=c < N, other=0.0).to(tl.float32)
        tl.store(y + row * stride_y + c, (wv * h).to(y.dtype.element_ty), mask=c < N)


def block_for(hidden: int) -> int:
    """Lanes of the sum of squares: a function of the hidden size only."""
    return min(MAX_BLOCK, triton.next_power_of_2(hidden))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), batch-invariantly, in the
    dtype torch's `weight * h` would give."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match x's last dimension {n}")
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), y, n, x2.stride(0), y.stride(0), float(eps),
                                         BLOCK=block_for(n))
    return y.reshape(*x.shape[:-1], n)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers/layernorm.RMSNorm's arithmetic in torch ops."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
