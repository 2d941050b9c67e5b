"""Megatron-style tensor-parallel linear layers (SGLang's names), over layers.linear.Linear.

- ColumnParallelLinear: the output features are split over the ranks (each holds its rows of the
  weight and bias); no communication. QKV (by head) and gate/up use it: their outputs stay sharded.
- RowParallelLinear: the input features are split (each holds its columns); the ranks' partial
  products are all-reduced (distributed.parallel_state.TPGroup.all_reduce), then the bias is added
  once. o_proj and down_proj use it, after a column-parallel layer, so no all-gather is needed.
With one rank both are exactly Linear (the bias inside the same F.linear call as before).

Weights come in full (the checkpoint's tensor) and each layer's `load_shard` keeps this rank's part.
"""

from __future__ import annotations

import torch

from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.layers.linear import Linear


def divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"--tp-size {tp_size} must divide {what} ({n})")
    return n // tp_size


class ColumnParallelLinear(Linear):
    """y[:, this rank's outputs] = x W_rank^T + b_rank; `shards`: the output segments (e.g. q, k, v
    or gate, up), each split over the ranks separately and stored one after the other."""

    def __init__(self, in_features: int, shards: list[int], bias: bool = False):
        tp = get_tp_group()
        self.local_shards = [divide(n, tp.size, "every output segment of a column-parallel layer") for n in shards]
        super().__init__(in_features, sum(self.local_shards), bias=bias)

    def local_rows(self, shard_id: int) -> slice:
        start = sum(self.local_shards[:shard_id])
        return slice(start, start + self.local_shards[shard_id])

    @staticmethod
    def rank_part(w: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full segment (weight rows or bias entries)."""
        tp = get_tp_group()
        return w[tp.shard(w.shape[0])] if tp.size > 1 else w


class RowParallelLinear(Linear):
    """y = all_reduce_ranks(x_rank W_rank^T) + b, x_rank this rank's input columns (already sharded)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        self.tp = get_tp_group()
        super().__init__(divide(in_features, self.tp.size, "the input features of a row-parallel layer"),
                         out_features, bias=bias)

    @staticmethod
    def rank_part(w: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the full weight (a bias is kept whole)."""
        tp = get_tp_group()
        return w[:, tp.shard(w.shape[1])] if tp.size > 1 and w.dim() == 2 else w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.matmul(x, with_bias=False))
        return y if self.bias is None else y + self.bias
