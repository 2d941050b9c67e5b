"""Bandwidth limits for stores: a CPU run gets a real slow link between instance and storage.

LinkThrottle models one serial link of `bandwidth` bytes/s: a transfer of n bytes that starts at
t (when its call began, so the backend's own time counts) ends at max(t, link free) + n / bandwidth,
and the caller sleeps until then. Invariants: transfers never overlap on one link (several threads
queue behind each other), and a call moving n bytes returns no earlier than n / bandwidth after it
began. ThrottledStore charges the bytes of values put and values returned by get; key lookups
(match_prefix, contains, delete) move no values and are not charged.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from sglang_vericache.mem_cache.storage.base import KVStore, StoreWrapper


class LinkThrottle:
    def __init__(
        self,
        bandwidth: float,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth}")
        self.bandwidth = float(bandwidth)
        self.clock, self.sleep = clock, sleep
        self._free_at = float("-inf")
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, started: float) -> float:
        """Books the transfer of nbytes that began at `started`; -> when it is through (no sleep)."""
        with self._lock:
            end = max(started, self._free_at) + nbytes / self.bandwidth
            self._free_at = end
        return end

    def charge(self, nbytes: int, started: float) -> float:
        """Blocks until the transfer of nbytes that began at `started` is through; -> seconds slept."""
        if nbytes <= 0:
            return 0.0
        end = self.reserve(nbytes, started)
        left = end - self.clock()
        if left > 0:
            self.sleep(left)
            return left
        return 0.0


class ThrottledStore(StoreWrapper):
    def __init__(self, inner: KVStore, bandwidth: float | LinkThrottle):
        super().__init__(inner)
        self.link = bandwidth if isinstance(bandwidth, LinkThrottle) else LinkThrottle(bandwidth)

    def _put(self, key: str, data: bytes) -> int | None:
        started = self.link.clock()
        evicted = self.inner._put(key, data)
        if evicted is not None:
            self.stats.throttle_seconds += self.link.charge(len(data), started)
        return evicted

    def _get_prefix(self, keys: list[str]) -> list[bytes]:
        started = self.link.clock()
        values = self.inner._get_prefix(keys)
        self.stats.throttle_seconds += self.link.charge(sum(len(v) for v in values), started)
        return values
