"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_vericache.layers import batch_invariant


class SiluAndMul(nn.Module):
    """x = [gate, up] along the last dim -> silu(gate) * up."""

    batch_invariant = False  # set by enable_batch_invariance: batch_invariant.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return batch_invariant.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
