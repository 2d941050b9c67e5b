"""SnapKV: a trailing window of queries votes for the keys to keep (Li et al., 2024; kvpress SnapKVPress)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sglang_vericache.compress.token_drop import (
    TokenDropCompressor,
    attention_mass,
    attention_mass_at,
    recent_indices,
    top_k_indices,
)


PAGE_WINDOW = 8  # a page's observation window (capped at the page)
SEGMENT_WINDOW = 64  # a segment's: kvpress SnapKVPress's default window_size


class SnapKVCompressor(TokenDropCompressor):
    """Score = causal softmax(q_window @ k^T * scale) summed over the W window queries and the
    q-heads of each KV group, then 1D avg/max pooling (kernel_size, stride 1, zero/-inf padding,
    as SnapKV) over the T - W keys before the window. Per KV head keep the window's own tokens
    (its most recent min(k, W)), then the top-scored earlier keys; ties go to the lower index.

    Over a segment (compress_segment): the window is the last W queries given, those of the
    prompt's last W tokens when a prompt is folded after its prefill (the question in view),
    wherever they lie; the scores are pooled over the segment's keys, the keys inside the window
    score above every other key (kept, as kvpress pads the window with the maximum score; the most
    recent first when the budget is smaller than the window), and the top kept(layer_id, k) per KV
    head are kept over the whole segment. The segment's window is kvpress SnapKVPress's default, 64
    queries (the SnapKV paper's is 32); a page's is 8 (window_size sets both).
    """

    name = "snapkv"
    recent_rule = True  # its observation window

    def query_window(self, layer_id: int) -> int:
        return min(self.config.window_size or PAGE_WINDOW, self.config.chunk_size)

    def select(self, layer_id, k, q, positions):
        q = self._check_q(layer_id, q, k)
        num_tokens, window, n = k.shape[-3], self.query_window(layer_id), self.kept(layer_id, k)
        keep_window = recent_indices(k, min(n, window))
        if n <= window:
            return keep_window
        scores = self.pool(attention_mass(q, k, self.config.scale)[..., : num_tokens - window])
        return torch.cat([top_k_indices(scores, n - window), keep_window], dim=-1)

    def segment_keep(self, layer_id, k, v, q, q_positions, positions):
        return top_k_indices(self.segment_scores(layer_id, k, v, q, q_positions, positions), self.kept(layer_id, k))

    def segment_scores(self, layer_id, k, v, q, q_positions, positions):
        if q is None or q_positions is None or len(q) == 0:
            raise ValueError(f"{self.name}: a segment needs its observation window's queries")
        window = min(self.config.window_size or SEGMENT_WINDOW, len(q))
        q, q_positions = q[-window:], q_positions[-window:]
        scores = self.pool(attention_mass_at(q, q_positions, k, positions, self.config.scale))
        in_window = (positions >= q_positions[0]).unsqueeze(0)  # [1, S]
        # The window's keys first, the most recent of them first (a budget smaller than the window keeps
        # its last tokens, as select() does); then the top-scored keys before it.
        rank = scores.amax() + 1 + (positions - positions[0] + 1).to(scores.dtype) / len(positions)
        return torch.where(in_window, rank.unsqueeze(0), scores)

    def pool(self, scores: torch.Tensor) -> torch.Tensor:
        """[..., N] -> [..., N] pooled along tokens."""
        ks = self.config.kernel_size
        if ks == 1:
            return scores
        pool = F.avg_pool1d if self.config.pooling == "avg" else F.max_pool1d
        return pool(scores.reshape(-1, 1, scores.shape[-1]), ks, stride=1, padding=ks // 2).view(scores.shape)
