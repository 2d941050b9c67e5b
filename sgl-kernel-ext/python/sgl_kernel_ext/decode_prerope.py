"""(c') Decode attention over kvquant / rotatekv chunks (pre-RoPE keys) plus an exact tail; each key
and value row is dequantized in registers inside the attention loop (never written out), RoPE is put
back on the keys there, and rotatekv's Hadamard transform is undone in registers too.

Context of request b = [the T rows of chunks chunk_ids[b, :num_chunks[b]] | exact tail], as in
decode_quantized (same metadata, partials merged by decode_merge). Chunk layouts (sglang_vericache
compress/kvquant.py, rotatekv.py; pool buffers with a leading [num_chunks + 1] dim, id 0 = padding,
all contiguous). Codes: 8 codes per `bits` bytes along D, code k of a run at bit bits*k (pack_bits).
  kvquant{2,3,4}: k_codes, v_codes [T, H, D*b/8]; k_scale, k_zero [H, D] f16 (per channel);
    v_scale, v_zero [T, H] f16 (per token); k_levels, v_levels [2^b] f16; k_out_val, v_out_val [N_o]
    (exact dtype), k_out_idx, v_out_idx [N_o] int16/int32, ascending flat indices into [T, H, D].
    x = level[code] * scale + zero, then the outliers written over it.
  rotatekv{2,4}: k_codes, v_codes [T, H, D*b/8]; k_scale, k_zero, v_scale, v_zero [T, H, D/Gr] f16
    (per group of Gr rotated channels). x = code * scale + zero in the rotated basis. Keys: Hadamard
    over the D channels of `key_heads` consecutive KV heads (H_{g*D} = H_g (x) H_D: a signed sum over
    the group's heads, then butterflies over D); values: Hadamard per head over D, applied once to the
    attention output instead of to every row (it is linear, so the two agree to float32 rounding).
  pos [T] or [T, H] (after a dropper: each head's kept rows) int32; keys get RoPE (neox halves) at
    their position from rope_table = the compressor's float32 cos, sin [P, D] (ChunkRope.table), which
    must cover every stored position (the caller's bound; not checked here, that would sync the host).
Same tolerance contract as decode_quantized: rows equal the compressors' decompress() to float32
rounding (the order of a few additions differs: the Hadamard's signed head sum, the value rotation).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import (
    begin_split, block_h, check_qkv, chunk_keys, decode_partials, dot_f32, interp_helper, online_softmax_block,
    row_max, store_partial,
)
from sgl_kernel_ext.decode_exact import tail_drafts_and_merge

BLOCK_N = 64
KINDS = {"kvquant2": (0, 2), "kvquant3": (0, 3), "kvquant4": (0, 4), "rotatekv2": (1, 2), "rotatekv4": (1, 4)}
KVQUANT_NAMES = ("k_codes", "k_scale", "k_zero", "k_levels", "k_out_val", "k_out_idx",
                 "v_codes", "v_scale", "v_zero", "v_levels", "v_out_val", "v_out_idx")
ROTATEKV_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")


@interp_helper
def _codes(base, row, offs_d, ok, BITS: tl.constexpr, NB: tl.constexpr):
    """int32 [N, D] codes of byte rows `row` [N] (int64) of a [.., NB] uint8 code tensor."""
    bit = (offs_d % 8) * BITS
    ptr = base + row[:, None] * NB + ((offs_d // 8) * BITS + bit // 8)[None, :]
    shift = bit % 8
    w = tl.load(ptr, mask=ok[:, None], other=0).to(tl.int32)
    if 8 % BITS != 0:  # 3 bits: a code may straddle two bytes
        w2 = tl.load(ptr + 1, mask=ok[:, None] & (shift + BITS > 8)[None, :], other=0).to(tl.int32)
        w = w | (w2 << 8)
    return (w >> shift[None, :]) & ((1 << BITS) - 1)


@interp_helper
def _lower_bound(idx, cid, target, ok, N_O: tl.constexpr, STEPS: tl.constexpr):
    """[N] first i with idx[cid, i] >= target (N_O if none): a binary search of STEPS halvings over
    each row's chunk's ascending list idx [NC, N_O]."""
    lo = target * 0
    hi = lo + N_O
    for _ in tl.static_range(STEPS):
        mid = (lo + hi) // 2
        live = ok & (lo < hi)
        v = tl.load(idx + cid * N_O + mid, mask=live, other=0).to(tl.int32)
        right = live & (v < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right | ~live, hi, mid)
    return lo


@interp_helper
def _outliers(x, idx, val, cid, base, ok, offs_d, N_O: tl.constexpr, STEPS: tl.constexpr, D: tl.constexpr):
    """x [N, D] with the exact outliers of rows whose flat [T, H, D] offsets start at base [N]
    written over it: each row's outliers are one run of its chunk's sorted list, walked in step."""
    lo = _lower_bound(idx, cid, base, ok, N_O, STEPS)
    cnt = tl.where(ok, _lower_bound(idx, cid, base + D, ok, N_O, STEPS) - lo, 0)
    for j in range(0, row_max(cnt, 0)):
        live = j < cnt
        at = cid * N_O + lo + j
        i = tl.load(idx + at, mask=live, other=0).to(tl.int32)
        v = tl.load(val + at, mask=live, other=0.0).to(tl.float32)
        x = tl.where(live[:, None] & (offs_d[None, :] == (i - base)[:, None]), v[:, None], x)
    return x


@interp_helper
def _kvquant_rows(codes, scale, zero, levels, out_val, out_idx, cid, t, kvh, ok, offs_d, KEYS: tl.constexpr,
                  BITS: tl.constexpr, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr, N_O: tl.constexpr,
                  STEPS: tl.constexpr):
    """float32 [N, D] rows t of chunks cid, head kvh (keys: pre-RoPE)."""
    c = _codes(codes, (cid * T + t) * H + kvh, offs_d, ok, BITS, D * BITS // 8)
    lv = tl.load(levels + cid[:, None] * (1 << BITS) + c, mask=ok[:, None], other=0.0).to(tl.float32)
    if KEYS:  # per channel over the chunk
        at = (cid[:, None] * H + kvh) * D + offs_d[None, :]
        x = lv * tl.load(scale + at, mask=ok[:, None], other=0.0).to(tl.float32)
        x = x + tl.load(zero + at, mask=ok[:, None], other=0.0).to(tl.float32)
    else:  # per token
        at = (cid * T + t) * H + kvh
        x = lv * tl.load(scale + at, mask=ok, other=0.0).to(tl.float32)[:, None]
        x = x + tl.load(zero + at, mask=ok, other=0.0).to(tl.float32)[:, None]
    if N_O > 0:
        x = _outliers(x, out_idx, out_val, cid, ((t * H + kvh) * D).to(tl.int32), ok, offs_d, N_O, STEPS, D)
    return x


@interp_helper
def _minmax_rows(codes, scale, zero, cid, t, kvh, ok, offs_d, BITS: tl.constexpr, T: tl.constexpr,
                 H: tl.constexpr, D: tl.constexpr, NG: tl.constexpr):
    """float32 [N, D] rotatekv rows (rotated basis): code * scale + zero per group of D / NG channels."""
    row = (cid * T + t) * H + kvh
    c = _codes(codes, row, offs_d, ok, BITS, D * BITS // 8).to(tl.float32)
    at = row[:, None] * NG + (offs_d // (D // NG))[None, :]
    x = c * tl.load(scale + at, mask=ok[:, None], other=0.0).to(tl.float32)
    return x + tl.load(zero + at, mask=ok[:, None], other=0.0).to(tl.float32)


@interp_helper
def _fwht(x, N: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr):
    """Unnormalized Walsh-Hadamard butterflies along the D columns of x [N, D] (rotatekv.fwht's order)."""
    for i in tl.static_range(LOG_D):
        h: tl.constexpr = 1 << i
        a, b = tl.split(tl.permute(tl.reshape(x, [N, D // (2 * h), 2, h]), [0, 1, 3, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [N, D])
    return x


@interp_helper
def _rope(x, p, cos, sin, offs_d, ok, N: tl.constexpr, D: tl.constexpr):
    """x * cos + rotate_half(x) * sin at positions p [N] (ChunkRope.rotate; rotate_half = [-x2, x1])."""
    at = p[:, None] * D + offs_d[None, :]
    c = tl.load(cos + at, mask=ok[:, None], other=0.0)
    s = tl.load(sin + at, mask=ok[:, None], other=0.0)
    a, b = tl.split(tl.permute(tl.reshape(x, [N, 2, D // 2]), [0, 2, 1]))
    return x * c + tl.reshape(tl.permute(tl.join(-b, a), [0, 2, 1]), [N, D]) * s


@triton.jit
def _prerope_part_kernel(
    q, kc, ks, kz, kl, kov, koi, vc, vs, vz, vl, vov, voi, pos, cos, sin, chunk_ids, num_chunks, o_part,
    lse_part, num_partials, sm_scale, inv_k, inv_v, stride_qb, stride_qh, stride_cb,
    ROTATE: tl.constexpr,  # 0 kvquant, 1 rotatekv
    BITS: tl.constexpr, T: tl.constexpr, H: tl.constexpr, NG: tl.constexpr, N_O: tl.constexpr,
    STEPS: tl.constexpr, POS_PER_HEAD: tl.constexpr, KEY_HEADS: tl.constexpr, LOG_KH: tl.constexpr,
    G: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    LOG_D: tl.constexpr, DOT_F32: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    length = tl.load(num_chunks + b).to(tl.int32) * T
    lo, hi, h0, qv, rows_ok, m_i, l_i, acc = begin_split(q, b, kvh, split, length, stride_qb, stride_qh, G,
                                                         NUM_SPLITS, BLOCK_H, BLOCK_N, D)
    offs_d = tl.arange(0, D)
    for n0 in range(lo, hi, BLOCK_N):
        ok, cid, t = chunk_keys(chunk_ids, b, stride_cb, n0, hi, T, BLOCK_N)
        if POS_PER_HEAD:
            p = tl.load(pos + (cid * T + t) * H + kvh, mask=ok, other=0)
        else:
            p = tl.load(pos + cid * T + t, mask=ok, other=0)
        if ROTATE:
            # head kvh's pre-RoPE key = (1/sqrt(g D)) H_D (sum_j (-1)^popcount(il & j) x_j) over its group
            il = kvh % KEY_HEADS
            x = tl.zeros([BLOCK_N, D], tl.float32)
            for j in tl.static_range(KEY_HEADS):
                par = il & 0
                for e in tl.static_range(LOG_KH):
                    par = par ^ (((il & j) >> e) & 1)
                xj = _minmax_rows(kc, ks, kz, cid, t, kvh - il + j, ok, offs_d, BITS, T, H, D, NG)
                x = x + tl.where(par == 1, -xj, xj)
            x = _fwht(x, BLOCK_N, D, LOG_D) * inv_k
            vv = _minmax_rows(vc, vs, vz, cid, t, kvh, ok, offs_d, BITS, T, H, D, NG)
        else:
            x = _kvquant_rows(kc, ks, kz, kl, kov, koi, cid, t, kvh, ok, offs_d, True, BITS, T, H, D, N_O,
                              STEPS)
            vv = _kvquant_rows(vc, vs, vz, vl, vov, voi, cid, t, kvh, ok, offs_d, False, BITS, T, H, D, N_O,
                               STEPS)
        kv = _rope(x, p, cos, sin, offs_d, ok, BLOCK_N, D)
        m_i, l_i, acc = online_softmax_block(qv, kv, vv, ok[None, :], m_i, l_i, acc, sm_scale, DOT_F32)
    if ROTATE:  # values were attended in the rotated basis: one transform of the output
        acc = _fwht(acc, BLOCK_H, D, LOG_D) * inv_v
    store_partial(o_part, lse_part, b, h0, split, m_i, l_i, acc, rows_ok, tl.num_programs(1) * G, num_partials,
                  BLOCK_H, D)


def prerope_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    kind: str,  # a key of KINDS
    chunks: dict[str, torch.Tensor],  # the layer's compressed pool buffers by name (layouts above)
    rope_table: tuple[torch.Tensor, torch.Tensor],  # float32 cos, sin [P, D] covering every stored position
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
    key_heads: int = 1,  # rotatekv: KV heads per key Hadamard group (RotateKVCompressor.key_heads)
    draft_k_buffer: torch.Tensor | None = None,  # [num_draft_slots, Hkv, D] draft pool (optional)
    draft_v_buffer: torch.Tensor | None = None,
    draft_table: torch.Tensor | None = None,  # [B, S_d] draft-pool slots of each request, in order
    draft_lens: torch.Tensor | None = None,  # [B]
) -> torch.Tensor:
    """-> [B, Hq, D] in q's dtype; the draft_* arguments add request b's draft rows after its tail
    (VeriCache drafting), as in quantized_decode_attention."""
    if kind not in KINDS:
        raise ValueError(f"prerope_decode_attention: kind must be one of {sorted(KINDS)}, got {kind!r}")
    rotate, bits = KINDS[kind]
    names = ROTATEKV_NAMES if rotate else KVQUANT_NAMES
    missing = [n for n in (*names, "pos") if n not in chunks]
    if missing:
        raise ValueError(f"prerope_decode_attention: {kind} chunks lack {missing}")
    bufs = [chunks[n] for n in names]
    pos = chunks["pos"]
    bs, _, d = q.shape
    hkv = k_buffer.shape[1]
    g = check_qkv(q, hkv, d)
    kc = bufs[0]
    nc, t = kc.shape[0], kc.shape[1]
    assert kc.dtype == torch.uint8 and tuple(kc.shape[2:]) == (hkv, d * bits // 8), \
        f"{kind} codes {list(kc.shape)}"
    assert all(x.is_contiguous() for x in (*bufs, pos)), "compressed buffers must be contiguous"
    assert pos.dtype == torch.int32 and tuple(pos.shape) in ((nc, t), (nc, t, hkv)), f"pos {list(pos.shape)}"
    cos, sin = (x.float().contiguous() for x in rope_table)
    assert cos.dim() == 2 and cos.shape[1] == d and sin.shape == cos.shape, "rope_table: cos, sin [P, D]"
    if rotate:
        kc, ks, kz, vc, vs, vz = bufs
        kl = kov = koi = vl = vov = voi = ks  # unused
        n_o, ng = 0, ks.shape[-1]
        assert tuple(ks.shape) == (nc, t, hkv, ng) and d % ng == 0, f"rotatekv scales {list(ks.shape)}"
        assert key_heads >= 1 and key_heads & (key_heads - 1) == 0 and hkv % key_heads == 0, key_heads
    else:
        kc, ks, kz, kl, kov, koi, vc, vs, vz, vl, vov, voi = bufs
        n_o, ng, key_heads = kov.shape[-1], 1, 1
        assert tuple(ks.shape) == (nc, hkv, d) and tuple(vs.shape) == (nc, t, hkv), "kvquant scales"
        assert tuple(kl.shape) == (nc, 1 << bits), f"kvquant levels {list(kl.shape)}"
        assert koi.dtype in (torch.int16, torch.int32), f"kvquant outlier indices {koi.dtype}"
    scale, splits, o_part, lse_part = decode_partials(q, hkv, int(num_chunks.max()) * t, sm_scale, num_kv_splits,
                                                      num_tail_splits + int(draft_table is not None), BLOCK_N)
    _prerope_part_kernel[(bs, hkv, splits)](
        q, kc, ks, kz, kl, kov, koi, vc, vs, vz, vl, vov, voi, pos, cos, sin, chunk_ids, num_chunks, o_part,
        lse_part, o_part.shape[2], scale, 1.0 / math.sqrt(key_heads * d), 1.0 / math.sqrt(d), q.stride(0),
        q.stride(1), chunk_ids.stride(0),
        ROTATE=rotate, BITS=bits, T=t, H=hkv, NG=ng, N_O=n_o, STEPS=n_o.bit_length(),
        POS_PER_HEAD=pos.dim() == 3,
        KEY_HEADS=key_heads, LOG_KH=key_heads.bit_length() - 1, G=g, NUM_SPLITS=splits, BLOCK_H=block_h(g),
        BLOCK_N=BLOCK_N, D=d, LOG_D=d.bit_length() - 1, DOT_F32=dot_f32(q),
    )
    return tail_drafts_and_merge(
        q, o_part, lse_part, splits, num_tail_splits, scale, k_buffer, v_buffer, req_to_token, req_pool_indices,
        tail_starts, tail_lens, draft_k_buffer, draft_v_buffer, draft_table, draft_lens,
    )
