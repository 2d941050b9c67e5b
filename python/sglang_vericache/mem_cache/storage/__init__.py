"""KV storage backends: KV pages of both tiers in a shared store, found by prefix hash chains.

    hash_chain.py    StoreNamespace, page_keys: page-aligned prefix keys, stable across machines
    serialize.py     one page, every layer <-> bytes (versioned header, CRC, spec checks)
    base.py          KVStore (put/get/match_prefix/delete, capacity + LRU, stats), StoreWrapper
    file_backend.py  FileStore: a directory + SQLite LRU index, multi-process safe
    redis_backend.py RedisStore: a Redis server, own exact LRU in Lua scripts
    degrade.py       DegradingStore: down/slow -> misses, one warning per outage, backoff
    throttle.py      ThrottledStore/LinkThrottle: a bytes/s limit on get/put
    page_store.py    PageStore + pool adapters: what the scheduler calls
Importing this package stays cheap; names load lazily.
"""

from __future__ import annotations

import importlib

from sglang_vericache.server_args import KV_STORE_KINDS  # the --kv-store choices: one list

_EXPORTS = {
    "StoreNamespace": "hash_chain", "page_keys": "hash_chain",
    "KVStore": "base", "StoreError": "base", "StoreStats": "base",
    "FileStore": "file_backend", "RedisStore": "redis_backend",
    "DegradingStore": "degrade", "ThrottledStore": "throttle", "LinkThrottle": "throttle",
    "PayloadError": "serialize", "serialize_page": "serialize", "deserialize_page": "serialize",
    "exact_page_spec": "serialize", "compressed_page_spec": "serialize",
    "PageStore": "page_store", "read_exact_pages": "page_store", "write_exact_pages": "page_store",
    "read_compressed_pages": "page_store", "write_compressed_pages": "page_store",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)


def create_store(
    kind: str,
    path: str | None = None,
    url: str | None = None,
    capacity: int | str | None = None,
    bandwidth: float | str | None = None,
    timeout_s: float = 1.0,
    backoff_s: float = 5.0,
    prefix: str = "vckv",
):
    """The store a flag set names: None for 'none', else ThrottledStore?(DegradingStore(backend)).

    capacity/bandwidth take bytes or sizes like '4GB' (bandwidth in bytes/s). A file store whose
    directory cannot be opened raises StoreError here (a configuration error at startup); after
    that, and for Redis (which connects lazily) from the start, failures degrade to misses.
    """
    from sglang_vericache.mem_cache.storage.degrade import DegradingStore
    from sglang_vericache.mem_cache.storage.throttle import ThrottledStore
    from sglang_vericache.server_args import parse_bytes

    if kind not in KV_STORE_KINDS:
        raise ValueError(f"kv store must be one of {KV_STORE_KINDS}, got {kind!r}")
    if kind == "none":
        return None
    cap = None if capacity is None else parse_bytes(capacity, "--kv-store-capacity")
    if kind == "file":
        if not path:
            raise ValueError("--kv-store file needs --kv-store-path DIR")
        from sglang_vericache.mem_cache.storage.file_backend import FileStore

        backend = FileStore(path, capacity_bytes=cap, timeout_s=max(timeout_s, 5.0))
    else:
        from sglang_vericache.mem_cache.storage.redis_backend import RedisStore

        backend = RedisStore(url or "redis://127.0.0.1:6379/0", capacity_bytes=cap, prefix=prefix,
                             timeout_s=timeout_s)
    store = DegradingStore(backend, backoff_s=backoff_s)
    if bandwidth is not None:
        store = ThrottledStore(store, parse_bytes(bandwidth, "--kv-store-bandwidth"))
    return store
