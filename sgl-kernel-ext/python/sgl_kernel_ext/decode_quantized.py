"""(c) Decode attention over int8 / kivi2 / kivi4 quantized chunks plus an exact tail; each
key/value row is dequantized in registers inside the attention loop (never written out).

Context of request b = [the T rows of chunks chunk_ids[b, :num_chunks[b]] | exact tail], as in
decode_token_drop. Chunk layouts (sglang_vericache compress/int8.py, kivi.py; pool buffers have a
leading [num_chunks + 1] chunk dim, id 0 = padding):
  int8:  k, v [T, H, D] int8; k_scale, v_scale [T, H] f16.      x = code * scale
  kivi:  k, v [T, H, D*b/8] uint8 (code of channel d at bits b*(d % (8/b)) of byte d // (8/b));
         k_scale, k_zero [T/Gk, H, D] f16 (per channel, groups of Gk tokens);
         v_scale, v_zero [T, H, D/Gv] f16 (per token, groups of Gv channels).  x = code * scale + zero
Gk and Gv are read off the scale shapes.
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
KINDS = {"int8": 8, "kivi2": 2, "kivi4": 4}  # name -> bits


@triton.jit
def _dequant_rows(
    codes,
    scale,
    zero,
    cid,
    t,
    kvh,
    ok,
    offs_d,
    sc0,
    sc1,
    sc2,
    ss0,
    ss1,
    ss2,
    BITS: tl.constexpr,
    GT: tl.constexpr,
    GD: tl.constexpr,
):
    """float32 [BLOCK_N, D] rows t of chunks cid for KV head kvh. int8 (BITS 8): one scale per row.
    kivi: scale/zero index [t // GT, d // GD] (keys: GT = Gk, GD = 1; values: GT = 1, GD = Gv)."""
    if BITS == 8:
        c = tl.load(
            codes + cid[:, None] * sc0 + t[:, None] * sc1 + kvh * sc2 + offs_d[None, :],
            mask=ok[:, None],
            other=0,
        ).to(tl.float32)
        s = tl.load(scale + cid * ss0 + t * ss1 + kvh * ss2, mask=ok, other=0.0).to(tl.float32)
        return c * s[:, None]
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        byte = tl.load(
            codes + cid[:, None] * sc0 + t[:, None] * sc1 + kvh * sc2 + (offs_d // PER_BYTE)[None, :],
            mask=ok[:, None],
            other=0,
        ).to(tl.int32)
        c = ((byte >> ((offs_d % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        at = cid[:, None] * ss0 + (t // GT)[:, None] * ss1 + kvh * ss2 + (offs_d // GD)[None, :]
        s = tl.load(scale + at, mask=ok[:, None], other=0.0).to(tl.float32)
        z = tl.load(zero + at, mask=ok[:, None], other=0.0).to(tl.float32)
        return c * s + z


@triton.jit
def _quantized_part_kernel(
    q, kc, ks, kz, vc, vs, vz, chunk_ids, num_chunks, o_part, lse_part, num_partials, sm_scale,
    stride_qb, stride_qh, skc0, skc1, skc2, svc0, svc1, svc2, sks0, sks1, sks2, svs0, svs1, svs2, stride_cb,
    T: tl.constexpr, BITS: tl.constexpr, GK: tl.constexpr, GV: tl.constexpr, G: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DOT_F32: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(num_chunks + b).to(tl.int32) * T
    lo, hi, h0, qv, rows_ok, m_i, l_i, acc = begin_split(q, b, kvh, split, length, stride_qb, stride_qh, G,
                                                         NUM_SPLITS, BLOCK_H, BLOCK_N, D)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        ok, cid, t = chunk_keys(chunk_ids, b, stride_cb, n0, hi, T, BLOCK_N)
        kv = _dequant_rows(
            kc, ks, kz, cid, t, kvh, ok, offs_d, skc0, skc1, skc2, sks0, sks1, sks2, BITS, GK, 1
        )
        vv = _dequant_rows(
            vc, vs, vz, cid, t, kvh, ok, offs_d, svc0, svc1, svc2, svs0, svs1, svs2, BITS, 1, GV
        )
        m_i, l_i, acc = online_softmax_block(qv, kv, vv, ok[None, :], m_i, l_i, acc, sm_scale, DOT_F32)
    store_partial(o_part, lse_part, b, h0, split, m_i, l_i, acc, rows_ok, tl.num_programs(1) * G, num_partials,
                  BLOCK_H, D)


def quantized_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    kind: str,  # "int8", "kivi2" or "kivi4"
    chunks: dict[str, torch.Tensor],  # the layer's compressed pool buffers by name (layouts above)
    chunk_ids: torch.Tensor,  # [B, C_max] int, 0 = padding
    num_chunks: torch.Tensor,  # [B]
    k_buffer: torch.Tensor,  # [num_slots, Hkv, D] exact tier
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    tail_starts: torch.Tensor,  # [B]
    tail_lens: torch.Tensor,  # [B]; num_chunks[b] * T + tail_lens[b] >= 1
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
    bits = KINDS[kind]
    bs, _, d = q.shape
    hkv = k_buffer.shape[1]
    g = check_qkv(q, hkv, d)
    kc, ks, vc, vs = chunks["k"], chunks["k_scale"], chunks["v"], chunks["v_scale"]
    kz, vz = (chunks["k_zero"], chunks["v_zero"]) if bits < 8 else (ks, vs)
    t = kc.shape[1]
    assert kc.shape[2] == hkv and kc.shape[3] == d * bits // 8, f"{kind} codes {list(kc.shape)}"
    gk, gv = (t // ks.shape[1], d // vs.shape[3]) if bits < 8 else (1, 1)
    assert (
        kz.stride() == ks.stride() and vz.stride() == vs.stride() and kc.stride(3) == 1 and vc.stride(3) == 1
    )
    assert bits == 8 or (ks.stride(3) == 1 and vs.stride(3) == 1)
    scale, splits, o_part, lse_part = decode_partials(q, hkv, int(num_chunks.max()) * t, sm_scale, num_kv_splits,
                                                      num_tail_splits + int(draft_table is not None), BLOCK_N)
    _quantized_part_kernel[(bs, hkv, splits)](
        q, kc, ks, kz, vc, vs, vz, chunk_ids, num_chunks, o_part, lse_part, o_part.shape[2], scale, q.stride(0),
        q.stride(1), *kc.stride()[:3], *vc.stride()[:3], *ks.stride()[:3], *vs.stride()[:3], chunk_ids.stride(0),
        T=t, BITS=bits, GK=gk, GV=gv, G=g, NUM_SPLITS=splits, BLOCK_H=block_h(g), BLOCK_N=BLOCK_N, D=d,
        DOT_F32=dot_f32(q),
    )
    return tail_drafts_and_merge(
        q, o_part, lse_part, splits, num_tail_splits, scale, k_buffer, v_buffer, req_to_token, req_pool_indices,
        tail_starts, tail_lens, draft_k_buffer, draft_v_buffer, draft_table, draft_lens,
    )
