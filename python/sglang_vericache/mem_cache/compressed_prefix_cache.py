"""CompressedPrefixCache: the prefix cache of a drafter that never holds a prompt's exact KV.

With --disagg-prefill verifier (remote prefix caching) the verifier prefills every prompt, so this
instance has no exact KV of any prompt prefix, and the two-tier radix tree (invariant E: every node
holds exact KV) cannot cache them. This cache keeps compressed pages alone, one entry per page,
under the page's prefix hash-chain key (the KV store's key, which names the whole prefix up to the
page's end):

    pages[key] = CachedPage(chunk, parent, children, ref, atime)

Invariants:
  - Closed toward position 0: a page's parent is cached, so a prompt's cached pages are the run of
    its keys from the first one while present (`match`).
  - ref counts the requests whose compressed prefix runs through the page; `lock`/`unlock` take a
    whole path. A locked page's ancestors are locked, so the pages with ref 0 are whole subtrees,
    evicted leaves first, least recently used first: eviction never breaks the closure.
  - Chunk ids in the cache are the cache's, freed only by eviction (or reset). A request owns its
    chunks past its held pages and its exact slots from exact_from on (Req.remote_prefill), freed
    at release.
The two-tier tree underneath stays empty: nothing in this mode inserts into it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Any

import torch

from sglang_vericache.mem_cache.two_tier_radix_cache import TwoTierRadixCache


@dataclass
class CachedPage:
    chunk: int
    parent: str | None
    children: int = 0
    ref: int = 0
    atime: int = 0


class CompressedPrefixCache(TwoTierRadixCache):
    def __init__(self, *args, **kwargs):
        self.pages: dict[str, CachedPage] = {}
        super().__init__(*args, **kwargs)
        self._clock = itertools.count(1)

    # ------------------------------------------------------------------ pages

    def match(self, keys: list[str]) -> torch.Tensor:
        """Chunk ids of the leading cached pages of keys (touched for LRU)."""
        ids = []
        now = next(self._clock)
        for key in keys:
            page = self.pages.get(key)
            if page is None:
                break
            page.atime = now
            ids.append(page.chunk)
        return torch.tensor(ids, dtype=torch.int64)

    def insert(self, keys: list[str], ids: torch.Tensor, start: int) -> int:
        """Adopts chunk ids[i] as page keys[start + i], for pages keys[:start] already cached.
        Stops at the first page cached meanwhile (the caller keeps that chunk and the rest);
        -> how many chunks the cache took."""
        now = next(self._clock)
        taken = 0
        for i, chunk in enumerate(ids.tolist()):
            key = keys[start + i]
            if key in self.pages:
                break
            parent = keys[start + i - 1] if start + i > 0 else None
            assert parent is None or parent in self.pages, "pages are cached from position 0"
            self.pages[key] = CachedPage(chunk, parent, atime=now)
            if parent is not None:
                self.pages[parent].children += 1
            taken += 1
        return taken

    def lock(self, keys: list[str]) -> None:
        for key in keys:
            self.pages[key].ref += 1

    def unlock(self, keys: list[str]) -> None:
        for key in keys:
            page = self.pages[key]
            assert page.ref > 0, f"page {key} unlocked more often than locked"
            page.ref -= 1

    # ------------------------------------------------------------------ TwoTierRadixCache's interface

    def comp_evictable_chunks(self) -> int:
        return super().comp_evictable_chunks() + sum(p.ref == 0 for p in self.pages.values())

    def comp_protected_chunks(self) -> int:
        return super().comp_protected_chunks() + sum(p.ref > 0 for p in self.pages.values())

    def evict_compressed(self, num_chunks: int) -> int:
        """Frees up to num_chunks chunks: unlocked leaf pages, least recently used first."""
        freed = super().evict_compressed(num_chunks)
        heap = [(p.atime, k) for k, p in self.pages.items() if p.ref == 0 and p.children == 0]
        heapq.heapify(heap)
        victims = []
        while freed < num_chunks and heap:
            _, key = heapq.heappop(heap)
            page = self.pages.pop(key)
            victims.append(page.chunk)
            freed += 1
            if page.parent is not None:
                parent = self.pages[page.parent]
                parent.children -= 1
                if parent.children == 0 and parent.ref == 0:
                    heapq.heappush(heap, (parent.atime, page.parent))
        if victims:
            self.compressed_pool.free(torch.tensor(victims, dtype=torch.int64))
        return freed

    def cache_finished_req(self, req: Any) -> None:
        """Frees the request's own exact slots and chunks and unlocks its cached pages."""
        st = req.remote_prefill  # disagg/remote_prefill.py's RemotePrefillState
        if st is None or st.exact_from is None:  # never admitted by RemotePrefill: nothing of it is here
            return super().cache_finished_req(req)
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        self.token_to_kv_pool_allocator.free(row[st.exact_from : req.kv_allocated_len])
        keys, st.exact_from, st.held_keys = st.held_keys, None, []
        self.compressed_pool.free(self._as_ids(req.comp_indices)[len(keys) :])
        self.unlock(keys)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    def cache_unfinished_req(self, req: Any) -> None:
        """Nothing to share: the request's prompt pages were adopted when its prefill arrived."""

    def reset(self) -> None:
        pages = getattr(self, "pages", {})  # empty when the base class's __init__ resets
        assert all(p.ref == 0 for p in pages.values()), "reset while requests hold cached pages"
        if pages:
            self.compressed_pool.free(torch.tensor([p.chunk for p in pages.values()], dtype=torch.int64))
        self.pages = {}
        super().reset()
