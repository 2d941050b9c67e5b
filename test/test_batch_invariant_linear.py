"""layers.batch_invariant on a CPU: every linear layer through sgl_kernel_ext.cpu_linear's packed kernel.

enable_batch_invariance packs each Linear's weight once, in its stored dtype (no float32 copies), and
the layer's rows are then one float32 accumulation each: a row's output is the same alone or in any
batch, with no probe at start.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.layers import batch_invariant as bi
from sglang_vericache.layers.activation import SiluAndMul
from sglang_vericache.layers.linear import Linear


def model(dtype, bias=False):
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(64, 48, bias=bias), SiluAndMul(), Linear(24, 70, bias=bias)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_layers_are_packed_in_their_dtype_and_rows_are_batch_invariant(dtype, bias):
    from sgl_kernel_ext import cpu_linear

    m = model(dtype, bias)
    assert bi.enable_batch_invariance(m) == bi.CPU_MODE
    first, last = m[0], m[2]
    assert first.packed.dtype == dtype and first.packed.shape == (3, 64, 16) and first.gemm_weight is None
    assert last.packed.shape == (5, 24, 16)
    assert m[1].batch_invariant
    assert (first.packed_bias is not None) == bias and (not bias or first.packed_bias.dtype == torch.float32)
    x = torch.randn(37, 64).to(dtype)
    y = m(x)
    assert y.dtype == dtype and y.shape == (37, 70)
    h = cpu_linear.packed_linear(x, cpu_linear.pack_weight(first.weight), first.bias, 48)
    assert torch.equal(m[0](x), h)
    alone = torch.cat([m(x[i : i + 1]) for i in range(37)])
    assert torch.equal(y, alone)
    for n in (2, 5, 8, 16, 33):
        assert torch.equal(m(x[3 : 3 + n]), alone[3 : 3 + n])


def test_row_parallel_matmul_without_bias_and_plain_nn_linear_refused():
    m = model(torch.bfloat16, bias=True)
    bi.enable_batch_invariance(m)
    x = torch.randn(4, 64).to(torch.bfloat16)
    without = m[0].matmul(x, with_bias=False)
    assert not torch.equal(m[0].matmul(x), without)
    assert torch.equal(without, m[0].matmul(x, with_bias=False))
    from sgl_kernel_ext import cpu_linear

    assert torch.equal(without, cpu_linear.packed_linear(x, m[0].packed, None, 48))
    with pytest.raises(TypeError, match="plain nn.Linear"):
        bi.enable_batch_invariance(torch.nn.Sequential(torch.nn.Linear(4, 4)))
