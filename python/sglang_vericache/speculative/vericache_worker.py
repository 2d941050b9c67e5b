"""VeriCacheWorker: lock-step VeriCache rounds (--vericache-schedule lockstep, and no link).

Each decode iteration, every running request runs one whole round (speculative/vericache_round.py):
all draft steps first (one forward per step, over the requests still drafting), then the
verifications, in groups whose exact KV fits the link's staging area. With a link every verifier's
exact KV streams over it; without one it is read from the pool.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.speculative.vericache_round import VeriCacheRound


class VeriCacheWorker(BaseSpecWorker):
    def __init__(self, round: VeriCacheRound, memory: RequestMemory, running: list[Req], link: Link | None):
        self.round = round
        self.memory = memory
        self.running = running
        self.link = link
        self.stats = {}

    def forward_batch_generation(self) -> None:
        r = self.round
        self.memory.make_room(lambda req: r.plan(req) + 1)
        reqs = list(self.running)
        for req in reqs:
            r.start(req, r.plan(req))
        t0 = time.perf_counter()
        while group := [req for req in reqs if r.is_drafting(req)]:
            r.run(drafting=group)
        draft_s = (time.perf_counter() - t0) / len(reqs)
        if self.link is None:
            r.run(resident=reqs, draft_s=draft_s, timed=True)
            return
        for group in self.link.split(reqs):
            r.run(staged=group, draft_s=draft_s, timed=True)
