"""One request's grammar state: an xgrammar matcher that can mask, accept and roll back.

Invariant: the matcher has accepted exactly the request's output_ids followed by its current
drafts. A token the grammar treats as a stop token (the model's EOS) ends the grammar; after it
the matcher is terminated and accepts nothing more.
"""

from __future__ import annotations

import torch
import xgrammar as xgr

_BITS = torch.arange(32, dtype=torch.int32)


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32[rows, ceil(V/32)] (bit j of word w = token 32w+j allowed) -> bool[rows, V]."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1
    return bits.bool().flatten(1)[:, :vocab_size]


class Grammar:
    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int, key: tuple[str, str]):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.key = key  # (kind, spec) it was compiled from
        self.stop_token_ids = frozenset(matcher.stop_token_ids)
        self.num_accepted = 0  # tokens the matcher holds (output_ids + drafts)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def next_bitmask(self) -> torch.Tensor:
        """int32[ceil(V/32)]: the tokens allowed next. All bits set once terminated (the row is
        never used then: a terminated request emits nothing more)."""
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        if not self.terminated:
            self.matcher.fill_next_token_bitmask(mask)
        return mask[0]

    def accept(self, token: int) -> bool:
        """Advances by one token; False (state unchanged) if the grammar forbids it."""
        if self.terminated or not self.matcher.accept_token(int(token)):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, n: int) -> None:
        """Forgets the last n accepted tokens (rejected drafts)."""
        assert 0 <= n <= self.num_accepted, (n, self.num_accepted)
        if n:
            self.matcher.rollback(n)
            self.num_accepted -= n


def vocab_mask(rows: list[torch.Tensor | None], vocab_size: int) -> torch.Tensor | None:
    """Per-row bitmasks (None = unconstrained) -> bool[rows, V] for SamplingBatchInfo, or None
    when no row is constrained."""
    if all(r is None for r in rows):
        return None
    words = (vocab_size + 31) // 32
    full = torch.full((words,), -1, dtype=torch.int32)
    return bitmask_to_bool(torch.stack([full if r is None else r for r in rows]), vocab_size)
