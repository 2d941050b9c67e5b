"""VeriCacheState: what one request carries between the steps of its VeriCache rounds (Req.spec).

Owned by speculative/vericache_round.py (drafts, masks, target, acceptance) and by the driver that
schedules the round: the staggered schedule's booking, the remote drafter's session fields. User-
visible counters (spec_rounds, spec_accept_length, ...) stay in Req.meta, which goes to the client;
every response's meta_info carries them, zero where no round ran (SPEC_META_DEFAULTS).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.speculative.ngram import NgramIndex

# The VeriCache counters of a request's meta_info (VeriCacheRound.account, account_proposals), as
# they read before any round: in full mode, and in VeriCache mode when it decoded as full mode.
SPEC_META_DEFAULTS = {
    "spec_rounds": 0,
    "spec_drafted_tokens": 0,
    "spec_accepted_tokens": 0,
    "spec_accept_length": 0.0,
    "spec_draft_time_s": 0.0,
    "spec_verify_time_s": 0.0,
    "spec_ngram_proposed_tokens": 0,
    "spec_ngram_accepted_tokens": 0,
}


@dataclass(frozen=True, slots=True)
class Booking:
    """A staggered request's reserved verification (speculative/reservations.py): the iteration,
    and the link bytes and staging tokens it holds there."""

    at: int
    nbytes: int
    tokens: int


@dataclass(slots=True)
class VeriCacheState:
    # This round: the drafts so far, the grammar bitmask each was sampled under (row i of the
    # verification uses draft_masks[i]), and how many drafts the round aims for.
    drafts: list[int] = field(default_factory=list)
    draft_masks: list = field(default_factory=list)
    draft_target: int = 0
    # DraftLengthPolicy's acceptance EMA (None until the first round is planned); kept across
    # retractions, like the request's counters.
    accept_ema: float | None = None
    # Staggered schedule: the verification this round booked (None: no round booked).
    booking: Booking | None = None
    # Remote drafter (disagg/remote_verify.py): when this round started drafting (None: no round
    # open), whether the first round drafts half its length, and num_retractions when the
    # verifier's session opened (a retraction since then ends the session).
    round_started_at: float | None = None
    half_first_round: bool = False
    retractions_at_open: int = 0
    # Adaptive schedule (speculative/adaptive.py): admitted to decode exactly as full mode does, exact
    # KV resident, with no compressed tier of its own (nothing folded, no queries kept, no rounds);
    # and whether this "round" is a planned decode step (x = 0: committed, not counted as a round).
    decode_only: bool = False
    decode_step: bool = False
    # --speculative-ngram (speculative/ngram.py): the n-gram index of the committed tokens (built at
    # the first lookup, caught up before each); kept across rounds and retractions (committed tokens
    # only grow).
    ngram: NgramIndex | None = None

    def start(self, draft_target: int) -> None:
        self.drafts, self.draft_masks, self.draft_target = [], [], draft_target

    def end(self) -> None:
        self.drafts, self.draft_masks = [], []

    def retract(self, grammar) -> None:
        """The request loses its KV: its grammar forgets the outstanding drafts, and so does the round."""
        if grammar is not None:
            grammar.rollback(len(self.drafts))
        self.start(0)
        self.decode_only = self.decode_step = False  # re-admission decides again
