"""Plain-torch references for every kernel, in float32 (inputs upcast), one request at a time.

They restate the layouts the kernels read (see README.md) with no cleverness, so a kernel
test is "kernel == reference within tolerance" and a reference is checkable by eye.
"""

from __future__ import annotations

import torch

F16_TINY = 2.0**-24


# ---------------------------------------------------------------- attention


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D] = the LAST T positions of a sequence whose keys are k, v [S, Hkv, D] (T <= S);
    query t sees keys 0 .. S - T + t (T = 1: all of them). GQA: head h uses KV head h // G.
    -> float32 [T, Hq, D]."""
    t, hq, _ = q.shape
    s, hkv, _ = k.shape
    g = hq // hkv
    kf = k.float().repeat_interleave(g, dim=1)  # [S, Hq, D]
    vf = v.float().repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), kf) * sm_scale
    dev = q.device
    future = torch.arange(s, device=dev)[None, :] > (s - t + torch.arange(t, device=dev))[:, None]  # [T, S]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", probs, vf)


def _slots(req_to_token, req_pool_indices, b: int, start: int, length: int) -> torch.Tensor:
    return req_to_token[int(req_pool_indices[b]), start : start + length].long()


def decode_attention_ref(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale):
    """(a) q [B, Hq, D] over each request's seq_lens[b] slots -> float32 [B, Hq, D]."""
    outs = []
    for b in range(q.shape[0]):
        slots = _slots(req_to_token, req_pool_indices, b, 0, int(seq_lens[b]))
        outs.append(attention_ref(q[b : b + 1], k_buffer[slots], v_buffer[slots], sm_scale)[0])
    return torch.stack(outs)


def compressed_decode_ref(
    q,
    chunk_k,
    chunk_v,
    chunk_ids,
    num_chunks,
    k_buffer,
    v_buffer,
    req_to_token,
    req_pool_indices,
    tail_starts,
    tail_lens,
    sm_scale,
    draft_k_buffer=None,
    draft_v_buffer=None,
    draft_table=None,
    draft_lens=None,
):
    """(b), (c) q [B, Hq, D] over [rows of chunks chunk_ids[b, :num_chunks[b]] | exact tail | draft rows
    draft_table[b, :draft_lens[b]] of the draft buffers (when given)].
    chunk_k/v [num_chunks_total + 1, R, Hkv, D] are the chunks' context rows (token drop: the stored
    rows; quantized: the dequantized ones); the tail is req_to_token[req, start : start + len]."""
    outs = []
    for b in range(q.shape[0]):
        ids = chunk_ids[b, : int(num_chunks[b])].long()
        slots = _slots(req_to_token, req_pool_indices, b, int(tail_starts[b]), int(tail_lens[b]))
        k = torch.cat([chunk_k[ids].flatten(0, 1).float(), k_buffer[slots].float()])
        v = torch.cat([chunk_v[ids].flatten(0, 1).float(), v_buffer[slots].float()])
        if draft_table is not None:
            d_slots = draft_table[b, : int(draft_lens[b])].long()
            k = torch.cat([k, draft_k_buffer[d_slots].float()])
            v = torch.cat([v, draft_v_buffer[d_slots].float()])
        outs.append(attention_ref(q[b : b + 1], k, v, sm_scale)[0])
    return torch.stack(outs)


def verify_attention_ref(q, q_lens, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, sm_scale):
    """(d) q [B, T_max, Hq, D]: request b's first q_lens[b] rows are its last q_lens[b] positions.
    -> float32 [B, T_max, Hq, D], padding rows 0."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(q.shape[0]):
        t, s = int(q_lens[b]), int(seq_lens[b])
        slots = _slots(req_to_token, req_pool_indices, b, 0, s)
        out[b, :t] = attention_ref(q[b, :t], k_buffer[slots], v_buffer[slots], sm_scale)
    return out


# ---------------------------------------------------------------- quantized chunk layouts


def f16_at_least(x: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.float16)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def f16_at_most(x: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.float16)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def int8_quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 codes [..., D], float16 scale [...]): scale = amax/127 rounded up to f16."""
    xf = x.float()
    scale = f16_at_least((xf.abs().amax(dim=-1) / 127.0).clamp_min(F16_TINY))
    return torch.round((xf / scale.float()[..., None]).clamp(-127.0, 127.0)).to(torch.int8), scale


def int8_dequant_ref(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()[..., None]


def _kivi_quantize(x: torch.Tensor, dim: int, levels: int):
    zero = f16_at_most(x.amin(dim=dim))
    scale = f16_at_least(((x.amax(dim=dim) - zero.float()) / levels).clamp_min(F16_TINY))
    codes = torch.round((x - zero.float().unsqueeze(dim)) / scale.float().unsqueeze(dim))
    return codes.clamp(0, levels), scale, zero


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] codes -> [..., D * bits / 8] uint8; code i of a byte sits at bit bits*i."""
    grouped = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8 // bits)
    return (
        (grouped << torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)).sum(-1).to(torch.uint8)
    )


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def kivi_quantize_ref(k: torch.Tensor, v: torch.Tensor, bits: int, key_group: int, value_group: int) -> dict:
    """k, v [..., T, H, D] -> the kivi chunk tensors: keys per channel over groups of key_group
    tokens, values per token over groups of value_group channels, asymmetric, codes packed along D."""
    shape, levels = k.shape, (1 << bits) - 1
    kc, ks, kz = _kivi_quantize(k.float().unflatten(-3, (-1, key_group)), -3, levels)
    vc, vs, vz = _kivi_quantize(v.float().unflatten(-1, (-1, value_group)), -1, levels)
    return {
        "k": pack_codes(kc.reshape(shape), bits),
        "k_scale": ks,
        "k_zero": kz,
        "v": pack_codes(vc.reshape(shape), bits),
        "v_scale": vs,
        "v_zero": vz,
    }


def kivi_dequant_ref(
    t: dict, bits: int, key_group: int, value_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kivi chunk tensors [..., T, H, *] -> float32 (k, v) [..., T, H, D]."""
    kc = unpack_codes(t["k"], bits).float().unflatten(-3, (-1, key_group))
    vc = unpack_codes(t["v"], bits).float().unflatten(-1, (-1, value_group))
    k = kc * t["k_scale"].float().unsqueeze(-3) + t["k_zero"].float().unsqueeze(-3)
    v = vc * t["v_scale"].float()[..., None] + t["v_zero"].float()[..., None]
    return k.flatten(-4, -3), v.flatten(-2, -1)


# ---------------------------------------------------------------- pre-RoPE layouts (kvquant, rotatekv)


def unpack_bits_ref(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D*bits/8] uint8 -> [..., D] int64: code d is bits d*bits .. d*bits + bits - 1 of the row's
    little-endian bit stream (8 codes per `bits` bytes; for 2 / 4 bits the same as unpack_codes)."""
    stream = ((packed.to(torch.int64)[..., None] >> torch.arange(8, device=packed.device)) & 1).flatten(-2)
    return (stream.unflatten(-1, (-1, bits)) << torch.arange(bits, device=packed.device)).sum(-1)


def rope_ref(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [NC, T, H, D] float32 rotated (neox halves) at pos [NC, T] or [NC, T, H] by the table cos, sin
    [P, D]."""
    p = (pos if pos.dim() == 3 else pos[..., None].expand(x.shape[:-1])).long()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[p] + rot * sin[p]


def kvquant_dequant_ref(t: dict, bits: int, cos: torch.Tensor, sin: torch.Tensor):
    """kvquant chunk tensors [NC, ...] -> float32 (k, v) [NC, T, H, D]: level[code] * scale + zero
    (keys per channel, values per token), the exact outliers written over it, RoPE on the keys."""
    out = []
    for name in ("k", "v"):
        codes = unpack_bits_ref(t[f"{name}_codes"], bits)  # [NC, T, H, D]
        nc = codes.shape[0]
        chunk = torch.arange(nc, device=codes.device)[:, None, None, None]
        x = t[f"{name}_levels"].float()[chunk, codes]
        sc, z = t[f"{name}_scale"].float(), t[f"{name}_zero"].float()
        x = x * sc[:, None] + z[:, None] if name == "k" else x * sc[..., None] + z[..., None]
        flat = x.reshape(nc, -1).clone()
        flat.scatter_(1, t[f"{name}_out_idx"].long(), t[f"{name}_out_val"].float())
        out.append(flat.view(x.shape))
    return rope_ref(out[0], t["pos"], cos, sin), out[1]


def hadamard_ref(n: int) -> torch.Tensor:
    """Sylvester's orthonormal Hadamard matrix [n, n] (n a power of two), float32."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def rotatekv_dequant_ref(t: dict, bits: int, cos: torch.Tensor, sin: torch.Tensor, key_heads: int):
    """rotatekv chunk tensors [NC, ...] -> float32 (k, v) [NC, T, H, D] (D a power of two): min-max codes
    per group of rotated channels, keys rotated back over key_heads heads' D channels then RoPE'd,
    values per head."""
    out = []
    for name in ("k", "v"):
        codes = unpack_bits_ref(t[f"{name}_codes"], bits).float()
        ng = t[f"{name}_scale"].shape[-1]
        sc, z = t[f"{name}_scale"].float()[..., None], t[f"{name}_zero"].float()[..., None]
        x = codes.unflatten(-1, (ng, -1)) * sc + z
        out.append(x.flatten(-2))
    k, v = out
    d = k.shape[-1]
    k = k.unflatten(-2, (-1, key_heads)).flatten(-2) @ hadamard_ref(key_heads * d)  # [NC, T, H/g, g*D]
    k = k.unflatten(-1, (key_heads, d))
    return rope_ref(k.flatten(-3, -2), t["pos"], cos, sin), v @ hadamard_ref(d)
