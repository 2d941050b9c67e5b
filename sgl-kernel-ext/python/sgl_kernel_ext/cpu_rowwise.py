"""The decoder layer's row-wise CPU ops (csrc/rowwise.cpp), built on first use like cpu_linear.

Each op is one call where the layer made a chain of torch ops (a decode step makes a few hundred of
them: their dispatch, not their arithmetic, is what costs), and computes the same bits as that chain,
given here as the `*_ref` functions: it rounds where the chain rounds, and takes RMSNorm's mean and
SiLU's exp from torch itself. A row's values depend on that row only (batch-invariant as the chains
are), on any thread count and instruction set.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sgl_kernel_ext.cpu_attention import build_library

_SOURCE = Path(__file__).parent / "csrc" / "rowwise.cpp"
_CFLAGS = ("-ffp-contract=off",)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def load() -> None:
    """Build (once per source and CPU) and load the ops."""
    build_library(_SOURCE, "sgl_kernel_ext_rowwise", _CFLAGS)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D] (last dim contiguous), cos / sin [T, 1, D], one dtype -> rotated q, k."""
    load()
    return torch.ops.sgl_kernel_ext_rowwise.rotary(q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] = [gate, up] -> silu(gate) * up (silu in float32 as g / (1 + exp(-g)))."""
    load()
    return torch.ops.sgl_kernel_ext_rowwise.silu_and_mul(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: float32 statistics, cast to x's dtype, then times the weight."""
    load()
    return torch.ops.sgl_kernel_ext_rowwise.rms_norm(x, weight, eps)


def rotary_ref(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    g = x[..., :d].float()
    return (g / (1.0 + torch.exp(-g))).to(x.dtype) * x[..., d:]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
