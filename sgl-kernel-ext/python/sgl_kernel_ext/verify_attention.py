"""(d) Multi-token causal verify attention over paged exact KV (TARGET_VERIFY).

q [B, T_max, Hq, D]: request b's first q_lens[b] rows are the queries of its LAST q_lens[b]
positions (their K/V already written to the pool), i.e. row t sits at position
seq_lens[b] - q_lens[b] + t and sees keys 0 .. that position. Rows t >= q_lens[b] are padding
and come back as 0. One program = BLOCK_M (token, query-head) rows of one KV head, ordered
m = t * G + g, so GQA heads share every K/V load; flash attention over BLOCK_N key blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import check_qkv, dot_f32, online_softmax_block

BLOCK_N = 64


@triton.jit
def _verify_kernel(
    q,
    k_buf,
    v_buf,
    out,
    req_to_token,
    req_pool_indices,
    seq_lens,
    q_lens,
    sm_scale,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_t,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    q_len = tl.load(q_lens + b).to(tl.int32)
    row = tl.load(req_pool_indices + b).to(tl.int64)

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    t = offs_m // G
    h = kvh * G + offs_m % G
    rows_ok = t < q_len
    pos = seq_len - q_len + t  # absolute position of each query row
    qv = tl.load(
        q + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
        mask=rows_ok[:, None],
        other=0.0,
    )
    # keys up to the block's last valid query position
    t_last = tl.minimum((mblk * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
    hi = seq_len - q_len + t_last + 1

    m_i = tl.full([BLOCK_M], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        slot = tl.load(req_to_token + row * stride_t + offs_n, mask=ok, other=0).to(tl.int64)
        kv = tl.load(
            k_buf + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=ok[:, None], other=0.0
        )
        vv = tl.load(
            v_buf + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=ok[:, None], other=0.0
        )
        causal = ok[None, :] & (offs_n[None, :] <= pos[:, None])
        m_i, l_i, acc = online_softmax_block(qv, kv, vv, causal, m_i, l_i, acc, sm_scale, DOT_F32)
    res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out + b * stride_ob + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, res.to(out.dtype.element_ty), mask=rows_ok[:, None])


def verify_attention(
    q: torch.Tensor,  # [B, T_max, Hq, D]
    q_lens: torch.Tensor,  # [B] 1 <= q_lens[b] <= seq_lens[b]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # [R, max_context]
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] including the q_lens new tokens
    sm_scale: float | None = None,
) -> torch.Tensor:
    """-> [B, T_max, Hq, D] in q's dtype; padding rows 0."""
    bs, t_max, _, d = q.shape
    hkv = k_buffer.shape[1]
    g = check_qkv(q, hkv, d)
    assert (
        q.stride(3) == 1
        and k_buffer.stride(2) == 1
        and v_buffer.stride(2) == 1
        and req_to_token.stride(1) == 1
    )
    block_m = max(16, min(64, triton.next_power_of_2(t_max * g)))
    out = torch.zeros_like(q)
    _verify_kernel[(bs, hkv, triton.cdiv(t_max * g, block_m))](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_pool_indices,
        seq_lens,
        q_lens,
        d**-0.5 if sm_scale is None else sm_scale,
        *q.stride()[:3],
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        *out.stride()[:3],
        req_to_token.stride(0),
        G=g,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        D=d,
        DOT_F32=dot_f32(q),
    )
    return out
