"""VerifyBookings: when each request of a RoundLoop verifies (speculative/round_loop.py), the one
owner of the reservation rings (speculative/reservations.py) and of every request's booking.

A request starting a round books the iteration it verifies in. Exact KV resident in device memory
needs no link: it verifies once its drafts are done (book_resident: the iteration x away). A
host-tier request's exact KV streams over the link at its verification: it books the first
iteration at least x away whose link bytes (bandwidth x iteration time) and staging rows still have
room for its exact KV (book), and drafts until then. A verification that does not fit the staging
area when its iteration comes waits one more (rebook_next); a request that leaves before verifying
gives its booking back (cancel). The iteration time is an EMA of the forwards measured (rank 0's,
so every rank books alike), and sets the link's budget per iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.speculative.reservations import VerifyReservations

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link

ITER_TIME_EMA = 0.2
INITIAL_ITER_TIME_S = 0.02


@dataclass(frozen=True, slots=True)
class Booking:
    """A request's reserved verification: the iteration, and the link bytes and staging tokens it
    holds there (0 and 0: resident, no link)."""

    at: int
    nbytes: int
    tokens: int


class VerifyBookings:
    def __init__(self, link: Link | None, horizon: int):
        self.link = link
        self.iter_time = INITIAL_ITER_TIME_S
        self.iteration = 0
        self.rings = None  # no link (or no bookings on it): verifications are not booked on the link
        if link is not None:
            self.rings = VerifyReservations(horizon, self.link_bytes_per_iter(), link.max_tokens)
        self.booked: dict[str, Booking] = {}  # rid -> its round's verification

    def link_bytes_per_iter(self) -> float:
        bw = self.link.bandwidth
        return float("inf") if bw is None else bw * self.iter_time

    def get(self, req: Req) -> Booking | None:
        return self.booked.get(req.rid)

    def book(self, req: Req, min_offset: int) -> Booking:
        """Books req's streamed verification at least min_offset iterations away."""
        n = req.kv_committed_len
        nbytes = self.link.bytes_for(n)
        b = self.booked[req.rid] = Booking(self.rings.reserve(min_offset, nbytes, n), nbytes, n)
        return b

    def book_resident(self, req: Req, x: int) -> Booking:
        """Books req's verification x iterations away, on the device (nothing reserved on the link)."""
        b = self.booked[req.rid] = Booking(self.iteration + x, 0, 0)
        return b

    def cancel(self, req: Req) -> None:
        b = self.booked.pop(req.rid, None)
        if b is not None and b.nbytes and self.rings is not None:
            self.rings.cancel(b.at, b.nbytes, b.tokens)

    def rebook_next(self, req: Req) -> None:
        """A streamed verification that did not fit the staging area waits one iteration."""
        self.cancel(req)
        if self.rings is None:
            self.book_resident(req, 1)
        else:
            self.book(req, 1)

    def verified(self, req: Req) -> None:
        """req's booked verification runs now: its round ends, and so does the booking."""
        del self.booked[req.rid]

    def due(self, req: Req) -> bool:
        """Whether req's booked iteration has come."""
        b = self.booked.get(req.rid)
        return b is not None and b.at <= self.iteration

    def advance(self, elapsed: float | None = None) -> None:
        """The iteration is over (elapsed: its forward's seconds; None: no forward ran)."""
        if self.rings is not None:
            if elapsed is not None:  # rank 0's time: the same bookings on every rank
                elapsed = get_tp_group().agree(elapsed)
                self.iter_time = (1 - ITER_TIME_EMA) * self.iter_time + ITER_TIME_EMA * elapsed
            self.rings.set_link_budget(self.link_bytes_per_iter())
            self.rings.advance()
        self.iteration += 1
