"""Linear: nn.Linear that computes rows batch-invariantly once `batch_invariant_mode` is set."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_vericache.layers import batch_invariant


class Linear(nn.Linear):
    batch_invariant_mode: tuple[str, int] | None = None  # None: F.linear; else a batch_invariant.MODES entry

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant_mode is None:
            return F.linear(x, self.weight, self.bias)
        return batch_invariant.linear(x, self.weight, self.bias, self.batch_invariant_mode)
