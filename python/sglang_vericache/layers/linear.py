"""Linear: nn.Linear whose products go, once switched, through a batch-invariant kernel: on a CPU
sgl_kernel_ext.cpu_linear's packed kernel (`packed`, set by batch_invariant.enable_batch_invariance;
the weight packed once in its stored dtype), on the triton backend batch_invariant_matmul
(`batch_invariant_mode`). Otherwise F.linear, through float32 copies of the weights once
layers/half_gemm.py gave them (`gemm_weight`, with deterministic inference off)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_vericache.layers import batch_invariant


class Linear(nn.Linear):
    batch_invariant_mode: tuple[str, int] | None = None  # None: F.linear; else batch_invariant.TRITON_MODE
    packed: torch.Tensor | None = None  # cpu_linear.pack_weight(weight): the CPU batch-invariant kernel's operand
    packed_bias: torch.Tensor | None = None  # the bias in float32, beside `packed`
    packed_op = None  # the packed kernel's op, called by forward directly (set with `packed`)
    packed_bias_arg: torch.Tensor | None = None  # packed_bias, or an empty tensor: the op's bias operand
    gemm_weight: torch.Tensor | None = None  # half_gemm: the weight in float32 (None: products in its dtype)
    gemm_bias: torch.Tensor | None = None

    def matmul_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (weight, bias) F.linear's products are computed with."""
        if self.gemm_weight is not None:
            return self.gemm_weight, self.gemm_bias
        return self.weight, self.bias

    def matmul(self, x: torch.Tensor, with_bias: bool = True) -> torch.Tensor:
        """x @ W^T (+ b), rounded to x's dtype: with `packed`, one float32 accumulation per output in
        k order; else in the weights' product dtype."""
        if self.packed is not None:
            return batch_invariant.packed_linear(x, self.packed, self.packed_bias if with_bias else None,
                                                 self.out_features)
        w, b = self.matmul_weights()
        b = b if with_bias else None
        xin = x if x.dtype == w.dtype else x.to(w.dtype)
        if self.batch_invariant_mode is None:
            y = F.linear(xin, w, b)
        else:
            y = batch_invariant.linear(xin, w, b, self.batch_invariant_mode)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_op is not None and x.dim() == 2:  # matmul's packed branch, without its Python layers
            return self.packed_op(x, self.packed, self.packed_bias_arg, self.out_features, x.dtype)
        return self.matmul(x)
