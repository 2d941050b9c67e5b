"""PyramidKV (Cai et al., 2024; kvpress PyramidKVPress): SnapKV selection with per-layer budgets shaped like
a pyramid, more in lower layers.

Page scope: each page alone, layer l keeping pyramid_budgets()[l] of its rows (the layout's, static).
Segment scope: kvpress's budgets for the segment's length (`layer_budgets`), with its fallback to SnapKV's
uniform budget where the smallest layer's would fall below the observation window (at 4x, segments shorter
than 5,120 tokens); the segment's chunks are dealt to the layers by them (mem_cache/compressed_pool.py),
every layer's layout holding the mean.
"""

from __future__ import annotations

from fractions import Fraction

from sglang_vericache.compress.base import CompressedChunk
from sglang_vericache.compress.head_budget import adaptive_keep, whole_chunks
from sglang_vericache.compress.snapkv import SEGMENT_WINDOW, SnapKVCompressor
from sglang_vericache.compress.token_drop import top_k_indices


def pyramid_budgets(num_layers: int, mean: int, chunk_size: int, beta: int) -> list[int]:
    """Per-layer kept rows of a page, decreasing linearly from layer 0 to the last layer.

    Real budgets r_l run linearly from max_b = 2*mean - min_b down to min_b = ceil(mean / beta)
    (PyramidKV's beta); if max_b would exceed T it is capped at T and min_b = 2*mean - T. So
    mean(r_l) = mean exactly. Integers: floor(r_l), then +1 to the layers with the largest
    fractional parts (ties: lower layer), so sum == num_layers * mean and the order is kept.
    """
    if num_layers == 1:
        return [mean]
    min_b = max(1, -(-mean // beta))
    max_b = 2 * mean - min_b
    if max_b > chunk_size:
        max_b, min_b = chunk_size, 2 * mean - chunk_size
    real = [max_b - Fraction(layer * (max_b - min_b), num_layers - 1) for layer in range(num_layers)]
    budgets = [int(r) for r in real]  # floor: r >= 1
    deficit = num_layers * mean - sum(budgets)
    by_remainder = sorted(range(num_layers), key=lambda layer: (-(real[layer] - budgets[layer]), layer))
    for layer in by_remainder[:deficit]:
        budgets[layer] += 1
    return budgets


def layer_budgets(num_layers: int, num_tokens: int, mean: int, window: int, beta: int) -> list[Fraction]:
    """kvpress PyramidKVPress.get_layer_budget over a segment of num_tokens, mean kept tokens per head and
    layer: from max_num = 2 * mean - min_num down to min_num = mean // beta (max_num capped at num_tokens -
    window, min_num then 2 * mean - max_num), linearly (exact, mean kept); SnapKV's uniform mean unless
    num_tokens >= max_num >= min_num >= window."""
    lo = mean // beta
    hi = 2 * mean - lo
    if hi >= num_tokens - window:
        hi = num_tokens - window
        lo = 2 * mean - hi
    if num_layers == 1 or not num_tokens >= hi >= lo >= window:
        return [Fraction(mean)] * num_layers
    return [hi - Fraction(layer * (hi - lo), num_layers - 1) for layer in range(num_layers)]


class PyramidKVCompressor(SnapKVCompressor):
    """SnapKV scores and selection (window kept first) with pyramid layer budgets, the same total over
    layers as SnapKV at ratio R (the module docstring)."""

    name = "pyramidkv"
    own_layer_budgets = True  # no global head budget: the pyramid is its layer budget

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.mean = min(c.budget, c.chunk_size)
        self.budgets = pyramid_budgets(c.num_layers, self.mean, c.chunk_size, c.pyramid_beta)

    def rows(self, layer_id: int) -> int:
        return self.mean if self.config.segment_layers else self.budgets[layer_id]

    @property
    def deals_layers(self) -> bool:
        return self.config.segment_layers

    def deal_layers(self, ranked: dict, n: int) -> dict[int, tuple[int, CompressedChunk | None]]:
        """layer_budgets() for the segment in whole chunks (head_budget.whole_chunks), each layer's top
        c_l * rows per head (head-adaptive: over its heads) of its ranked scores."""
        layers, rows = sorted(ranked), self.mean
        num_tokens = n * self.config.chunk_size
        budgets = layer_budgets(len(layers), num_tokens, rows * n, self.config.window_size or SEGMENT_WINDOW,
                                self.config.pyramid_beta)
        counts = whole_chunks([b / rows for b in budgets], len(layers) * n, num_tokens // rows)
        out = {}
        for layer, c in zip(layers, counts):
            k, v, scores = ranked[layer]
            if c == 0:
                out[layer] = (0, None)
            elif self.head_adaptive:
                mask = adaptive_keep(scores, c * rows, self.head_safeguard())
                out[layer] = (c, self.cells_chunk(k, v, mask, c, rows))
            else:
                out[layer] = (c, self.rows_chunk(k, v, top_k_indices(scores, c * rows), c, rows))
        return out
