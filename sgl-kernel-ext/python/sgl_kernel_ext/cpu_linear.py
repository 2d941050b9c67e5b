"""Batch-invariant CPU linear layer (csrc/linear.cpp), built on first use like cpu_attention.

`pack_weight` lays a [N, K] weight out once as panels [ceil(N / 16), K, 16] in its own dtype
(float32, bfloat16 or float16; the last panel zero-padded). `packed_linear(x, packed, bias, n)`
then computes y = x W^T + b with every output element one float32 fused multiply-add chain over k
in order, plus the bias in float32, rounded once to x's dtype (or `out_dtype`). An element's
arithmetic depends on its row of x and its weight column only: not on how many rows are computed
together, where the row sits, the thread count or the vector width (AVX-512, AVX2 + FMA + F16C,
and the scalar fallback agree bitwise), so no probe is needed. Half-precision weights are converted
to float32 in registers: decode reads each weight byte once, in its stored dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sgl_kernel_ext.cpu_attention import build_library

NR = 16  # output features per panel
_SOURCE = Path(__file__).parent / "csrc" / "linear.cpp"
_CFLAGS = ("-ffp-contract=off",)
_SCALAR_CFLAGS = ("-ffp-contract=off", "-DLIN_FORCE_SCALAR", "-DLIN_NS=sgl_kernel_ext_linear_scalar")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load(scalar: bool = False) -> None:
    """Build (once per source and CPU) and load the kernel; `scalar`: the scalar fallback (tests)."""
    if scalar:
        build_library(_SOURCE, "sgl_kernel_ext_linear_scalar", _SCALAR_CFLAGS)
    else:
        build_library(_SOURCE, "sgl_kernel_ext_linear", _CFLAGS)


def isa(scalar: bool = False) -> str:
    """The instruction set the kernel was built for: avx512, avx2 or scalar."""
    load(scalar)
    ops = torch.ops.sgl_kernel_ext_linear_scalar if scalar else torch.ops.sgl_kernel_ext_linear
    return ops.linear_isa()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / NR), K, NR] in the same dtype; output feature p * NR + j is panel p's lane j."""
    if weight.dim() != 2:
        raise ValueError(f"pack_weight: a [N, K] weight, got shape {tuple(weight.shape)}")
    if weight.dtype not in DTYPES:
        raise ValueError(f"pack_weight: weights must be float32, bfloat16 or float16, got {weight.dtype}")
    n, k = weight.shape
    pad = -n % NR
    w = weight.detach()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.reshape(-1, NR, k).transpose(1, 2).contiguous()


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int,
                  out_dtype: torch.dtype | None = None, scalar: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T + bias -> [..., n] in out_dtype (default x's dtype); W given as pack_weight(W)."""
    load(scalar)
    if x.dtype not in DTYPES:
        raise ValueError(f"packed_linear: x must be float32, bfloat16 or float16, got {x.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    b = torch.empty(0) if bias is None else bias.detach().float().contiguous()
    ops = torch.ops.sgl_kernel_ext_linear_scalar if scalar else torch.ops.sgl_kernel_ext_linear
    y = ops.packed_linear(x2, packed, b, n, out_dtype or x.dtype)
    return y.reshape(*lead, n)


def packed_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product in float64 (x and W as given, bias added), for tests: -> float64 [..., N]."""
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()
