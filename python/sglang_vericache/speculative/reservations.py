"""The staggering policy's bookkeeping: reservations of future verification slots.

The paper keeps two rings of reservations: for each of the next `horizon` iterations, how many
bytes the link can still move and how many staging tokens are still free. A request reserves
the iteration it will verify in when it starts a round (the first one at least `min_drafts`
iterations away with room for its exact KV in both rings) and drafts until then. So at any
iteration only the requests that fit the link verify, and the rest draft: link and compute
work at once instead of taking turns.

Pure Python (no torch): the GPU projection replays the same policy with a cost model.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class Slot:
    link_bytes: float  # bytes the link can still move during this iteration
    staging_tokens: int  # staged exact-KV tokens still free during this iteration


class VerifyReservations:
    def __init__(self, horizon: int, link_bytes_per_iter: float, staging_tokens: int):
        assert horizon >= 1 and staging_tokens >= 1
        self.horizon = horizon
        self.link_bytes_per_iter = link_bytes_per_iter
        self.staging_tokens = staging_tokens
        self.iteration = 0  # the iteration slots[0] stands for
        self.slots = deque(self._fresh() for _ in range(horizon))

    def _fresh(self) -> Slot:
        return Slot(self.link_bytes_per_iter, self.staging_tokens)

    def set_link_budget(self, link_bytes_per_iter: float) -> None:
        """New estimate of what the link moves per iteration; applies to slots not yet used."""
        if link_bytes_per_iter == self.link_bytes_per_iter:  # also inf == inf: inf - inf is NaN
            return
        delta = link_bytes_per_iter - self.link_bytes_per_iter
        self.link_bytes_per_iter = link_bytes_per_iter
        for slot in self.slots:
            slot.link_bytes = link_bytes_per_iter if math.isinf(delta) else slot.link_bytes + delta

    def advance(self) -> None:
        """The current iteration is over: its slot leaves the ring, a fresh one joins the end."""
        self.slots.popleft()
        self.slots.append(self._fresh())
        self.iteration += 1

    def reserve(self, min_offset: int, nbytes: float, ntokens: int, max_offset: int | None = None) -> int:
        """Books the first iteration >= iteration + min_offset whose slot has room, and returns it.

        A verification bigger than a whole slot takes an empty slot (it runs over budget rather
        than never). Past the horizon (or max_offset) the last candidate is taken regardless.
        """
        last = self.horizon - 1 if max_offset is None else min(max_offset, self.horizon - 1)
        first = min(min_offset, last)
        chosen = last
        for off in range(first, last + 1):
            slot = self.slots[off]
            fits = slot.link_bytes >= nbytes and slot.staging_tokens >= ntokens
            empty = slot.link_bytes == self.link_bytes_per_iter and slot.staging_tokens == self.staging_tokens
            if fits or empty:
                chosen = off
                break
        slot = self.slots[chosen]
        slot.link_bytes -= nbytes
        slot.staging_tokens -= ntokens
        return self.iteration + chosen

    def cancel(self, iteration: int, nbytes: float, ntokens: int) -> None:
        """Gives back a reservation (a request that finished or was retracted before verifying)."""
        off = iteration - self.iteration
        if 0 <= off < self.horizon:
            self.slots[off].link_bytes += nbytes
            self.slots[off].staging_tokens += ntokens
