"""RoPE for compressors that need keys or queries without it, or at other positions.

The pool stores post-RoPE K (and the scheduler hands over post-RoPE queries). `ChunkRope` computes
cos / sin exactly as layers/rotary_embedding.RotaryEmbedding does (float32 positions times the
model's inv_freq, neox layout: the two halves of the head dim are the pairs), for any positions, so

    unrotate(rotate(x, p), p) == x   (to float32 rounding; RoPE is a rotation per channel pair)
    rotate(x, p + d) == rotate(rotate(x, p), d)   (rotations by angles add)

`mean_cos_sin(start, n)` averages over n consecutive positions: applied like RoPE it is the
expected rotation E_p[R(p)] over them (expected_attention's averaged future RoPE).
"""

from __future__ import annotations

import torch

from sglang_vericache.layers.rotary_embedding import compute_inv_freq, rotate_half

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


class ChunkRope:
    def __init__(self, head_dim: int, rope_parameters: dict | None = None):
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.inv_freq = compute_inv_freq(dict(rope_parameters or DEFAULT_ROPE), head_dim)  # [D/2] float32
        self.cos_cache = self.sin_cache = torch.empty(0, head_dim)  # rows = positions 0, 1, ...

    def table(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, D] for positions 0..P-1, P > positions.max(): grown by doubling (entries are
        computed as RotaryEmbedding computes its cache, so a row does not depend on P)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > len(self.cos_cache) or self.cos_cache.device != positions.device:
            size = max(need, 2 * len(self.cos_cache), 64)
            freqs = torch.arange(size, device=positions.device).float()[:, None] * self.inv_freq.to(
                positions.device
            )
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos_cache, self.sin_cache = emb.cos(), emb.sin()
        return self.cos_cache, self.sin_cache

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] (integers >= 0) -> float32 cos, sin [..., D]."""
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError(f"RoPE positions must be >= 0, got {int(positions.min())}")
        cos, sin = self.table(positions)
        flat = positions.reshape(-1).long()
        shape = (*positions.shape, cos.shape[-1])
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., D] float32, positions broadcastable to x.shape[:-1]: RoPE at those positions."""
        cos, sin = self.cos_sin(positions)
        return x * cos + rotate_half(x) * sin

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The inverse of rotate (rotation by the opposite angles)."""
        cos, sin = self.cos_sin(positions)
        return x * cos - rotate_half(x) * sin

    def mean_cos_sin(self, start: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """start [...] int -> cos, sin [..., D] averaged over positions start .. start + n - 1."""
        cos, sin = self.cos_sin(start[..., None] + torch.arange(n, device=start.device))
        return cos.mean(dim=-2), sin.mean(dim=-2)


def apply_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin along `dim` (cos, sin [..., D] broadcast against x moved so)."""
    if dim in (-1, x.dim() - 1):
        return x * cos + rotate_half(x) * sin
    moved = x.movedim(dim, -1)
    return (moved * cos + rotate_half(moved) * sin).movedim(-1, dim)
