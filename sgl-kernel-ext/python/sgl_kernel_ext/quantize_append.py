"""(e) Quantize-and-append: compress whole pages of exact KV into int8 / kivi chunks of a pool.

Chunk i = the T exact tokens at slots[i] (k_buffer/v_buffer [num_slots, H, D], any float dtype)
is written under chunk_ids[i] into the layer's pool buffers (layouts in decode_quantized.py).
Bit-identical to sglang_vericache's Int8Compressor / KIVICompressor.compress: the same float32
ops in the same order, IEEE division (div_rn), round half to even, and float16 rounding
directed up (scales) or down (kivi zeros) by one ulp step where round-to-nearest went the
wrong way. Inputs must lie in float16 range (as the compressors require).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

F16_TINY = 2.0**-24  # smallest positive float16: the floor of every stored scale
KINDS = {"int8": 8, "kivi2": 2, "kivi4": 4}


@triton.jit
def _rint(x):
    """Round half to even (torch.round), exact for |x| < 2^22."""
    r = tl.floor(x)
    f = x - r
    odd = r - 2.0 * tl.floor(r * 0.5)  # 1.0 if r is odd
    return tl.where(f > 0.5, r + 1.0, tl.where(f < 0.5, r, r + odd))


@triton.jit
def _f16_at_least(x):
    """float16 y >= x (x float32): nearest, then one step toward +inf if it fell below."""
    y = x.to(tl.float16)
    bits = y.to(tl.int16, bitcast=True)
    up = tl.where(bits < 0, bits - 1, bits + 1)  # sign-magnitude: a negative steps by -1
    up = tl.where(bits == -32768, 1, up)  # -0 -> smallest positive
    return tl.where(y.to(tl.float32) < x, up.to(tl.float16, bitcast=True), y)


@triton.jit
def _f16_at_most(x):
    y = x.to(tl.float16)
    bits = y.to(tl.int16, bitcast=True)
    down = tl.where(bits < 0, bits + 1, bits - 1)
    down = tl.where(bits == 0, -32767, down)  # +0 -> smallest negative
    return tl.where(y.to(tl.float32) > x, down.to(tl.float16, bitcast=True), y)


@triton.jit
def _int8_rows(src, dst, dst_scale, slot, cid, t, h, ok, offs_d, s_n, s_h, d0, d1, d2, ds0, ds1, ds2):
    x = tl.load(src + slot[:, None] * s_n + h * s_h + offs_d[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )
    scale = _f16_at_least(tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0), F16_TINY))
    scaled = tl.math.div_rn(x, scale.to(tl.float32)[:, None])
    codes = _rint(tl.minimum(tl.maximum(scaled, -127.0), 127.0)).to(tl.int8)
    tl.store(dst + cid * d0 + t[:, None] * d1 + h * d2 + offs_d[None, :], codes, mask=ok[:, None])
    tl.store(dst_scale + cid * ds0 + t * ds1 + h * ds2, scale, mask=ok)


@triton.jit
def _int8_kernel(
    k_buf,
    v_buf,
    slots,
    chunk_ids,
    kc,
    ks,
    vc,
    vs,
    s_kn,
    s_kh,
    s_vn,
    s_vh,
    s_sn,
    kc0,
    kc1,
    kc2,
    ks0,
    ks1,
    ks2,
    vc0,
    vc1,
    vc2,
    vs0,
    vs1,
    vs2,
    T: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.arange(0, BLOCK_T)
    ok = t < T
    offs_d = tl.arange(0, D)
    cid = tl.load(chunk_ids + i).to(tl.int64)
    slot = tl.load(slots + i * s_sn + t, mask=ok, other=0).to(tl.int64)
    _int8_rows(k_buf, kc, ks, slot, cid, t, h, ok, offs_d, s_kn, s_kh, kc0, kc1, kc2, ks0, ks1, ks2)
    _int8_rows(v_buf, vc, vs, slot, cid, t, h, ok, offs_d, s_vn, s_vh, vc0, vc1, vc2, vs0, vs1, vs2)


@triton.jit
def _kivi_codes(x, zero, scale, LEVELS: tl.constexpr):
    c = _rint(tl.math.div_rn(x - zero, scale))
    return tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0).to(tl.int32)


@triton.jit
def _pack_store(
    codes, dst, cid, t, h, ok, c0, c1, c2, BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr
):
    """[BLOCK_T, D] codes -> bytes [BLOCK_T, D * BITS / 8]; code j of a byte at bits BITS * j."""
    PB: tl.constexpr = 8 // BITS
    shifts = tl.arange(0, PB) * BITS
    packed = tl.sum(tl.reshape(codes, (BLOCK_T, D // PB, PB)) << shifts[None, None, :], axis=2)
    offs_b = tl.arange(0, D // PB)
    tl.store(
        dst + cid * c0 + t[:, None] * c1 + h * c2 + offs_b[None, :], packed.to(tl.uint8), mask=ok[:, None]
    )


@triton.jit
def _kivi_kernel(
    k_buf,
    v_buf,
    slots,
    chunk_ids,
    kc,
    ks,
    kz,
    vc,
    vs,
    vz,
    s_kn,
    s_kh,
    s_vn,
    s_vh,
    s_sn,
    kc0,
    kc1,
    kc2,
    ks0,
    ks1,
    ks2,
    vc0,
    vc1,
    vc2,
    vs0,
    vs1,
    vs2,
    GK: tl.constexpr,
    GV: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    D: tl.constexpr,
):
    """One program = one key group (GK tokens) of one chunk and one KV head."""
    LEVELS: tl.constexpr = (1 << BITS) - 1
    i = tl.program_id(0)
    grp = tl.program_id(1)
    h = tl.program_id(2)
    r = tl.arange(0, BLOCK_T)
    ok = r < GK
    t = grp * GK + r
    offs_d = tl.arange(0, D)
    cid = tl.load(chunk_ids + i).to(tl.int64)
    slot = tl.load(slots + i * s_sn + t, mask=ok, other=0).to(tl.int64)

    # keys: per channel over the group's tokens
    x = tl.load(k_buf + slot[:, None] * s_kn + h * s_kh + offs_d[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )
    zero = _f16_at_most(tl.min(tl.where(ok[:, None], x, float("inf")), axis=0))
    hi = tl.max(tl.where(ok[:, None], x, float("-inf")), axis=0)
    scale = _f16_at_least(tl.maximum(tl.math.div_rn(hi - zero.to(tl.float32), LEVELS * 1.0), F16_TINY))
    codes = _kivi_codes(x, zero.to(tl.float32)[None, :], scale.to(tl.float32)[None, :], LEVELS)
    _pack_store(codes, kc, cid, t, h, ok, kc0, kc1, kc2, BLOCK_T, D, BITS)
    tl.store(ks + cid * ks0 + grp * ks1 + h * ks2 + offs_d, scale)
    tl.store(kz + cid * ks0 + grp * ks1 + h * ks2 + offs_d, zero)

    # values: per token over groups of GV channels
    NG: tl.constexpr = D // GV
    x = tl.load(v_buf + slot[:, None] * s_vn + h * s_vh + offs_d[None, :], mask=ok[:, None], other=0.0).to(
        tl.float32
    )
    x3 = tl.reshape(x, (BLOCK_T, NG, GV))
    zero = _f16_at_most(tl.min(x3, axis=2))  # [BLOCK_T, NG]
    scale = _f16_at_least(
        tl.maximum(tl.math.div_rn(tl.max(x3, axis=2) - zero.to(tl.float32), LEVELS * 1.0), F16_TINY)
    )
    zero_d = tl.reshape(tl.broadcast_to(zero.to(tl.float32)[:, :, None], (BLOCK_T, NG, GV)), (BLOCK_T, D))
    scale_d = tl.reshape(tl.broadcast_to(scale.to(tl.float32)[:, :, None], (BLOCK_T, NG, GV)), (BLOCK_T, D))
    _pack_store(_kivi_codes(x, zero_d, scale_d, LEVELS), vc, cid, t, h, ok, vc0, vc1, vc2, BLOCK_T, D, BITS)
    offs_g = tl.arange(0, NG)
    at = cid * vs0 + t[:, None] * vs1 + h * vs2 + offs_g[None, :]
    tl.store(vs + at, scale, mask=ok[:, None])
    tl.store(vz + at, zero, mask=ok[:, None])


def quantize_append(
    kind: str,  # "int8", "kivi2" or "kivi4"
    k_buffer: torch.Tensor,  # [num_slots, H, D] exact tier
    v_buffer: torch.Tensor,
    slots: torch.Tensor,  # [N, T] int, chunk i = the tokens at slots[i]
    chunk_ids: torch.Tensor,  # [N] distinct ids >= 1
    chunks: dict[str, torch.Tensor],  # the layer's pool buffers, written in place at chunk_ids
) -> None:
    bits = KINDS[kind]
    n, t = slots.shape
    _, nh, d = k_buffer.shape
    assert d == triton.next_power_of_2(d), "head_dim must be a power of 2"
    assert k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1 and slots.stride(1) == 1
    if n == 0:
        return
    kc, ks, vc, vs = chunks["k"], chunks["k_scale"], chunks["v"], chunks["v_scale"]
    assert all(b.is_contiguous() for b in chunks.values())
    common = (
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        slots.stride(0),
        *kc.stride()[:3],
        *ks.stride()[:3],
        *vc.stride()[:3],
        *vs.stride()[:3],
    )
    if bits == 8:
        _int8_kernel[(n, nh)](
            k_buffer,
            v_buffer,
            slots,
            chunk_ids,
            kc,
            ks,
            vc,
            vs,
            *common,
            T=t,
            BLOCK_T=triton.next_power_of_2(t),
            D=d,
        )
        return
    gk, gv = t // ks.shape[1], d // vs.shape[3]
    assert ks.shape[1] * gk == t and vs.shape[3] * gv == d and kc.shape[3] == d * bits // 8
    _kivi_kernel[(n, t // gk, nh)](
        k_buffer,
        v_buffer,
        slots,
        chunk_ids,
        kc,
        ks,
        chunks["k_zero"],
        vc,
        vs,
        chunks["v_zero"],
        *common,
        GK=gk,
        GV=gv,
        BITS=bits,
        BLOCK_T=triton.next_power_of_2(gk),
        D=d,
    )
