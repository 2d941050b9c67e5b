"""PyramidKV, chunk-local: SnapKV selection with per-layer budgets shaped like a pyramid."""

from __future__ import annotations

from fractions import Fraction

from sglang_vericache.compress.snapkv import SnapKVCompressor


def pyramid_budgets(num_layers: int, mean: int, chunk_size: int, beta: int) -> list[int]:
    """Per-layer kept rows, decreasing linearly from layer 0 to the last layer.

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


class PyramidKVCompressor(SnapKVCompressor):
    """SnapKV scores and selection (window kept first); layer l keeps pyramid_budgets()[l] rows
    per head, more in lower layers, with the same total over layers as SnapKV at ratio R.
    """

    name = "pyramidkv"

    def __init__(self, config):
        super().__init__(config)
        c = config
        mean = min(c.budget, c.chunk_size)
        self.budgets = pyramid_budgets(c.num_layers, mean, c.chunk_size, c.pyramid_beta)

    def rows(self, layer_id: int) -> int:
        return self.budgets[layer_id]
