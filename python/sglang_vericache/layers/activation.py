"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_vericache.layers import batch_invariant


class SiluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> silu(gate) * up."""

    batch_invariant = False  # set by enable_batch_invariance: batch_invariant.silu_and_mul
    kernel = None  # set by enable_batch_invariance on a CPU: cpu_rowwise.silu_and_mul (the same bits, one call)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.device.type == "cpu":
            return self.kernel(x)
        if self.batch_invariant:
            return batch_invariant.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> gelu(gate) * up (approximate="tanh": HF's
    gelu_pytorch_tanh). Elementwise in x's dtype, as HF computes it: batch invariant as it is."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
