"""H2O: heavy hitters by accumulated attention plus the most recent tokens (Zhang et al., 2023)."""

from __future__ import annotations

import torch

from sglang_vericache.compress.token_drop import (
    TokenDropCompressor,
    attention_mass,
    attention_mass_at,
    recent_indices,
    top_k_indices,
)


class H2OCompressor(TokenDropCompressor):
    """Accumulated attention of all T chunk queries (causal, softmax per query and q-head) per
    key, summed over the q-heads of each KV group. Budget split: the chunk's last
    floor(k * h2o_recent_fraction) tokens (recent), then the top-scored of the earlier tokens
    (heavy hitters) for the rest; ties go to the lower index. Per KV head.

    Over a segment: the attention every query given (the segment's and those after it) pays to the
    segment's keys, the segment's last floor(kept * h2o_recent_fraction) tokens as the recent part.
    """

    name = "h2o"
    recent_rule = True  # its recent tokens

    def query_window(self, layer_id: int) -> int:
        return self.config.chunk_size

    def select(self, layer_id, k, q, positions):
        q = self._check_q(layer_id, q, k)
        num_tokens, n = k.shape[-3], self.kept(layer_id, k)
        n_recent = int(n * self.config.h2o_recent_fraction)
        scores = attention_mass(q, k, self.config.scale)[..., : num_tokens - n_recent]
        return torch.cat([top_k_indices(scores, n - n_recent), recent_indices(k, n_recent)], dim=-1)

    def segment_keep(self, layer_id, k, v, q, q_positions, positions):
        if q is None or q_positions is None or len(q) == 0:
            raise ValueError(f"{self.name}: a segment needs its queries")
        num_tokens, n = k.shape[-3], self.kept(layer_id, k)
        n_recent = int(n * self.config.h2o_recent_fraction)
        mass = attention_mass_at(q, q_positions, k, positions, self.config.scale)[..., : num_tokens - n_recent]
        return torch.cat([top_k_indices(mass, n - n_recent), recent_indices(k, n_recent)], dim=-1)
