"""VeriCacheWorker: lock-step VeriCache rounds (--vericache-schedule lockstep), the RoundLoop
(speculative/round_loop.py) with a fixed plan that runs a whole round per scheduler step.

Each decode step, every running request runs one whole round: room for each request's round is
made first (the draft-length policy's x + 1 exact slots each), then every request starts a round of
x drafts; the loop's iterations run all draft steps (one forward per step, over the requests still
drafting), then the verifications once no request drafts, in groups whose exact KV fits the link's
staging area (one forward each; nothing is booked on the link's rings). With a link every
verifier's exact KV streams over it; without one it is read from the pool.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sglang_vericache.speculative.round_loop import RoundLoop

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.speculative.vericache_round import VeriCacheRound, Verdict


class VeriCacheWorker(RoundLoop):
    def __init__(self, round: VeriCacheRound, memory: RequestMemory, running: list[Req], link: Link | None):
        super().__init__(round, memory, running, link, book_link=False)
        self.opening = False  # the step's first iteration: every request starts its round
        self.drafting = False  # some request of the round still drafts
        self.round_reqs: list[Req] = []
        self.t0 = 0.0
        self.draft_s: float | None = None  # drafting seconds per request of the round

    # ------------------------------------------------------------------ the plan

    def place(self, running: list[Req]) -> dict[str, bool]:
        return {q.rid: self.link is None for q in running}  # with a link, every verification streams

    def start_round(self, req: Req, resident: bool) -> bool:
        if not self.opening:
            return False  # one round per request and step
        self.round.start(req, self.round.plan(req))
        self.bookings.book_resident(req, 0)
        return True

    def started(self, running: list[Req]) -> None:
        self.drafting = any(self.round.is_drafting(q) for q in running if self.bookings.get(q) is not None)

    def verifies_now(self, req: Req, resident: bool) -> bool:
        return not self.drafting  # every request verifies once the round's drafting is over

    def run_forward(self, drafting: list[Req], on_device: list[Req], streamed: list[Req]) -> tuple[list[Verdict], float]:
        """Draft forwards untimed; the verify forwards charge each verifier its share of the forward
        and the round's drafting seconds per request."""
        timed = bool(on_device or streamed)
        if timed and self.draft_s is None:
            self.draft_s = (time.perf_counter() - self.t0) / len(self.round_reqs)
        t0 = time.perf_counter()
        verdicts = self.round.run(drafting=drafting, resident=on_device, staged=streamed,
                                  draft_s=self.draft_s if timed else 0.0, timed=timed)
        return verdicts, time.perf_counter() - t0

    # ------------------------------------------------------------------ one step

    def forward_batch_generation(self) -> None:
        r = self.round
        self.memory.make_room(lambda req: r.plan(req) + 1)
        self.round_reqs, self.draft_s = list(self.running), None
        self.opening, self.t0 = True, time.perf_counter()
        while True:
            self.iterate()
            self.opening = False
            if not any(self.bookings.get(q) is not None for q in self.running):
                return
