"""Vocabulary-parallel embedding and LM head (SGLang's VocabParallelEmbedding / ParallelLMHead).

The vocabulary is split in tp_size contiguous ranges of ceil(V / tp_size) rows; the last range is
padded with zero rows. Embedding: each rank looks up the ids in its range (zeros elsewhere), and the
ranks' rows are all-reduced (exactly one rank contributes each row, so the sum is exact). LM head:
each rank computes the logits of its range, and the ranges are all-gathered (then the padding cut).
With one rank both are the plain layers they replace.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.layers.linear import Linear


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """-> (start, end, rows per rank) of rank's vocabulary range; end <= vocab_size."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def load_vocab_rows(param: torch.Tensor, full: torch.Tensor) -> None:
    """This rank's rows of a full [vocab, hidden] tensor into param (padding rows zeroed)."""
    tp = get_tp_group()
    start, end, per = vocab_range(full.shape[0], tp.rank, tp.size)
    if tuple(param.shape) != (per, full.shape[1]):
        raise ValueError(f"shape mismatch: checkpoint {tuple(full.shape)} vs a vocabulary shard of "
                         f"{tuple(param.shape)} at --tp-size {tp.size}")
    param[: end - start].copy_(full[start:end].to(param.dtype))
    param[end - start :].zero_()


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int):
        self.tp = get_tp_group()
        self.start, self.end, per = vocab_range(vocab_size, self.tp.rank, self.tp.size)
        super().__init__(per if self.tp.size > 1 else vocab_size, hidden_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(ids)
        inside = (ids >= self.start) & (ids < self.end)
        local = F.embedding(torch.where(inside, ids - self.start, 0), self.weight)
        local = local.masked_fill(~inside.unsqueeze(-1), 0)
        return self.tp.all_reduce(local)


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int):
        self.tp = get_tp_group()
        self.vocab_size = vocab_size
        per = vocab_range(vocab_size, self.tp.rank, self.tp.size)[2]
        super().__init__(hidden_size, per if self.tp.size > 1 else vocab_size, bias=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """-> float32 [rows, vocab] on every rank."""
        out = self(hidden).float()
        if self.tp.size == 1:
            return out
        return self.tp.all_gather(out, dim=-1)[:, : self.vocab_size]
