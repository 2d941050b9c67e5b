"""RoundLoop: the iteration every local VeriCache schedule runs; a plan says what each request does
in it (VeriCacheWorker, lock-step, and StaggeredVeriCache: fixed plans; AdaptiveVeriCache: its
controller's, remade as the batch changes).

Every iteration is ONE forward (VeriCacheRound.run) of three kinds of rows:
  draft rows     requests in a round, drafting over the compressed tier;
  resident rows  requests whose exact KV is in device memory that verify now (or decode: a
                 one-row verify of the last token);
  staged rows    host-tier requests that verify now, their exact KV streamed over the link layer
                 by layer, in the iteration they booked (speculative/booking.py).
An iteration:
  place   which requests are resident (place: the plan's; a fixed plan keeps none resident);
  start   a request with no booking starts its next round (start_round: the plan's draft length,
          booked in VerifyBookings; False: it waits this iteration);
  room    the verifiers get len(drafts) + 1 exact slots each (retraction may drop requests);
  split   streamed verifiers beyond the staging area wait one more iteration;
  forward the drafting requests' next draft step and the verifiers' verification, in one forward;
  advance the iteration time and the link's budget per iteration (VerifyBookings.advance).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker
from sglang_vericache.speculative.booking import VerifyBookings

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.speculative.vericache_round import VeriCacheRound, Verdict


class RoundLoop(BaseSpecWorker):
    def __init__(self, round: VeriCacheRound, memory: RequestMemory, running: list[Req], link: Link | None,
                 book_link: bool = True):
        self.round = round
        self.memory = memory
        self.running = running
        self.link = link
        self.max_draft = round.max_draft
        # book_link: streamed verifications are booked in the link's reservation rings
        self.bookings = VerifyBookings(link if book_link else None, 2 * round.max_draft + 2)
        self.stats = {}

    @property
    def iteration(self) -> int:
        return self.bookings.iteration

    # ------------------------------------------------------------------ the plan

    def place(self, running: list[Req]) -> dict[str, bool]:
        """Per request (rid): whether its exact KV is resident this iteration."""
        return {q.rid: False for q in running}

    def start_round(self, req: Req, resident: bool) -> bool:
        """Starts req's next round and books its verification; False if it waits this iteration."""
        raise NotImplementedError

    def started(self, running: list[Req]) -> None:
        """Every request that could start its round has (before anyone's room is made)."""

    def verifies_now(self, req: Req, resident: bool) -> bool:
        """Whether req verifies in this iteration: its booked iteration has come."""
        return self.bookings.due(req)

    def run_forward(self, drafting: list[Req], on_device: list[Req], streamed: list[Req]) -> tuple[list[Verdict], float]:
        """The iteration's forward: (verdicts, seconds it took)."""
        t0 = time.perf_counter()
        verdicts = self.round.run(drafting=drafting, resident=on_device, staged=streamed)
        return verdicts, time.perf_counter() - t0

    # ------------------------------------------------------------------ one iteration

    def release(self, req: Req) -> None:
        """req leaves the running set (finished, aborted, retracted): its booking goes back."""
        self.bookings.cancel(req)

    def forward_batch_generation(self) -> None:
        self.iterate()

    def iterate(self) -> bool:
        """One iteration; -> whether host-tier requests ran rounds in it."""
        r, bookings = self.round, self.bookings
        running = list(self.running)
        res_of = self.place(running)
        for q in running:
            if bookings.get(q) is None:
                self.start_round(q, res_of[q.rid])
        self.started(running)

        def verifies_now(q: Req) -> bool:
            return bookings.get(q) is not None and self.verifies_now(q, res_of.get(q.rid, False))

        self.memory.make_room(lambda q: len(q.spec.drafts) + 1 if verifies_now(q) else 0)
        running = list(self.running)  # make_room may retract
        on_device = [q for q in running if verifies_now(q) and res_of.get(q.rid)]
        streamed = [q for q in running if verifies_now(q) and not res_of.get(q.rid)]
        if streamed:  # what does not fit the staging area waits one more iteration
            streamed, *late = self.link.split(streamed)
            for q in (q for g in late for q in g):
                bookings.rebook_next(q)
        drafting = [q for q in running if bookings.get(q) is not None and not verifies_now(q) and r.is_drafting(q)]
        if not (drafting or on_device or streamed):
            bookings.advance()  # everyone waits for its booked iteration (idle link budget)
            return False
        for q in on_device + streamed:
            bookings.verified(q)
        _, elapsed = self.run_forward(drafting, on_device, streamed)
        bookings.advance(elapsed)
        return bool(streamed) or any(not res_of.get(q.rid, True) for q in drafting)
