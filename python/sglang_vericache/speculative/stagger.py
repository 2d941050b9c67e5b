"""Staggered VeriCache (the paper's P1): in every iteration the drafting requests take one draft
step while the few whose booked verification iteration has come verify, in ONE mixed forward
(VeriCacheRound.run); the verifiers' exact KV streams over the link layer by layer during it.

When a request starts a round it books its verification iteration in the reservation rings
(speculative/reservations.py): the first iteration at least x away (x = its draft length) whose link
bytes (bandwidth x iteration time) and staging rows still have room for its exact KV; it drafts
until then. So the link moves roughly one iteration's worth of exact KV per iteration, overlapped
with the compute of everyone else's drafting, instead of everyone drafting and then everyone
waiting on the link (lock-step). A request that leaves before verifying gives its booking back
(RequestMemory.on_leave -> release).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker
from sglang_vericache.speculative.reservations import VerifyReservations
from sglang_vericache.speculative.round_state import Booking

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.speculative.vericache_round import VeriCacheRound

ITER_TIME_EMA = 0.2
INITIAL_ITER_TIME_S = 0.02


class StaggeredVeriCache(BaseSpecWorker):
    def __init__(self, round: VeriCacheRound, memory: RequestMemory, running: list[Req], link: Link):
        self.round = round
        self.memory = memory
        self.running = running
        self.link = link
        self.stats = {}
        self.iter_time = INITIAL_ITER_TIME_S
        self.rings = VerifyReservations(2 * round.max_draft + 2, self.link_bytes_per_iter(), link.max_tokens)

    def link_bytes_per_iter(self) -> float:
        bw = self.link.bandwidth
        return float("inf") if bw is None else bw * self.iter_time

    # ------------------------------------------------------------------ bookings

    def book(self, req: Req) -> None:
        """Starts req's round: books its verification iteration, and drafts until then."""
        x = self.round.plan(req)
        req.spec.booking = self.reserve(req, x)
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        self.round.start(req, max(0, min(req.spec.booking.at - self.rings.iteration, self.round.max_draft, left - 1)))

    def reserve(self, req: Req, min_offset: int) -> Booking:
        n = req.kv_committed_len
        nbytes = self.link.bytes_for(n)
        return Booking(self.rings.reserve(min_offset, nbytes, n), nbytes, n)

    def release(self, req: Req) -> None:
        b, req.spec.booking = req.spec.booking, None
        if b is not None:
            self.rings.cancel(b.at, b.nbytes, b.tokens)

    def verifies_now(self, req: Req) -> bool:
        return req.spec.booking.at <= self.rings.iteration

    # ------------------------------------------------------------------ one iteration

    def forward_batch_generation(self) -> None:
        r = self.round
        for req in self.running:
            if req.spec.booking is None:
                self.book(req)
        # The verifiers need len(drafts)+1 exact slots each; retraction may drop requests.
        self.memory.make_room(lambda req: len(req.spec.drafts) + 1 if self.verifies_now(req) else 0)
        verifiers = [req for req in self.running if self.verifies_now(req)]
        if verifiers:  # over-budget bookings (past the horizon) wait one more iteration
            verifiers, *late = self.link.split(verifiers)
            for req in (req for group in late for req in group):
                self.release(req)
                req.spec.booking = self.reserve(req, 1)
        drafting = [req for req in self.running if not self.verifies_now(req) and r.is_drafting(req)]
        if not verifiers and not drafting:
            self.rings.advance()  # everyone waits for its booked iteration (idle link budget)
            return
        t0 = time.perf_counter()
        for req in verifiers:
            req.spec.booking = None
        r.run(drafting=drafting, staged=verifiers)
        elapsed = get_tp_group().agree(time.perf_counter() - t0)  # rank 0's time: the same bookings on every rank
        self.iter_time = (1 - ITER_TIME_EMA) * self.iter_time + ITER_TIME_EMA * elapsed
        self.rings.set_link_budget(self.link_bytes_per_iter())
        self.rings.advance()
