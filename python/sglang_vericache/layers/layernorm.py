"""RMSNorm, computed exactly as Hugging Face's LlamaRMSNorm (fp32 statistics, cast, then scale), and
GemmaRMSNorm, exactly as Gemma3RMSNorm (fp32 statistics, scaled by 1 + weight in fp32, then cast)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    # set by batch_invariant.enable_batch_invariance on the triton backend on a GPU:
    # sgl_kernel_ext.batch_invariant_rmsnorm.rms_norm (the same arithmetic, one program per row)
    batch_invariant_kernel = None

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant_kernel is not None:
            return self.batch_invariant_kernel(x, self.weight, self.variance_epsilon)
        # Op order matches HF: normalize in float32, cast back, then multiply by the weight.
        input_dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * h.to(input_dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), all in float32, cast back at the end (HF's
    Gemma3RMSNorm; the stored weight is the offset from 1, zeros at initialization)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)
