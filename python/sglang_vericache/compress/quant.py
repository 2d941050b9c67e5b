"""Shared quantizer pieces: directed float16 rounding, bit packing, min-max codes, per-token scaled codes."""

from __future__ import annotations

from abc import abstractmethod

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout, TensorSpec

F16_TINY = 2.0**-24  # smallest positive float16 (subnormal): the floor of every stored scale


def f16_at_least(x: torch.Tensor) -> torch.Tensor:
    """float16 tensor y with y >= x elementwise (round to nearest, then step up if below)."""
    y = x.to(torch.float16)
    return torch.where(y.float() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def f16_at_most(x: torch.Tensor) -> torch.Tensor:
    """float16 tensor y with y <= x elementwise."""
    y = x.to(torch.float16)
    return torch.where(y.float() > x, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] codes in [0, 2^bits) -> [..., D * bits / 8] uint8; code i of a byte sits at bits*i."""
    per_byte = 8 // bits
    grouped = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_codes: [..., B] uint8 -> [..., B * 8 / bits] int32 codes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., D] codes in [0, 2^bits), bits 1..8, D a multiple of 8 -> [..., D * bits / 8] uint8: each
    run of 8 codes is one little-endian bit stream of `bits` bytes, code k at bit bits*k (for 2 and
    4 bits this is pack_codes' layout, byte for byte)."""
    grouped = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, 8)
    word = (grouped << torch.arange(0, 8 * bits, bits, device=codes.device)).sum(dim=-1)  # [..., D/8]
    octets = (word[..., None] >> torch.arange(0, 8 * bits, 8, device=codes.device)) & 0xFF
    return octets.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: [..., B] uint8 -> [..., B * 8 / bits] int32 codes."""
    if 8 % bits == 0:
        return unpack_codes(packed, bits)  # the same layout, one byte at a time
    wide = torch.int32 if bits <= 3 else torch.int64  # the 8 * bits-bit word of a run of 8 codes
    octets = packed.to(wide).reshape(*packed.shape[:-1], -1, bits)
    word = (octets << torch.arange(0, 8 * bits, 8, dtype=wide, device=packed.device)).sum(dim=-1, dtype=wide)
    shifts = torch.arange(0, 8 * bits, bits, dtype=wide, device=packed.device)
    codes = (word[..., None] >> shifts) & ((1 << bits) - 1)
    return codes.to(torch.int32).reshape(*packed.shape[:-1], -1)


def minmax_quantize(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric min-max codes over the group axis `dim` of float32 x: zero = the group min rounded
    down to float16, scale = (max - zero) / levels rounded up (at least F16_TINY), code =
    round((x - zero) / scale) in [0, levels], so |x - (code * scale + zero)| <= scale / 2.
    -> (codes like x, float32; scale, zero float16, reduced over dim)."""
    zero = f16_at_most(x.amin(dim=dim))
    scale = f16_at_least(((x.amax(dim=dim) - zero.float()) / levels).clamp_min(F16_TINY))
    codes = torch.round((x - zero.float().unsqueeze(dim)) / scale.float().unsqueeze(dim))
    return codes.clamp(0, levels), scale, zero


class PerTokenScaledCompressor(KVCompressor):
    """Symmetric codes with one float16 scale per (token, KV head), for K and V alike.

    Subclasses set `code_dtype`, `code_max` (scale = amax / code_max, rounded up to float16 so
    that no value is clipped) and `encode` (x / scale -> codes). Inputs must lie in float16 range.
    """

    code_dtype: torch.dtype
    code_max: float

    def layout(self, layer_id: int) -> Layout:
        c = self.config
        t, h, d = c.chunk_size, c.num_kv_heads, c.head_dim
        specs = []
        for name in ("k", "v"):
            specs.append(TensorSpec(name, (t, h, d), self.code_dtype))
            specs.append(TensorSpec(f"{name}_scale", (t, h), torch.float16))
        return Layout(kind="quantized", chunk_size=t, rows=t, tensors=tuple(specs))

    @abstractmethod
    def encode(self, scaled: torch.Tensor) -> torch.Tensor:
        """x / scale, within [-code_max, code_max] -> codes of code_dtype."""

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()
        scale = f16_at_least((xf.abs().amax(dim=-1) / self.code_max).clamp_min(F16_TINY))
        scaled = (xf / scale.float()[..., None]).clamp(-self.code_max, self.code_max)
        return self.encode(scaled), scale

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        (kc, ks), (vc, vs) = self.quantize(k), self.quantize(v)
        return CompressedChunk({"k": kc, "k_scale": ks, "v": vc, "v_scale": vs})

    def decompress(self, layer_id, chunk):
        return tuple(chunk[n].float() * chunk[f"{n}_scale"].float()[..., None] for n in ("k", "v"))
