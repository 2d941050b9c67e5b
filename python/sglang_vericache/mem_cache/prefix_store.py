"""PrefixStore: the scheduler's view of the KV store (--kv-store): write-through and lookup.

    write_through(req)      once per request, when its prefill completes: stores the whole pages of
                            its committed KV (each tier in use) that the store lacks.
    lookup_into(req, room)  at admission, before the radix match: extends the tree's match of req's
                            prefix with pages from the store, loaded into freshly allocated exact
                            slots / compressed chunks and inserted into the radix tree. The normal
                            match that follows then finds them, so admission counts them like any
                            matched prefix (locked, against the pool) and prefill starts after them.

Invariants:
  - Only whole pages are stored or loaded, and a loaded page is exactly the KV its tokens produced
    (hash-chain keys name the whole prefix; corrupt pages stop the load there, see PageStore).
  - The compressed tier never extends past the exact one (a tree node always has exact KV).
  - Store trouble never fails a request: the store is a DegradingStore (misses, one warning per
    outage), and a load that gets fewer pages than it allocated frees the rest.
  - Store calls happen at admission and at prefill completion only, never per decode step; a
    request blocked at the head of the queue is looked up once per tree-match state.
Why write-through per request, not per chunk: one store round trip per tier and request, and a
chunked prompt's pages are all in the tree anyway until it finishes; another instance can reuse
them once this prompt's prefill is done.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

from sglang_vericache.mem_cache.storage import create_store
from sglang_vericache.mem_cache.storage.hash_chain import StoreNamespace
from sglang_vericache.mem_cache.storage.page_store import (
    PageStore,
    read_compressed_pages,
    read_exact_pages,
    write_compressed_pages,
    write_exact_pages,
)
from sglang_vericache.mem_cache.storage.serialize import compressed_page_spec, exact_page_spec

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.cache_req import CacheReq
    from sglang_vericache.mem_cache.two_tier import TwoTierKV
    from sglang_vericache.server_args import ServerArgs

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.int64)
_FINGERPRINT_BYTES = 1 << 20  # per weight file: its size, first and last MiB


@dataclass
class TierStats:
    """Counters of one tier. hit: pages loaded into the pools; missed: pages past the tree match
    the store did not have (or returned unreadable); skipped: stored pages not loaded for lack of
    pool room; written: pages put by write-through."""

    pages_hit: int = 0
    pages_missed: int = 0
    pages_skipped: int = 0
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0


def model_identity(model_path: str) -> str:
    """A name for the weights that is the same on every machine holding the same checkpoint:
    the folder name + a digest of config.json and each weight file's name, size, first and last MiB."""
    h = hashlib.blake2b(digest_size=8)
    names = sorted(os.listdir(model_path)) if os.path.isdir(model_path) else []
    for name in names:
        path = os.path.join(model_path, name)
        if name == "config.json":
            with open(path, "rb") as f:
                h.update(f.read())
        elif name.endswith((".safetensors", ".bin", ".pt")):
            size = os.path.getsize(path)
            h.update(f"{name}:{size}".encode())
            with open(path, "rb") as f:
                h.update(f.read(_FINGERPRINT_BYTES))
                f.seek(max(size - _FINGERPRINT_BYTES, 0))
                h.update(f.read())
    return f"{os.path.basename(os.path.normpath(model_path))}@{h.hexdigest()}"


class PrefixStore:
    """Built by the scheduler after its radix tree: reads and writes the exact pool (kv_pool through
    req_to_token_pool's rows), the compressed pool (two_tier), and inserts loaded pages into
    tree_cache (allocating slots from allocator)."""

    def __init__(self, args: ServerArgs, req_to_token_pool, allocator, kv_pool, tree_cache,
                 two_tier: TwoTierKV | None, store=None):
        self.args = args
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.tree_cache = tree_cache
        self.two_tier = two_tier
        self.page_size = P = args.page_size
        self.store = store if store is not None else create_store(
            args.kv_store, path=args.kv_store_path, url=args.kv_store_url, capacity=args.kv_store_capacity,
            bandwidth=args.kv_store_bandwidth, timeout_s=args.kv_store_timeout,
        )
        self.tiers = args.kv_store_tier_set
        model = model_identity(args.model_path)
        dtype = str(kv_pool.dtype).removeprefix("torch.")
        self.exact = self.comp = None
        if "exact" in self.tiers:
            spec = exact_page_spec(kv_pool.num_layers, P, kv_pool.num_kv_heads, kv_pool.head_dim, kv_pool.dtype,
                                   kv_pool.v_head_dim)
            self.exact = PageStore(self.store, StoreNamespace(model, "exact", P, dtype), spec)
        if "compressed" in self.tiers:
            assert two_tier is not None, "server args refuse a compressed store tier in full mode"
            ns = StoreNamespace(model, "compressed", P, dtype, args.kv_compressor, args.kv_compression_ratio)
            self.comp = PageStore(self.store, ns, compressed_page_spec(two_tier.pool.layouts))
        self.stats = {t: TierStats() for t in self.tiers}
        self.tokens_loaded = 0
        self._skip: tuple | None = None  # (rid, tree pages, comp pages) of a lookup that found all it could
        logger.info("KV store %r for %s, tiers: %s", self.store, model, ", ".join(self.tiers))

    # ------------------------------------------------------------------ write-through

    def write_through(self, req: CacheReq) -> None:
        """Stores the whole pages of req's committed KV that the store lacks (each tier)."""
        P = self.page_size
        n_pages = req.kv_committed_len // P
        if n_pages == 0:
            return
        tokens = req.fill_ids[: n_pages * P]
        if self.exact is not None:
            row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
            self._put(self.exact, "exact", tokens, lambda lo, hi: read_exact_pages(
                self.kv_pool, row[lo * P : hi * P], P))
        if self.comp is not None:
            n_comp = min(len(req.comp_indices), n_pages)
            self._put(self.comp, "compressed", tokens[: n_comp * P], lambda lo, hi: read_compressed_pages(
                self.two_tier.pool, req.comp_indices[lo:hi]))

    def _put(self, ps: PageStore, tier: str, tokens: list[int], read) -> None:
        t0, bytes0 = time.perf_counter(), self.store.stats.bytes_in
        keys = ps.keys(tokens)
        have = ps.match_prefix(keys) if keys else 0
        if have < len(keys):
            st = self.stats[tier]
            st.pages_written += ps.put_pages(keys[have:], read(have, len(keys)))
            st.bytes_written += self.store.stats.bytes_in - bytes0
        self.stats[tier].write_seconds += time.perf_counter() - t0

    # ------------------------------------------------------------------ lookup

    def lookup_into(self, req: CacheReq, room: int) -> int:
        """Loads stored pages past the tree's match of req's prefix into the pools and the tree;
        -> exact tokens loaded. room: pool tokens admission could still give req (free + evictable
        - reserves); the load leaves a page of it for the prompt's tail."""
        tree, P = self.tree_cache, self.page_size
        if tree.disable:
            return 0
        key = req.fill_ids[: req.max_prefix_len()]
        n_pages = len(key) // P
        match = tree.match_prefix(key, record_stats=False)
        c = len(match.device_indices) // P
        cc = len(match.comp_indices) if self.two_tier is not None else 0
        state = (req.rid, c, cc)
        if self._skip == state or (c == n_pages and (self.comp is None or cc == c)):
            return 0
        two_tier = self.two_tier is not None
        tree.inc_lock_ref(match.last_node)  # the matched path must survive the evictions below
        if two_tier:
            tree.inc_comp_lock_ref(match.last_node)
        try:
            slots, limited = self._load_exact(key, c, n_pages, room)
            e = c + len(slots) // P
            ids = self._load_comp(self.comp.keys(key[: e * P])[cc:]) if self.comp is not None and cc < e else _EMPTY
            if len(slots) or len(ids):
                value = torch.cat([match.device_indices.cpu(), slots]).to(match.device_indices.device)
                if two_tier:
                    res = tree.insert(key[: e * P], value, torch.cat([match.comp_indices.cpu(), ids]))
                    n_old, dup_comp = res.prefix_len, res.dup_comp
                    self.two_tier.pool.free(dup_comp)  # empty: the store's pages extend the match
                else:
                    n_old = tree.insert(key[: e * P], value)
                self.allocator.free(value[c * P : n_old])  # empty likewise (single-threaded tree)
        finally:
            tree.dec_lock_ref(match.last_node)
            if two_tier:
                tree.dec_comp_lock_ref(match.last_node)
        if not limited:
            self._skip = state if not len(slots) and not len(ids) else None
        if len(slots):
            req.meta["kv_store_loaded_tokens"] = req.meta.get("kv_store_loaded_tokens", 0) + len(slots)
        if len(ids):
            req.meta["kv_store_loaded_compressed_tokens"] = (
                req.meta.get("kv_store_loaded_compressed_tokens", 0) + len(ids) * P)
        self.tokens_loaded += len(slots)
        return len(slots)

    def _load_exact(self, key: list[int], c: int, n_pages: int, room: int) -> tuple[torch.Tensor, bool]:
        """Exact pages [c, ...) of key from the store into new slots; -> (slots, limited by room)."""
        P = self.page_size
        if self.exact is None or c >= n_pages:
            return _EMPTY, False
        # Pages that fit in the pool beside the tree's match and a page of the prompt's tail. No
        # room, no store call: a request waiting for memory does not query the store every step.
        fit = room // P - 1 - c
        if fit <= 0:
            return _EMPTY, True
        st = self.stats["exact"]
        t0, bytes0 = time.perf_counter(), self.store.stats.bytes_out
        keys = self.exact.keys(key[: n_pages * P])[c:]
        present = self.exact.match_prefix(keys)
        st.pages_missed += len(keys) - present
        cap = min(present, fit)
        short = cap * P - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        n = min(cap, self.allocator.available_size() // P)
        st.pages_skipped += present - n
        if n == 0:
            st.read_seconds += time.perf_counter() - t0
            return _EMPTY, present > 0
        pages = torch.tensor(self.allocator.alloc_pages(n), dtype=torch.int64)
        slots = (pages[:, None] * P + torch.arange(P)).flatten()
        payloads = self.exact.get_pages(keys[:n])
        m = len(payloads)
        write_exact_pages(self.kv_pool, slots[: m * P], payloads)
        self.allocator.free(slots[m * P :])
        st.pages_hit += m
        st.pages_missed += n - m  # gone or unreadable since match_prefix
        st.bytes_read += self.store.stats.bytes_out - bytes0
        st.read_seconds += time.perf_counter() - t0
        return slots[: m * P], present > n

    # A drafter that caches compressed pages alone (disagg/remote_prefill.py) loads in two halves:
    # fetch_compressed runs on its prefetch thread (store calls only, never the pools) and
    # install_compressed on the scheduler's (chunks from the pool).

    def fetch_compressed(self, keys: list[str], cap: int | None = None) -> tuple[list, int, float]:
        """Payloads of the stored run of pages keys (from keys[0]), at most cap of them (the rest
        count as skipped); -> (payloads, bytes, seconds)."""
        st = self.stats["compressed"]
        t0, bytes0 = time.perf_counter(), self.store.stats.bytes_out
        present = self.comp.match_prefix(keys)
        n = present if cap is None else min(present, cap)
        payloads = self.comp.get_pages(keys[:n]) if n else []
        st.pages_missed += len(keys) - present + n - len(payloads)  # absent, or gone/unreadable since
        st.pages_skipped += present - n
        return payloads, self.store.stats.bytes_out - bytes0, time.perf_counter() - t0

    def install_compressed(self, payloads: list, nbytes: int, seconds: float) -> torch.Tensor:
        """New chunk ids holding payloads, as many as the pool has room for (the rest skipped)."""
        st = self.stats["compressed"]
        pool = self.two_tier.pool
        n = min(len(payloads), pool.available_chunks() + self.tree_cache.comp_evictable_chunks())
        ids = self.two_tier.alloc_chunks(n) if n else None
        if ids is None:
            n, ids = 0, _EMPTY
        write_compressed_pages(pool, ids, payloads[:n])
        st.pages_hit += n
        st.pages_skipped += len(payloads) - n
        st.bytes_read += nbytes
        st.read_seconds += seconds
        return ids

    def _load_comp(self, keys: list[str]) -> torch.Tensor:
        """Compressed chunks of the stored run of pages keys into new chunk ids (as many as fit)."""
        room = self.two_tier.pool.available_chunks() + self.tree_cache.comp_evictable_chunks()
        return self.install_compressed(*self.fetch_compressed(keys, cap=room))

    # ------------------------------------------------------------------ reporting

    def metrics(self) -> dict[str, float]:
        """Counters for the scheduler's stats (extra) and /metrics."""
        out: dict[str, float] = {}
        for tier, st in self.stats.items():
            for f in fields(st):
                out[f"kv_store_{tier}_{f.name}_total"] = getattr(st, f.name)
        ss = self.store.stats
        out["kv_store_loaded_tokens_total"] = self.tokens_loaded
        out["kv_store_errors_total"] = ss.errors
        out["kv_store_evictions_total"] = ss.evictions
        out["kv_store_throttle_seconds_total"] = ss.throttle_seconds
        out["kv_store_corrupt_pages_total"] = sum(p.corrupt_pages for p in (self.exact, self.comp) if p)
        out["kv_store_down"] = int(bool(getattr(_degrading(self.store), "down", False)))
        return out

    def info(self) -> dict:
        args = self.args
        where = args.kv_store_path if args.kv_store == "file" else args.kv_store_url
        return {"kind": args.kv_store, "where": where, "tiers": list(self.tiers),
                "capacity": args.kv_store_capacity, "bandwidth": args.kv_store_bandwidth}


def _degrading(store):
    """The DegradingStore in a wrapper stack (None if there is none)."""
    from sglang_vericache.mem_cache.storage.degrade import DegradingStore

    while store is not None and not isinstance(store, DegradingStore):
        store = getattr(store, "inner", None)
    return store
