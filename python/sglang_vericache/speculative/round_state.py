"""VeriCacheState: what one request carries between the steps of its VeriCache rounds (Req.spec).

The round's own state, owned by VeriCacheRound (speculative/vericache_round.py): the drafts, their
masks, the target, the acceptance EMA, the n-gram index, and whether this round is a planned decode
step; and the one fact admission decides for the request's whole stay, decode_only (set by the
adaptive admission gate, read by placement and the two tiers). What a schedule keeps per request
stays with the schedule: the verification bookings in VerifyBookings (speculative/booking.py), the
adaptive plans and acceptance in AdaptiveVeriCache, the remote drafter's session rounds in
RemoteVerifyWorker.rounds (disagg/remote_verify.py). User-visible counters (spec_rounds,
spec_accept_length, ...) stay in Req.meta, which goes to the client; every response's meta_info
carries them, zero where no round ran (SPEC_META_DEFAULTS).
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


@dataclass(slots=True)
class VeriCacheState:
    # --- VeriCacheRound's (start, sample_drafts, commit).
    # This round: the drafts so far, the grammar bitmask each was sampled under (row i of the
    # verification uses draft_masks[i]), how many drafts the round aims for, and whether it is a
    # planned decode step (the adaptive plan's x = 0: committed, not counted as a round).
    drafts: list[int] = field(default_factory=list)
    draft_masks: list = field(default_factory=list)
    draft_target: int = 0
    decode_step: bool = False
    # DraftLengthPolicy's acceptance EMA (None until the first round is planned); kept across
    # retractions, like the request's counters.
    accept_ema: float | None = None
    # --speculative-ngram (speculative/ngram.py): the n-gram index of the committed tokens (built at
    # the first lookup, caught up before each); kept across rounds and retractions (committed tokens
    # only grow).
    ngram: NgramIndex | None = None
    # --- Admission's (the adaptive admission gate; read by placement and the two tiers): admitted to
    # decode exactly as full mode does, exact KV resident, with no compressed tier of its own (nothing
    # folded, no queries kept, no rounds).
    decode_only: bool = False

    def start(self, draft_target: int, decode_step: bool = False) -> None:
        self.drafts, self.draft_masks, self.draft_target = [], [], draft_target
        self.decode_step = decode_step

    def end(self) -> None:
        self.drafts, self.draft_masks = [], []

    def retract(self, grammar) -> None:
        """The request loses its KV: its grammar forgets the outstanding drafts, and so does the round."""
        if grammar is not None:
            grammar.rollback(len(self.drafts))
        self.start(0)
        self.decode_only = False  # re-admission decides again
