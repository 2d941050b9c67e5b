"""RequestQueues: the scheduler's requests, with one owner. Every collaborator that moves a request
(admission, prefill, memory pressure, the output sink, aborts, remote prefill) calls a method here;
they may read the queues, never change them.

  waiting  requests not yet admitted (arrival order, or longest cached prefix first), retracted
           ones back at the front;
  running  decoding requests, in the order they started decoding (the newest is retracted first);
  chunked  the prefill in progress (a chunked prefill between its chunks), or None.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req


class RequestQueues:
    def __init__(self) -> None:
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None

    # ------------------------------------------------------------------ waiting

    def enqueue(self, req: Req) -> None:
        """A new request waits last in line."""
        self.waiting.append(req)

    def requeue_first(self, req: Req) -> None:
        """A retracted request waits first in line."""
        self.waiting.appendleft(req)

    def take_waiting(self, i: int = 0) -> Req:
        """Takes the i-th waiting request out of the queue (admitted, or ended)."""
        req = self.waiting[i]
        del self.waiting[i]
        return req

    def drop_waiting(self, req: Req) -> None:
        self.waiting.remove(req)

    def reorder_waiting(self, ordered: Iterable[Req]) -> None:
        """The waiting requests in a new order (the same requests)."""
        ordered = list(ordered)
        self.waiting.clear()
        self.waiting.extend(ordered)

    # ------------------------------------------------------------------ running

    def start_running(self, req: Req) -> None:
        """req decodes from now on (its prefill is done and it emitted its first token), once."""
        if req not in self.running:
            self.running.append(req)

    def stop_running(self, req: Req) -> None:
        """req stops decoding (finished or aborted), if it ran."""
        if req in self.running:
            self.running.remove(req)

    def pop_newest(self) -> Req:
        """The newest running request, taken out (to be retracted)."""
        return self.running.pop()

    # ------------------------------------------------------------------ the prefill in progress

    def set_chunked(self, req: Req) -> None:
        self.chunked = req

    def end_chunked(self, req: Req) -> None:
        """req's prefill is no longer in progress (completed, or given up)."""
        if req is self.chunked:
            self.chunked = None

    def take_chunked(self) -> Req | None:
        """Hands over the prefill in progress (then none is), or None."""
        req, self.chunked = self.chunked, None
        return req

    # ------------------------------------------------------------------ reporting

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    def all(self) -> list[Req]:
        """Every request held: waiting, running, then the chunked one."""
        return [*self.waiting, *self.running, *([self.chunked] if self.chunked else [])]

    def stats(self) -> dict[str, int]:
        """The queue lengths /get_stats reports (a prefill in progress counts as running)."""
        return {"num_running_reqs": len(self.running) + (self.chunked is not None),
                "num_waiting_reqs": len(self.waiting)}
