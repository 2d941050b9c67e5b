"""KIVI 2/4-bit: keys quantized per channel, values per token, asymmetric min-max."""

from __future__ import annotations

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout, TensorSpec
from sglang_vericache.compress.quant import minmax_quantize, pack_codes, unpack_codes


class KIVICompressor(KVCompressor):
    """Keys: each group of G consecutive tokens shares, per (head, channel), a float16 zero (the
    group min, rounded down) and scale ((max - zero) / (2^b - 1), rounded up). Values: each group
    of G channels of one (token, head) shares a zero/scale. code = round((x - zero) / scale), so
    |x - deq| <= scale / 2. Codes pack 8/b per uint8 along D. The ratio is set by b (the `ratio`
    option is ignored); KIVI's full-precision residual window is the engine's exact tail (tokens
    not yet in a whole chunk). Key groups shrink to T when T < G. Inputs must lie in float16 range.
    """

    def __init__(self, config, bits: int, key_group: int | None = None):
        super().__init__(config)
        if bits not in (2, 4):
            raise ValueError(f"kivi supports 2 or 4 bits, got {bits}")
        self.bits, self.levels = bits, (1 << bits) - 1
        self.name = f"kivi{bits}"
        c = config
        # key_group: tokens per key group when not min(G, T) (composition: the kept rows of a dropper)
        self.key_group = min(c.group_size, c.chunk_size) if key_group is None else key_group
        self.value_group = min(c.group_size, c.head_dim)
        if c.chunk_size % self.key_group or c.head_dim % self.value_group or c.head_dim % (8 // bits):
            raise ValueError(
                f"{self.name}: chunk_size {c.chunk_size} and head_dim {c.head_dim} must be multiples of "
                f"group_size {c.group_size} (or smaller than it), head_dim of {8 // bits}"
            )

    def layout(self, layer_id: int) -> Layout:
        c = self.config
        t, h, d, f16 = c.chunk_size, c.num_kv_heads, c.head_dim, torch.float16
        codes = (t, h, d * self.bits // 8)
        k_groups, v_groups = (t // self.key_group, h, d), (t, h, d // self.value_group)
        specs = []
        for name, groups in (("k", k_groups), ("v", v_groups)):
            specs += [
                TensorSpec(name, codes, torch.uint8),
                TensorSpec(f"{name}_scale", groups, f16),
                TensorSpec(f"{name}_zero", groups, f16),
            ]
        return Layout(kind="quantized", chunk_size=t, rows=t, tensors=tuple(specs))

    def _quantize(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x grouped with the group axis at `dim` -> (codes like x, scale, zero) reduced over dim."""
        return minmax_quantize(x, dim, self.levels)

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        shape = k.shape  # [..., T, H, D]
        kc, ks, kz = self._quantize(k.float().unflatten(-3, (-1, self.key_group)), dim=-3)
        vc, vs, vz = self._quantize(v.float().unflatten(-1, (-1, self.value_group)), dim=-1)
        return CompressedChunk(
            {
                "k": pack_codes(kc.reshape(shape), self.bits),
                "k_scale": ks,
                "k_zero": kz,
                "v": pack_codes(vc.reshape(shape), self.bits),
                "v_scale": vs,
                "v_zero": vz,
            }
        )

    def decompress(self, layer_id, chunk):
        kc = unpack_codes(chunk["k"], self.bits).float()  # [..., T, H, D]
        vc = unpack_codes(chunk["v"], self.bits).float()
        k = kc.unflatten(-3, (-1, self.key_group)) * chunk["k_scale"].float().unsqueeze(-3)
        k = k + chunk["k_zero"].float().unsqueeze(-3)
        v = vc.unflatten(-1, (-1, self.value_group)) * chunk["v_scale"].float()[..., None]
        v = v + chunk["v_zero"].float()[..., None]
        return k.flatten(-4, -3), v.flatten(-2, -1)
