"""K-norm: keep the keys with the lowest L2 norm (no queries needed)."""

from __future__ import annotations

from sglang_vericache.compress.token_drop import TokenDropCompressor, top_k_indices


class KNormCompressor(TokenDropCompressor):
    """Per KV head keep the k chunk tokens whose post-RoPE key has the lowest L2 norm (low-norm
    keys draw high attention: Devoto et al. 2024, kvpress KnormPress). Ties: lower index.
    """

    name = "knorm"

    def select(self, layer_id, k, q, positions):
        norms = k.float().norm(dim=-1).transpose(-1, -2)  # [..., H, T]
        return top_k_indices(-norms, self.kept(layer_id, k))

    def segment_scores(self, layer_id, k, v, q, q_positions, positions):
        return -k.float().norm(dim=-1).transpose(-1, -2)  # [H, S]
