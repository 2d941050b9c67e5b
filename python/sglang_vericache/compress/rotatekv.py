"""RotateKV 2/4-bit, chunk-local: a Hadamard rotation smooths outliers before low-bit quantization
(Su et al., 2025), undone at decompress so attention reads K/V in their own basis.

Layout of one chunk of one layer (T tokens, or k_l kept rows when it follows a dropper):
  k_codes uint8 [T, H, D*b/8]   codes of the rotated pre-RoPE keys
  k_scale, k_zero f16 [T, H, D/G]  per (token, head, group of G rotated channels), min-max
  v_codes, v_scale, v_zero        the rotated values alike
  pos int32 [T] (or [T, H] after a dropper): positions, to put RoPE back on the keys
"""

from __future__ import annotations

import math

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout, TensorSpec
from sglang_vericache.compress.quant import minmax_quantize, pack_codes, unpack_codes
from sglang_vericache.compress.rope import ChunkRope


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform along the last dim (a power of two, n):
    x @ H_n / sqrt(n) with Sylvester's H_2n = [[H_n, H_n], [H_n, -H_n]]. Symmetric and orthogonal,
    so it is its own inverse. Butterflies only (additions, one final scaling): each row is computed
    alone, whatever the batch, unlike a matmul whose rounding depends on the row count."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    lead, h, y = x.shape[:-1], 1, x
    while h < n:
        y = y.reshape(*lead, n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape) * (1.0 / math.sqrt(n))


def power_of_two_factor(n: int) -> int:
    """The largest power of two dividing n."""
    return n & -n


class RotateKVCompressor(KVCompressor):
    """Keys: RoPE undone at each token's position, then one orthonormal Hadamard transform over the
    channels of a group of KV heads (pre-RoPE grouped-head rotation: the layer's H heads, or their
    largest power-of-two count, times D), then per-token min-max b-bit codes in groups of G rotated
    channels (as KIVI's values: |x - deq| <= scale / 2 in the rotated basis, hence in L2 norm in
    the original one). Values: a Hadamard transform over each head's D channels, then the same
    per-token codes. Decompress: dequantize, transform back (fwht is its own inverse), RoPE on
    the keys. If D is not a power of two the transform is block-diagonal over its largest
    power-of-two blocks, one head at a time. The ratio is set by b.

    Departures from the paper: no outlier-aware channel reordering (its permutation is calibrated
    offline per layer; stored per chunk it would cost about an eighth of the 2-bit codes); no
    attention-sink-aware fp16 tokens (sinks are found from massive activations the compressor does
    not see); no clipping ratio (min-max ranges).
    """

    takes_kept_rows_positions = True

    def __init__(self, config, bits: int, per_head_positions: bool = False):
        super().__init__(config)
        if bits not in (2, 4):
            raise ValueError(f"rotatekv supports 2 or 4 bits, got {bits}")
        c = config
        self.bits, self.levels = bits, (1 << bits) - 1
        self.name = f"rotatekv{bits}"
        self.per_head_positions = per_head_positions
        self.group = min(c.group_size, c.head_dim)
        if c.head_dim % self.group or c.head_dim % 8:
            raise ValueError(
                f"{self.name}: head_dim {c.head_dim} must be a multiple of 8 and of "
                f"group_size {c.group_size} (or smaller than it)"
            )
        self.block = power_of_two_factor(c.head_dim)  # Hadamard block within a head
        self.key_heads = power_of_two_factor(c.num_kv_heads) if self.block == c.head_dim else 1
        self.rope = ChunkRope(c.head_dim, c.rope_parameters)

    def layout(self, layer_id: int) -> Layout:
        c = self.config
        t, h, d, f16 = c.chunk_size, c.num_kv_heads, c.head_dim, torch.float16
        codes, groups = (t, h, d * self.bits // 8), (t, h, d // self.group)
        specs = []
        for name in ("k", "v"):
            specs += [
                TensorSpec(f"{name}_codes", codes, torch.uint8),
                TensorSpec(f"{name}_scale", groups, f16),
                TensorSpec(f"{name}_zero", groups, f16),
            ]
        specs.append(TensorSpec("pos", (t, h) if self.per_head_positions else (t,), torch.int32))
        return Layout(kind="quantized", chunk_size=t, rows=t, tensors=tuple(specs))

    # ------------------------------------------------------------------ rotations

    def rotate_keys(self, k_pre: torch.Tensor) -> torch.Tensor:
        """[..., T, H, D] -> the same shape, grouped-head Hadamard (its own inverse)."""
        if self.block != k_pre.shape[-1]:
            return self.rotate_values(k_pre)
        g = self.key_heads
        grouped = k_pre.unflatten(-2, (-1, g)).flatten(-2)  # [..., T, H/g, g*D]
        return fwht(grouped).unflatten(-1, (g, -1)).flatten(-3, -2)

    def rotate_values(self, v: torch.Tensor) -> torch.Tensor:
        """[..., T, H, D] -> Hadamard over each head's blocks of `block` channels (its own inverse)."""
        return fwht(v.unflatten(-1, (-1, self.block))).flatten(-2)

    def _rope_positions(self, pos: torch.Tensor) -> torch.Tensor:
        return pos if self.per_head_positions else pos[..., None]

    # ------------------------------------------------------------------ compress / decompress

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        want = (*k.shape[:-1],) if self.per_head_positions else (*k.shape[:-2],)
        if positions is None or tuple(positions.shape) != want:
            got = None if positions is None else list(positions.shape)
            raise ValueError(f"{self.name}: compress() needs the chunk's positions {list(want)}, got {got}")
        pos = positions.to(k.device)
        k_rot = self.rotate_keys(self.rope.unrotate(k.float(), self._rope_positions(pos)))
        out = {}
        for name, x in (("k", k_rot), ("v", self.rotate_values(v.float()))):
            codes, scale, zero = minmax_quantize(x.unflatten(-1, (-1, self.group)), -1, self.levels)
            out |= {
                f"{name}_codes": pack_codes(codes.flatten(-2), self.bits),
                f"{name}_scale": scale,
                f"{name}_zero": zero,
            }
        out["pos"] = pos.to(torch.int32)
        return CompressedChunk(out)

    def dequantize(self, chunk: CompressedChunk, name: str) -> torch.Tensor:
        """float32 [..., T, H, D] in the rotated basis."""
        codes = unpack_codes(chunk[f"{name}_codes"], self.bits).float().unflatten(-1, (-1, self.group))
        x = codes * chunk[f"{name}_scale"].float()[..., None] + chunk[f"{name}_zero"].float()[..., None]
        return x.flatten(-2)

    def decompress(self, layer_id, chunk):
        k_pre = self.rotate_keys(self.dequantize(chunk, "k"))
        k = self.rope.rotate(k_pre, self._rope_positions(chunk["pos"].long()))
        return k, self.rotate_values(self.dequantize(chunk, "v"))
