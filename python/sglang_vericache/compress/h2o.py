"""H2O, chunk-local: heavy hitters by accumulated attention plus the chunk's recent tokens."""

from __future__ import annotations

import torch

from sglang_vericache.compress.token_drop import (
    TokenDropCompressor,
    attention_mass,
    recent_indices,
    top_k_indices,
)


class H2OCompressor(TokenDropCompressor):
    """Accumulated attention of all T chunk queries (causal, softmax per query and q-head) per
    key, summed over the q-heads of each KV group. Budget split: the chunk's last
    floor(k * h2o_recent_fraction) tokens (recent), then the top-scored of the earlier tokens
    (heavy hitters) for the rest; ties go to the lower index. Per KV head.
    """

    name = "h2o"

    def query_window(self, layer_id: int) -> int:
        return self.config.chunk_size

    def select(self, layer_id, k, q, positions):
        q = self._check_q(layer_id, q, k)
        num_tokens, n = k.shape[-3], self.rows(layer_id)
        n_recent = int(n * self.config.h2o_recent_fraction)
        scores = attention_mass(q, k, self.config.scale)[..., : num_tokens - n_recent]
        return torch.cat([top_k_indices(scores, n - n_recent), recent_indices(k, n_recent)], dim=-1)
