"""DegradingStore: a store that is down or slow becomes a store that misses, never an error.

The scheduler must never fail a request because the KV store failed: without the store it
recomputes the prefix. Invariants:
  - No call raises for a store failure (any Exception from the backend: StoreError, a timeout, a
    client bug): get -> [] (a miss), match_prefix -> 0, put/delete -> False, size_bytes -> 0.
    Argument errors (a malformed key) are checked before the backend and still raise ValueError.
  - One WARNING per outage: the first failure logs it; later failures in the same outage do not.
    Recovery logs one INFO line. stats.errors counts failed backend calls.
  - While down, calls skip the backend (instant misses) until backoff_s has passed since the last
    failure; the next call then probes the backend, ending the outage if it succeeds.
A slow store is one whose calls exceed its backend timeout (RedisStore's socket timeout), which
the backend raises as StoreError.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, TypeVar

from sglang_vericache.mem_cache.storage.base import KVStore, StoreWrapper

logger = logging.getLogger(__name__)
T = TypeVar("T")


class DegradingStore(StoreWrapper):
    def __init__(self, inner: KVStore, backoff_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        super().__init__(inner)
        if backoff_s < 0:
            raise ValueError(f"backoff_s must be >= 0, got {backoff_s}")
        self.backoff_s = backoff_s
        self.clock = clock
        self.down = False
        self.outages = 0
        self._retry_at = 0.0
        self._state_lock = threading.Lock()

    def _guard(self, fn: Callable[[], T], fallback: T) -> T:
        if self.down and self.clock() < self._retry_at:
            return fallback
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - the contract: a store failure is never the caller's
            with self._state_lock:
                self.stats.errors += 1
                self._retry_at = self.clock() + self.backoff_s
                if not self.down:
                    self.down = True
                    self.outages += 1
                    logger.warning(
                        "KV store %r is unavailable (%s); serving without it (prefixes are recomputed), "
                        "retrying every %.1fs", self.inner, e, self.backoff_s,
                    )
            return fallback
        if self.down:
            with self._state_lock:
                if self.down:
                    self.down = False
                    logger.info("KV store %r is available again", self.inner)
        return result

    def _put(self, key: str, data: bytes) -> int | None:
        return self._guard(lambda: self.inner._put(key, data), None)

    def _get_prefix(self, keys: list[str]) -> list[bytes]:
        return self._guard(lambda: self.inner._get_prefix(keys), [])

    def _count_prefix(self, keys: list[str]) -> int:
        return self._guard(lambda: self.inner._count_prefix(keys), 0)

    def _delete(self, key: str) -> bool:
        return self._guard(lambda: self.inner._delete(key), False)

    def size_bytes(self) -> int:
        return self._guard(self.inner.size_bytes, 0)

    def keys_lru(self) -> list[str]:
        return self._guard(self.inner.keys_lru, [])

    def clear(self) -> None:
        self._guard(self.inner.clear, None)

    def close(self) -> None:
        self._guard(self.inner.close, None)
