"""The rules of a round's length and acceptance (ARCHITECTURE.md section 3): how many tokens a request
may still emit, the longest round it may draft (draft_len: the clamp every schedule applies),
DraftLengthPolicy, and accepted_length."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req


def tokens_left(req: Req) -> int:
    """New tokens req may still emit (max_new_tokens less those emitted)."""
    return req.sampling_params.max_new_tokens - len(req.output_ids)


def draft_len(req: Req, *limits: int) -> int:
    """The draft length of req's next round under `limits`: at most the tokens it may still emit less
    one (a round emits its accepted drafts and the verifier's token), never below 0."""
    return max(0, min(*limits, tokens_left(req) - 1))


def accepted_length(drafts: list[int], targets: list[int]) -> int:
    """Longest j with drafts[i] == targets[i] for all i < j.

    targets[i] is the verifier's choice after [last token, d_1..d_i]; so drafts[i] (d_{i+1}) is
    right iff it equals targets[i]. The round then emits drafts[:j] + [targets[j]].
    """
    j = 0
    while j < len(drafts) and drafts[j] == targets[j]:
        j += 1
    return j


class DraftLengthPolicy:
    """Draft length per request: fixed, or ('auto') adapted to the request's recent acceptance.

    auto: x = clamp(ceil(1.5 * ema_accepted) + 2, MIN, max); the EMA starts optimistic so a new
    request probes long drafts, and a fully accepted round lengthens the next one.
    """

    MIN = 2
    EMA = 0.5

    def __init__(self, fixed: int | None, max_len: int):
        self.fixed = fixed
        self.max_len = max_len

    def initial_state(self) -> float:
        return float(self.max_len) / 2

    def next_len(self, ema: float) -> int:
        if self.fixed is not None:
            return self.fixed
        import math

        return max(self.MIN, min(self.max_len, math.ceil(1.5 * ema) + 2))

    def update(self, ema: float, accepted: int, drafted: int) -> float:
        bonus = 2 if accepted == drafted else 0
        return (1 - self.EMA) * ema + self.EMA * (accepted + bonus)
