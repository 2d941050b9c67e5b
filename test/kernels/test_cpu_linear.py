"""sgl_kernel_ext.cpu_linear: the batch-invariant CPU linear kernel (csrc/linear.cpp).

Checked: every output within float32 rounding of the float64 product (then one rounding to the output
dtype); a row's bits the same alone, in batches of 1..40 rows at any offset, with 1 or 2 threads; the
scalar fallback (LIN_FORCE_SCALAR) bitwise equal to the vector path this CPU runs (AVX2 or AVX-512), so
the arithmetic does not depend on the vector width; float32 / bfloat16 / float16 weights, bias, and K /
N that are not multiples of the tile sizes.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext import cpu_linear

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (29, 37), (64, 48), (576, 192), (70, 129)]  # (K, N): tails in both, one panel, many panels


def operands(k: int, n: int, dtype: torch.dtype, rows: int = 45, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    return x, w, b


def error_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A float32 chain of K fused multiply-adds plus the bias: |error| <= (K + 1) u sum |terms| (u = 2^-24)."""
    k = x.shape[1]
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        mag = mag + b.double().abs()
    return (k + 1) * 2.0**-24 * mag + 1e-30


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_float32_result_is_the_exact_product_within_float32_rounding(dtype, k, n):
    for bias in (True, False):
        x, w, b = operands(k, n, dtype, bias=bias)
        y = cpu_linear.packed_linear(x, cpu_linear.pack_weight(w), b, n, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and y.shape == (45, n)
        ref = cpu_linear.packed_linear_ref(x, w, b)
        assert ((y.double() - ref).abs() <= error_bound(x, w, b)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_in_the_input_dtype_is_the_float32_result_rounded_once(dtype):
    x, w, b = operands(70, 129, dtype)
    packed = cpu_linear.pack_weight(w)
    y = cpu_linear.packed_linear(x, packed, b, 129)
    assert y.dtype == dtype
    assert torch.equal(y, cpu_linear.packed_linear(x, packed, b, 129, out_dtype=torch.float32).to(dtype))


def test_one_fma_chain_in_k_order_on_exactly_representable_values():
    """Integer operands with exact sums, then one case where the order shows: 2^24 + 1 - 2^24."""
    x = torch.tensor([[2.0**24, 1.0, -(2.0**24)]])
    w = torch.ones(3, 3)
    y = cpu_linear.packed_linear(x, cpu_linear.pack_weight(w), None, 3)
    # k order: (2^24 + 1) rounds to 2^24 (ties to even), minus 2^24 = 0; another order would give 1.
    assert y.tolist() == [[0.0, 0.0, 0.0]]
    w2 = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.0, 4.0]])
    x2 = torch.tensor([[1.0, 2.0, 3.0], [5.0, -7.0, 0.5]])
    b2 = torch.tensor([0.5, -1.0])
    y2 = cpu_linear.packed_linear(x2, cpu_linear.pack_weight(w2), b2, 2)
    assert y2.tolist() == [[14.5, 10.0], [-7.0, -4.0]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "n"), [(29, 37), (576, 192), (70, 129)])
def test_rows_alone_equal_rows_in_any_batch_offset_and_thread_count(dtype, k, n):
    x, w, b = operands(k, n, dtype, rows=48)
    packed = cpu_linear.pack_weight(w)
    ref = torch.cat([cpu_linear.packed_linear(x[i : i + 1], packed, b, n) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for t in dict.fromkeys((threads, 1, 2)):
            torch.set_num_threads(t)
            for m in range(1, 41):
                for start in (0, 1, 48 - m):
                    got = cpu_linear.packed_linear(x[start : start + m], packed, b, n)
                    assert torch.equal(got, ref[start : start + m]), (t, m, start)
    finally:
        torch.set_num_threads(threads)


def test_large_batches_and_leading_dimensions():
    x, w, b = operands(96, 80, torch.bfloat16, rows=300)
    packed = cpu_linear.pack_weight(w)
    alone = torch.cat([cpu_linear.packed_linear(x[i : i + 1], packed, b, 80) for i in range(300)])
    assert torch.equal(cpu_linear.packed_linear(x, packed, b, 80), alone)
    assert torch.equal(cpu_linear.packed_linear(x.reshape(3, 100, 96), packed, b, 80), alone.reshape(3, 100, 80))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scalar_fallback_equals_the_vector_path_bitwise(dtype):
    assert cpu_linear.isa(scalar=True) == "scalar"
    for k, n in SHAPES:
        x, w, b = operands(k, n, dtype, rows=13)
        packed = cpu_linear.pack_weight(w)
        vec = cpu_linear.packed_linear(x, packed, b, n, out_dtype=torch.float32)
        assert torch.equal(cpu_linear.packed_linear(x, packed, b, n, out_dtype=torch.float32, scalar=True), vec)


def test_avx2_path_is_the_one_built_on_an_avx2_cpu():
    from sgl_kernel_ext.cpu_attention import cpu_flags

    flags = set(cpu_flags().split())
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma", "f16c"} <= flags else "scalar"
    assert cpu_linear.isa() == want


def test_mixed_input_and_weight_dtypes():
    """A float32 input with bfloat16 weights: the products of the values as given (no rounding of x)."""
    x, w, b = operands(64, 48, torch.bfloat16, rows=5)
    xf = x.float() + 1e-3  # not representable in bfloat16
    y = cpu_linear.packed_linear(xf, cpu_linear.pack_weight(w), b, 48)
    assert y.dtype == torch.float32
    assert ((y.double() - cpu_linear.packed_linear_ref(xf, w, b)).abs() <= error_bound(xf, w, b)).all()


def test_packing_layout_and_bad_input():
    w = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)
    p = cpu_linear.pack_weight(w)
    assert p.shape == (2, 3, 16) and p[1, :, 4:].abs().sum() == 0
    assert torch.equal(p[0, 2], w[:16, 2]) and torch.equal(p[1, 0, :4], w[16:, 0])
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        cpu_linear.pack_weight(w.double())
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        cpu_linear.pack_weight(w[0])
    with pytest.raises(RuntimeError, match="features"):
        cpu_linear.packed_linear(torch.randn(2, 4), p, None, 20)
    with pytest.raises(RuntimeError, match="panels"):
        cpu_linear.packed_linear(torch.randn(2, 3), p, None, 40)
    assert cpu_linear.packed_linear(torch.randn(0, 3), p, None, 20).shape == (0, 20)
