"""(b) Decode attention over token-dropped compressed KV plus an exact tail.

Context of request b = [the rows of chunks chunk_ids[b, :num_chunks[b]], in that order |
exact tail req_to_token[req, tail_starts[b] : tail_starts[b] + tail_lens[b]]].

Compressed layout (sglang_vericache compress/token_drop.py, one pool buffer per layer):
  k_rows, v_rows [num_chunks + 1, R, Hkv, D] exact dtype; row j of head h = head h's j-th kept
  token of that chunk (chunk id 0 = padding). The chunk's `idx` [.., R, Hkv] int16 (which
  chunk token each row was) is not read: K is stored post-RoPE, so attention needs only the rows.
A chunk's R rows per head are keys R consecutive context positions; the kernel walks the
virtual sequence n = c * R + j of (chunk c, row j), BLOCK_N rows at a time across chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import (
    begin_split, block_h, check_qkv, chunk_keys, decode_partials, dot_f32, online_softmax_block,
    store_partial,
)
from sgl_kernel_ext.decode_exact import tail_drafts_and_merge

BLOCK_N = 64


@triton.jit
def _token_drop_part_kernel(
    q, k_rows, v_rows, chunk_ids, num_chunks, o_part, lse_part, num_partials, sm_scale,
    stride_qb, stride_qh, stride_kc, stride_kr, stride_kh, stride_vc, stride_vr, stride_vh, stride_cb,
    R: tl.constexpr, G: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, DOT_F32: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(num_chunks + b).to(tl.int32) * R
    lo, hi, h0, qv, rows_ok, m_i, l_i, acc = begin_split(q, b, kvh, split, length, stride_qb, stride_qh, G,
                                                         NUM_SPLITS, BLOCK_H, BLOCK_N, D)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        ok, cid, j = chunk_keys(chunk_ids, b, stride_cb, n0, hi, R, BLOCK_N)
        k_ptrs = (
            k_rows + cid[:, None] * stride_kc + j[:, None] * stride_kr + kvh * stride_kh + offs_d[None, :]
        )
        v_ptrs = (
            v_rows + cid[:, None] * stride_vc + j[:, None] * stride_vr + kvh * stride_vh + offs_d[None, :]
        )
        kv = tl.load(k_ptrs, mask=ok[:, None], other=0.0)
        vv = tl.load(v_ptrs, mask=ok[:, None], other=0.0)
        m_i, l_i, acc = online_softmax_block(qv, kv, vv, ok[None, :], m_i, l_i, acc, sm_scale, DOT_F32)
    store_partial(o_part, lse_part, b, h0, split, m_i, l_i, acc, rows_ok, tl.num_programs(1) * G, num_partials,
                  BLOCK_H, D)


def token_drop_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_rows: torch.Tensor,  # [num_chunks + 1, R, Hkv, D] the layer's compressed pool buffer "k"
    v_rows: torch.Tensor,  # [num_chunks + 1, R, Hkv, D] ... "v"
    chunk_ids: torch.Tensor,  # [B, C_max] int, 0 = padding
    num_chunks: torch.Tensor,  # [B] chunks of each request
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D] exact tier
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,  # [R_pool, max_context]
    req_pool_indices: torch.Tensor,  # [B]
    tail_starts: torch.Tensor,  # [B] first tail position (= num_chunks * chunk_size in VeriCache)
    tail_lens: torch.Tensor,  # [B]; num_chunks[b] * R + tail_lens[b] >= 1
    sm_scale: float | None = None,
    num_kv_splits: int | None = None,  # splits of the compressed part (None: from num_chunks.max())
    num_tail_splits: int = 1,
    draft_k_buffer: torch.Tensor | None = None,  # [num_draft_slots, Hkv, D] draft pool (optional)
    draft_v_buffer: torch.Tensor | None = None,
    draft_table: torch.Tensor | None = None,  # [B, S_d] draft-pool slots of each request, in order
    draft_lens: torch.Tensor | None = None,  # [B]
) -> torch.Tensor:
    """-> [B, Hq, D] in q's dtype. With the draft_* arguments the context gets a third part after the
    tail: request b's draft rows draft_table[b, :draft_lens[b]] (VeriCache drafting)."""
    bs, _, d = q.shape
    _, rows, hkv, _ = k_rows.shape
    g = check_qkv(q, hkv, d)
    assert k_rows.shape == v_rows.shape and k_rows.stride(3) == 1 and v_rows.stride(3) == 1
    assert chunk_ids.stride(1) == 1
    scale, splits, o_part, lse_part = decode_partials(q, hkv, int(num_chunks.max()) * rows, sm_scale, num_kv_splits,
                                                      num_tail_splits + int(draft_table is not None), BLOCK_N)
    _token_drop_part_kernel[(bs, hkv, splits)](
        q, k_rows, v_rows, chunk_ids, num_chunks, o_part, lse_part, o_part.shape[2], scale, q.stride(0),
        q.stride(1), *k_rows.stride()[:3], *v_rows.stride()[:3], chunk_ids.stride(0),
        R=rows, G=g, NUM_SPLITS=splits, BLOCK_H=block_h(g), BLOCK_N=BLOCK_N, D=d, DOT_F32=dot_f32(q),
    )
    return tail_drafts_and_merge(
        q, o_part, lse_part, splits, num_tail_splits, scale, k_buffer, v_buffer, req_to_token, req_pool_indices,
        tail_starts, tail_lens, draft_k_buffer, draft_v_buffer, draft_table, draft_lens,
    )
