"""Batch-invariant matrix product for the GPU path of --enable-deterministic-inference.

y = x @ w.T (+ bias) with one fixed tiling: every program computes a BLOCK_M x BLOCK_N tile and
walks K in BLOCK_K steps from 0 upward, accumulating in float32; no split-K, no autotuning, tile
sizes fixed per dtype. Row r's result therefore depends on row r and the weights only: not on
how many rows share the call (M), nor on the tile the row lands in (tl.dot computes each output
row of a tile from that row alone), nor on the device's occupancy. Under TRITON_INTERPRET=1 the
interpreter's tl.dot is numpy's matmul, whose BLAS rounds a row by its place in the tile; there each
K step is a broadcast product summed per element over k in order instead, so the CPU tests see the
same invariance a GPU has. This is the "fixed tiling,
fixed reduction order over K" recipe of batch-invariant kernels (Thinking Machines, 2025; vLLM's
VLLM_BATCH_INVARIANT). Reference: torch.nn.functional.linear (equal to rounding, not bitwise).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import is_interpreting, row_sum

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32


@triton.jit
def _matmul_kernel(
    x, w, bias, y, M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, USE_DOT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):  # one pass over K, in order: the reduction order is fixed
        kk = k0 + rk
        a = tl.load(x + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w + rn[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        if UPCAST:  # the interpreter's bf16 / fp16 dot is wrong: products are exact in float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if USE_DOT:
            acc += tl.dot(a, b, input_precision="ieee")
        else:  # the interpreter: products summed per element over k in order (numpy's dot is not)
            acc += row_sum(a[:, :, None] * b[None, :, :], 1)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y + rm[:, None] * stride_ym + rn[None, :] * stride_yn, acc.to(y.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def interpreter_block(m: int, n: int, k: int) -> tuple[int, int, int]:
    """Tiles under the interpreter, few programs (each op costs ~1 ms there): its per-element sums make
    a row's bits independent of BLOCK_M and BLOCK_N; BLOCK_K (the sum's grouping) depends on K alone."""
    return min(64, triton.next_power_of_2(m)), min(2048, triton.next_power_of_2(n)), min(64, triton.next_power_of_2(k))


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                           block: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype, batch-invariantly. block: the
    tiles (BLOCK_M, BLOCK_N, BLOCK_K); None: (64, 64, 32) on a GPU, interpreter_block() under the interpreter."""
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight {tuple(weight.shape)}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*shape[:-1], n)
    if block is None:
        block = interpreter_block(m, n, k) if is_interpreting() else (BLOCK_M, BLOCK_N, BLOCK_K)
    bm, bn, bk = block
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _matmul_kernel[grid](
        x2, weight, bias if bias is not None else weight, y, m, n, k,
        x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, UPCAST=is_interpreting() or x.dtype == torch.float32,
        USE_DOT=not is_interpreting(),
        BM=bm, BN=bn, BK=bk,
    )
    return y.reshape(*shape[:-1], n)
