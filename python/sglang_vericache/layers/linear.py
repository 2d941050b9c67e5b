"""Linear: nn.Linear that computes rows batch-invariantly once `batch_invariant_mode` is set, and
through float32 products once it holds float32 copies of its weights (layers/half_gemm.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_vericache.layers import batch_invariant


class Linear(nn.Linear):
    batch_invariant_mode: tuple[str, int] | None = None  # None: F.linear; else a batch_invariant.MODES entry
    gemm_weight: torch.Tensor | None = None  # half_gemm: the weight in float32 (None: products in its dtype)
    gemm_bias: torch.Tensor | None = None

    def matmul_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (weight, bias) the products are computed with."""
        if self.gemm_weight is not None:
            return self.gemm_weight, self.gemm_bias
        return self.weight, self.bias

    def matmul(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """x @ W^T (+ b), in the weights' product dtype, rounded to x's dtype."""
        w, b = self.matmul_weights()
        b = b if with_bias else None
        xin = x if x.dtype == w.dtype else x.to(w.dtype)
        if self.batch_invariant_mode is None:
            y = F.linear(xin, w, b)
        else:
            y = batch_invariant.linear(xin, w, b, self.batch_invariant_mode)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)
