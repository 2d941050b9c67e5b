"""Staggered VeriCache (the paper's P1): the RoundLoop (speculative/round_loop.py) with a fixed plan.
In every iteration the drafting requests take one draft step while the few whose booked
verification iteration has come verify, in ONE mixed forward; the verifiers' exact KV streams over
the link layer by layer during it.

The plan never changes: every request runs rounds of the draft-length policy's x
(VeriCacheRound.plan), its exact KV on the host tier. When a request starts a round it books its
verification iteration in the reservation rings (speculative/booking.py): the first iteration at
least x away whose link bytes (bandwidth x iteration time) and staging rows still have room for its
exact KV; it drafts until then (up to the longest round). So the link moves roughly one
iteration's worth of exact KV per iteration, overlapped with the compute of everyone else's
drafting, instead of everyone drafting and then everyone waiting on the link (lock-step). A
request that leaves before verifying gives its booking back (RequestMemory.on_leave -> release).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_vericache.speculative.acceptance import draft_len
from sglang_vericache.speculative.round_loop import RoundLoop

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req


class StaggeredVeriCache(RoundLoop):
    def start_round(self, req: Req, resident: bool) -> bool:
        """Books req's verification at least x iterations away, and drafts until then."""
        booking = self.bookings.book(req, self.round.plan(req))
        self.round.start(req, draft_len(req, booking.at - self.iteration, self.max_draft))
        return True
