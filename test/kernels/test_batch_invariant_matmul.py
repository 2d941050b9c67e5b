"""sgl_kernel_ext.batch_invariant_matmul: equal to F.linear to rounding, and a row's result is
bitwise the same whatever the number of rows in the call and wherever the row sits (TRITON_INTERPRET=1
on a CPU: tiny tiles keep it fast)."""

from __future__ import annotations

import kernel_inputs  # noqa: F401  (skips this module without triton)
import pytest
import torch
import torch.nn.functional as F

from sgl_kernel_ext.batch_invariant_matmul import batch_invariant_linear

TILES = (16, 16, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_f_linear(gen, dtype):
    x = torch.randn(37, 48, generator=gen).to(dtype)
    w = torch.randn(40, 48, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    y = batch_invariant_linear(x, w, b, block=TILES)
    ref = F.linear(x.float(), w.float(), b.float())
    assert y.dtype == dtype and y.shape == (37, 40)
    if dtype == torch.float32:
        assert (y - ref).abs().max().item() <= 1e-4
    else:  # the float32 result stored as bfloat16: within one bf16 ulp (the interpreter's cast may truncate)
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("block", [TILES, None], ids=["16x16x16", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_independent_of_the_number_of_rows_and_their_place(gen, dtype, block):
    """M changes (1 to 50 rows, tiles partly masked; by default the interpreter's BLOCK_M follows M)
    and rows move within their tiles (starts 3, 7, 21: under the interpreter too, which sums per
    element instead of numpy's dot)."""
    x = torch.randn(50, 40, generator=gen).to(dtype)
    w = torch.randn(24, 40, generator=gen).to(dtype)
    full = batch_invariant_linear(x, w, block=block)
    for start, m in [(0, 1), (0, 2), (16, 17), (32, 16), (16, 30), (0, 50), (3, 1), (7, 20), (21, 29)]:
        assert torch.equal(batch_invariant_linear(x[start : start + m], w, block=block), full[start : start + m])
    assert batch_invariant_linear(x[:0], w, block=block).shape == (0, 24)


def test_bad_shapes_are_refused(gen):
    with pytest.raises(ValueError, match="features"):
        batch_invariant_linear(torch.randn(2, 8), torch.randn(4, 9))
