"""KVStore: a byte store of KV pages keyed by hash-chain keys, with a byte capacity and LRU eviction.

Contract every backend keeps (the shared test suite checks each one against it):
  - Values are opaque bytes (one page of one tier, see serialize.py); keys match KEY_RE.
  - put(key, v) stores v whole or not at all; a reader never sees a partial value. A value larger
    than the capacity is refused (put returns False), anything else is stored, evicting least
    recently used entries (put and get count as use; contains/match_prefix do not) until the total
    stored bytes are <= capacity. The entry just put is never its own victim.
  - get(keys) returns the values of the leading keys present, stopping at the first miss (a prefix
    is useful only up to its first missing page), and marks them used, in key order.
  - match_prefix(keys) = how many leading keys are present, without reading values.
  - Backends raise StoreError when the store itself fails (down, timeout, I/O); a missing key is
    never an error. DegradingStore turns StoreError into misses for the scheduler.
Backends are safe for several instances (processes, machines) sharing one store; each instance
keeps its own StoreStats.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, Union

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.storage.serialize import PagePayload

KEY_RE = re.compile(r"[0-9A-Za-z_.\-]{1,128}")


class StoreError(RuntimeError):
    """The store failed (unreachable, timed out, I/O error); not raised for a missing key."""


@dataclass
class StoreStats:
    """Counters of one store object (not shared between processes).

    hits: values returned by get; misses: get calls that stopped before their last key (one per
    call: pages after the first miss are not looked up); bytes_in: bytes accepted by put;
    bytes_out: bytes returned by get; evictions: entries removed to fit the capacity;
    rejected: puts refused as larger than the capacity; errors: calls that failed with StoreError
    (counted by DegradingStore); throttle_seconds: time spent waiting on the bandwidth limit.
    """

    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    rejected: int = 0
    errors: int = 0
    throttle_seconds: float = 0.0


def check_key(key: str) -> str:
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"store keys are 1-128 chars of [0-9A-Za-z_.-], got {key!r}")
    return key


Value = Union[bytes, bytearray, memoryview, "PagePayload"]


def to_bytes(value: Value) -> bytes:
    """bytes as is; a page payload (list of per-layer tensor dicts) serialized."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    from sglang_vericache.mem_cache.storage.serialize import serialize_page

    return serialize_page(value)


class KVStore(ABC):
    """Public API (what callers use) over a few backend primitives (what backends implement)."""

    def __init__(self, capacity_bytes: int | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError(f"capacity must be >= 0 bytes (or None), got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.stats = StoreStats()

    # ---- public API --------------------------------------------------------------------------
    def put(self, key: str, value: Value) -> bool:
        """Stores value (bytes, or a page payload serialized here) under key; False if refused."""
        data = to_bytes(value)
        check_key(key)
        if self.capacity_bytes is not None and len(data) > self.capacity_bytes:
            self.stats.rejected += 1
            return False
        evicted = self._put(key, data)
        if evicted is None:  # a degraded store stores nothing
            return False
        self.stats.evictions += evicted
        self.stats.bytes_in += len(data)
        return True

    def get(self, keys: Sequence[str]) -> list[bytes]:
        """Values of the leading present keys, stopping at the first miss."""
        for k in keys:
            check_key(k)
        values = self._get_prefix(list(keys))
        self.stats.hits += len(values)
        self.stats.misses += len(values) < len(keys)
        self.stats.bytes_out += sum(len(v) for v in values)
        return values

    def match_prefix(self, keys: Sequence[str]) -> int:
        """Number of leading keys present (does not count as use)."""
        for k in keys:
            check_key(k)
        return self._count_prefix(list(keys))

    def contains(self, key: str) -> bool:
        return self.match_prefix([key]) == 1

    def delete(self, key: str) -> bool:
        """Removes key; True if it was there."""
        return self._delete(check_key(key))

    @abstractmethod
    def size_bytes(self) -> int:
        """Total bytes of the stored values (of every instance sharing the store)."""

    @abstractmethod
    def keys_lru(self) -> list[str]:
        """Every stored key, least recently used first (eviction order)."""

    @abstractmethod
    def clear(self) -> None:
        """Removes every entry of this store (its directory or key prefix)."""

    def close(self) -> None:
        """Releases connections. Idempotent."""

    # ---- backend primitives ------------------------------------------------------------------
    @abstractmethod
    def _put(self, key: str, data: bytes) -> int | None:
        """Stores data (len(data) <= capacity), evicts to fit, marks key used; -> evictions
        (None: nothing stored, only a degraded wrapper returns that)."""

    @abstractmethod
    def _get_prefix(self, keys: list[str]) -> list[bytes]:
        """Values of the leading present keys, each marked used in order."""

    @abstractmethod
    def _count_prefix(self, keys: list[str]) -> int: ...

    @abstractmethod
    def _delete(self, key: str) -> bool: ...


class StoreWrapper(KVStore):
    """A store that adds behaviour around another one's primitives (degrade, throttle).

    Wrappers share the inner store's StoreStats and capacity; the outermost object's public
    methods do the accounting, so stack them freely: ThrottledStore(DegradingStore(FileStore(..))).
    """

    def __init__(self, inner: KVStore):
        self.inner = inner
        self.capacity_bytes = inner.capacity_bytes
        self.stats = inner.stats

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def _put(self, key: str, data: bytes) -> int | None:
        return self.inner._put(key, data)

    def _get_prefix(self, keys: list[str]) -> list[bytes]:
        return self.inner._get_prefix(keys)

    def _count_prefix(self, keys: list[str]) -> int:
        return self.inner._count_prefix(keys)

    def _delete(self, key: str) -> bool:
        return self.inner._delete(key)

    def size_bytes(self) -> int:
        return self.inner.size_bytes()

    def keys_lru(self) -> list[str]:
        return self.inner.keys_lru()

    def clear(self) -> None:
        self.inner.clear()

    def close(self) -> None:
        self.inner.close()
