"""(a) Paged decode attention over exact KV: one query token per request, GQA, split-K.

Keys of request b are the slots table[rows[b], starts[b] : starts[b] + lens[b]] of the
per-layer K/V buffers [num_slots, Hkv, D] (SGLang's req_to_token layout: any page size,
partly filled last pages included, since the table names every token's slot). Query head h
reads KV head h // G. The same stage-1 kernel computes the exact tail of the compressed
decode kernels (starts = first tail position).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import (
    begin_split, block_h, check_qkv, decode_partials, dot_f32, online_softmax_block, store_partial,
)
from sgl_kernel_ext.decode_merge import merge_partials

BLOCK_N = 64


@triton.jit
def _exact_part_kernel(
    q, k_buf, v_buf, table, rows, starts, lens, o_part, lse_part, part_offset, num_partials, sm_scale,
    stride_qb, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_t,
    G: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(lens + b).to(tl.int32)
    start = tl.load(starts + b).to(tl.int64)
    row = tl.load(rows + b).to(tl.int64)
    lo, hi, h0, qv, rows_ok, m_i, l_i, acc = begin_split(q, b, kvh, split, length, stride_qb, stride_qh, G,
                                                         NUM_SPLITS, BLOCK_H, BLOCK_N, D)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        slot = tl.load(table + row * stride_t + start + offs_n, mask=ok, other=0).to(tl.int64)
        kv = tl.load(
            k_buf + slot[:, None] * stride_kn + kvh * stride_kh + offs_d[None, :], mask=ok[:, None], other=0.0
        )
        vv = tl.load(
            v_buf + slot[:, None] * stride_vn + kvh * stride_vh + offs_d[None, :], mask=ok[:, None], other=0.0
        )
        m_i, l_i, acc = online_softmax_block(qv, kv, vv, ok[None, :], m_i, l_i, acc, sm_scale, DOT_F32)
    store_partial(o_part, lse_part, b, h0, part_offset + split, m_i, l_i, acc, rows_ok, tl.num_programs(1) * G,
                  num_partials, BLOCK_H, D)


def exact_part(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    part_offset: int,
    num_splits: int,
    sm_scale: float,
) -> None:
    """Stage 1 over table[rows[b], starts[b]:starts[b]+lens[b]] into partials [offset, offset+splits)."""
    hkv, d = k_buffer.shape[1], k_buffer.shape[2]
    g = check_qkv(q, hkv, d)
    assert k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1 and q.stride(-1) == 1 and table.stride(1) == 1
    assert o_part.is_contiguous() and lse_part.is_contiguous(), "partials: new_partials"
    _exact_part_kernel[(q.shape[0], hkv, num_splits)](
        q, k_buffer, v_buffer, table, rows, starts, lens, o_part, lse_part, part_offset, o_part.shape[2],
        sm_scale, q.stride(0), q.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
        v_buffer.stride(1), table.stride(0),
        G=g, NUM_SPLITS=num_splits, BLOCK_H=block_h(g), BLOCK_N=BLOCK_N, D=d, DOT_F32=dot_f32(q),
    )


def draft_part(
    q: torch.Tensor,
    draft_k_buffer: torch.Tensor,
    draft_v_buffer: torch.Tensor,
    draft_table: torch.Tensor,
    draft_lens: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    part_offset: int,
    sm_scale: float,
) -> None:
    """Stage 1 over the draft-pool rows (VeriCache's third context part) into partial part_offset:
    request b's keys are slots draft_table[b, :draft_lens[b]] of the draft buffers [num_slots, Hkv, D]
    (row b of the table belongs to request b; entries past draft_lens[b] are not read)."""
    bs = q.shape[0]
    assert draft_table.shape[0] == bs and draft_lens.shape[0] == bs
    rows = torch.arange(bs, dtype=torch.int64, device=q.device)
    exact_part(
        q,
        draft_k_buffer,
        draft_v_buffer,
        draft_table,
        rows,
        torch.zeros_like(rows),
        draft_lens,
        o_part,
        lse_part,
        part_offset,
        1,
        sm_scale,
    )


def tail_drafts_and_merge(
    q: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    first: int,
    num_tail_splits: int,
    sm_scale: float,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    tail_starts: torch.Tensor,
    tail_lens: torch.Tensor,
    draft_k_buffer: torch.Tensor | None,
    draft_v_buffer: torch.Tensor | None,
    draft_table: torch.Tensor | None,
    draft_lens: torch.Tensor | None,
) -> torch.Tensor:
    """The parts after a compressed context: the exact tail into partials [first, first +
    num_tail_splits), the draft rows (if draft_table is given) into the next one; -> the merge."""
    exact_part(q, k_buffer, v_buffer, req_to_token, req_pool_indices, tail_starts, tail_lens, o_part, lse_part,
               first, num_tail_splits, sm_scale)
    if draft_table is not None:
        draft_part(q, draft_k_buffer, draft_v_buffer, draft_table, draft_lens, o_part, lse_part,
                   first + num_tail_splits, sm_scale)
    return merge_partials(o_part, lse_part, torch.empty_like(q))


def decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    v_buffer: torch.Tensor,  # [num_slots, Hkv, D]
    req_to_token: torch.Tensor,  # [R, max_context] int slots
    req_pool_indices: torch.Tensor,  # [B]
    seq_lens: torch.Tensor,  # [B] >= 1
    sm_scale: float | None = None,
    num_kv_splits: int | None = None,  # None: from seq_lens.max() (a host sync)
) -> torch.Tensor:
    """-> [B, Hq, D] in q's dtype: softmax(q k^T * sm_scale) v over each request's seq_len keys."""
    scale, splits, o_part, lse_part = decode_partials(q, k_buffer.shape[1], int(seq_lens.max()), sm_scale,
                                                      num_kv_splits, 0, BLOCK_N)
    exact_part(q, k_buffer, v_buffer, req_to_token, req_pool_indices, torch.zeros_like(seq_lens), seq_lens, o_part,
               lse_part, 0, splits, scale)
    return merge_partials(o_part, lse_part, torch.empty_like(q))
