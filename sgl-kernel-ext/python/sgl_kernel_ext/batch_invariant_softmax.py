"""Batch-invariant log_softmax / logsumexp over the vocabulary for the GPU path of
--enable-deterministic-inference (the sampler's logprobs and its top-p normalizer).

One program per row, the row read in BLOCK-wide steps from column 0 upward, three passes: the max
(exact whatever the order), the sum of exp(x - max) in BLOCK float32 lanes added in one fixed
reduction, then x - (max + log(sum)). BLOCK depends on the vocabulary size alone, so a row's result
is a function of that row only: not of the number of rows, the row's place or the device (torch's
CUDA softmax picks its reduction from the tensor's shape). Rows of -inf only: logsumexp -inf,
log_softmax NaN, as torch. Reference: torch.log_softmax / torch.logsumexp (equal to rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import row_max, row_sum

MAX_BLOCK = 4096


@triton.jit
def _log_softmax_kernel(x, out, lse, V, stride_x, stride_o, WRITE_OUT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for v0 in range(0, V, BLOCK):
        c = v0 + cols
        m = tl.maximum(m, tl.load(x + row * stride_x + c, mask=c < V, other=float("-inf")).to(tl.float32))
    mx = row_max(m, 0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a row of -inf: sum 0, logsumexp -inf
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for v0 in range(0, V, BLOCK):  # in order: the reduction order is fixed
        c = v0 + cols
        s += tl.exp(tl.load(x + row * stride_x + c, mask=c < V, other=float("-inf")).to(tl.float32) - mx)
    total = mx + tl.log(row_sum(s, 0))
    tl.store(lse + row, total)
    if WRITE_OUT:
        for v0 in range(0, V, BLOCK):
            c = v0 + cols
            xv = tl.load(x + row * stride_x + c, mask=c < V, other=0.0).to(tl.float32)
            tl.store(out + row * stride_o + c, xv - total, mask=c < V)


def block_for(vocab: int) -> int:
    """Columns per step: a function of the vocabulary size only."""
    return min(MAX_BLOCK, triton.next_power_of_2(vocab))


def _run(x: torch.Tensor, write_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2:
        raise ValueError(f"expected logits [rows, vocab], got {tuple(x.shape)}")
    x = x.contiguous()
    rows, vocab = x.shape
    out = torch.empty((rows, vocab) if write_out else (0, 0), dtype=torch.float32, device=x.device)
    lse = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and vocab:
        _log_softmax_kernel[(rows,)](x, out, lse, vocab, x.stride(0), out.stride(0) if write_out else 0,
                                     WRITE_OUT=write_out, BLOCK=block_for(vocab))
    elif rows:
        lse.fill_(float("-inf"))
    return out, lse


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> float32 log_softmax over the last dimension, batch-invariantly."""
    return _run(x, True)[0]


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] -> float32 [rows] log(sum(exp(x))) over the last dimension, batch-invariantly."""
    return _run(x, False)[1]
