"""Stage 2 of flash decoding: combine P partial softmax results per (request, query head).

out = sum_p exp(lse_p - M) * o_p / sum_p exp(lse_p - M), M = max_p lse_p. Partials with
lse = -inf (empty splits) weigh 0. Every (request, head) must have at least one key overall.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(o_part, lse_part, out, num_partials, stride_outb, stride_outh, BLOCK_P: tl.constexpr,
                  D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, D)
    ok = offs_p < num_partials
    at = (b * tl.num_programs(1) + h) * num_partials + offs_p  # (b, h, p): the partials are contiguous
    lse = tl.load(lse_part + at, mask=ok, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - m), 0.0)
    o = tl.load(o_part + at[:, None] * D + offs_d[None, :], mask=ok[:, None] & (w > 0)[:, None], other=0.0)
    res = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(out + b * stride_outb + h * stride_outh + offs_d, res.to(out.dtype.element_ty))


def merge_partials(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """o_part [B, H, P, D] f32, lse_part [B, H, P] f32, both contiguous (new_partials) -> writes and
    returns out [B, H, D]."""
    bs, nh, np_, d = o_part.shape
    assert o_part.is_contiguous() and lse_part.is_contiguous() and out.stride(2) == 1
    _merge_kernel[(bs, nh)](
        o_part, lse_part, out, np_, out.stride(0), out.stride(1), BLOCK_P=triton.next_power_of_2(np_), D=d
    )
    return out
