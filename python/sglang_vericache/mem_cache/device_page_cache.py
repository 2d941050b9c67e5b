"""DevicePageCache: the accelerator's copy of a host-tier exact pool, page by page (--exact-kv-pool host).

With --exact-kv-pool host, the exact pool (ModelRunner.token_to_kv_pool: every committed position of
every request, the host tier; page-locked on CUDA) lives in host memory, and a forward reads and writes
exact KV only here: `num_pages` accelerator pages, each holding one host page's K / V in every layer.
The stager, folding, the KV store and the radix cache keep working on the host pool and host slots.

Per forward (ModelRunner.forward):
  view(fb)     the host pages the forward reads or writes (`touched`) are made resident (missing ones
               copied in from the host pool), the batch's rows of req_to_token and its exact
               out_cache_loc are translated to cache slots (host page p -> cache page map[p], same
               offset), and the forward runs over the cache;
  write_back   copies the rows the forward wrote (its exact out_cache_loc) back to the host pool, so
               the host pool holds every committed position (write-through: demoting a request costs
               nothing) before anything reads it there.
What a forward touches: a row whose context is read from the pool, all pages of its context; a draft
row, its exact tail; a staged row (its committed prefix streams through the stager), only its new
tokens' pages. Resident requests (ExactPlacement) read every page at each verify or decode, so they
stay cached; of host-tier requests the cache holds their tail pages.

Invariants: a cache page holds the one host page p with map[p] = c, or is free; cache page 0 is
host page 0 (the padding page), always; a mapped page's committed rows equal the host pool's; pages a
forward touches are not dropped during it; a host page freed by the allocator (`invalidate`) is
unmapped, so one reallocated and then written in the host pool (a KV-store load) is copied in again.
When a forward needs room, the least recently touched pages it does not touch are dropped (no copy:
the host pool has them).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool

if TYPE_CHECKING:
    from sglang_vericache.model_executor.forward_batch import ForwardBatch

def pages_one_forward_touches(chunked_prefill_size: int, max_running_requests: int, page_size: int) -> int:
    """The most pages one forward touches besides resident requests' contexts: a prefill chunk and every
    running request's tail and new pages, and the padding page."""
    return -(-chunked_prefill_size // page_size) + 2 * max_running_requests + 1


@dataclass
class CachedView:
    """One forward over the cache: what it reads as ForwardBatch.req_to_token_pool (the batch's rows
    translated), its out_cache_loc in cache slots, and which of its tokens write exact slots."""

    req_to_token: torch.Tensor
    out_cache_loc: torch.Tensor
    exact_tokens: torch.Tensor


class DevicePageCache:
    def __init__(self, host_pool: MHATokenToKVPool, num_pages: int, page_size: int, max_reqs: int,
                 max_context_len: int, device: str):
        if num_pages < 1:
            raise ValueError(f"the exact KV cache needs at least one page, got {num_pages}")
        self.host = host_pool
        self.page_size = page_size
        self.num_pages = num_pages  # usable pages 1..num_pages (0: the padding page)
        self.pool = MHATokenToKVPool((num_pages + 1) * page_size, host_pool.num_layers, host_pool.num_kv_heads,
                                     host_pool.head_dim, host_pool.dtype, device, host_pool.v_head_dim)
        host_pages = host_pool.num_slots // page_size
        self.map = torch.zeros(host_pages, dtype=torch.int64)  # host page -> cache page (0: not cached)
        self.lru: OrderedDict[int, None] = OrderedDict()  # cached host pages, least recently touched first
        self.free = list(range(num_pages, 0, -1))
        self.table = torch.zeros((max_reqs, max_context_len), dtype=torch.int64, device=device)
        self.stats = {"pages_in": 0, "pages_dropped": 0, "rows_written_back": 0}

    # ---- per forward ------------------------------------------------------------------------
    def view(self, fb: ForwardBatch, req_to_token: torch.Tensor) -> CachedView:
        """Makes the pages fb touches resident and translates its tables. fb's own tensors are not changed."""
        ps, dev = self.page_size, self.table.device
        rows, extents, exact_tokens = touched(fb)
        spans = []
        if rows:  # the rows' slots, gathered where the table is and brought over once
            hi = max(h for _, h in extents)
            sub = req_to_token[torch.tensor(rows, device=req_to_token.device), :hi].cpu()
            spans = [sub[i, lo:h] for i, (lo, h) in enumerate(extents)]
        loc = fb.out_cache_loc.cpu()
        exact_loc = loc[exact_tokens]
        pages = torch.cat([s // ps for s in spans] + [exact_loc // ps]).unique()
        self._make_resident(pages[pages > 0])
        if spans:
            moved = self._translate(torch.cat(spans)).to(dev).split([len(s) for s in spans])
            for r, (lo, h), t in zip(rows, extents, moved):
                self.table[r, lo:h] = t
        out = loc.clone()
        out[exact_tokens] = self._translate(exact_loc)
        return CachedView(self.table, out.to(dev), exact_tokens)

    def write_back(self, view: CachedView, host_loc: torch.Tensor) -> None:
        """Copies the exact rows the forward over `view` wrote to the host pool (host slots host_loc:
        fb's out_cache_loc before the view), every layer."""
        tokens = view.exact_tokens
        if len(tokens) == 0:
            return
        host_slots = host_loc.cpu()[tokens]
        copy_rows(self.pool, view.out_cache_loc[tokens.to(view.out_cache_loc.device)], self.host, host_slots)
        self.stats["rows_written_back"] += len(host_slots)

    def invalidate(self, host_pages: list[int] | None) -> None:
        """Host pages the allocator freed (None: all of them): their cache copies are dropped."""
        for p in list(self.lru) if host_pages is None else host_pages:
            c = int(self.map[p])
            if c:
                self._drop(p, c)

    # ---- internals -----------------------------------------------------------------------------
    def _translate(self, slots: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return self.map[slots // ps] * ps + slots % ps

    def _make_resident(self, pages: torch.Tensor) -> None:
        cached = self.map[pages] > 0
        missing = pages[~cached].tolist()
        for p in pages[cached].tolist():
            self.lru.move_to_end(p)
        if len(missing) > len(self.free):
            keep = set(pages.tolist())
            victims = [p for p in self.lru if p not in keep][: len(missing) - len(self.free)]
            for p in victims:
                self._drop(p, int(self.map[p]))
                self.stats["pages_dropped"] += 1
        if len(missing) > len(self.free):
            raise RuntimeError(
                f"a forward touches {len(pages)} exact KV pages, the accelerator's exact KV cache holds "
                f"{self.num_pages}: raise --exact-kv-cache-tokens")
        if not missing:
            return
        cache_pages = [self.free.pop() for _ in missing]
        for p, c in zip(missing, cache_pages):
            self.map[p] = c
            self.lru[p] = None
        ps, ar = self.page_size, torch.arange(self.page_size)
        host_slots = (torch.tensor(missing)[:, None] * ps + ar).flatten()
        cache_slots = (torch.tensor(cache_pages)[:, None] * ps + ar).flatten().to(self.table.device)
        copy_rows(self.host, host_slots, self.pool, cache_slots)
        self.stats["pages_in"] += len(missing)

    def _drop(self, host_page: int, cache_page: int) -> None:
        self.map[host_page] = 0
        self.lru.pop(host_page, None)
        self.free.append(cache_page)


def copy_rows(src: MHATokenToKVPool, src_slots: torch.Tensor, dst: MHATokenToKVPool, dst_slots: torch.Tensor) -> None:
    """dst's rows dst_slots = src's rows src_slots, K and V of every layer (slots on their pool's device).
    Copies onto an accelerator are queued (non_blocking); copies to the host complete before it returns."""
    for layer in range(src.num_layers):
        for s, d in ((src.k_buffer[layer], dst.k_buffer[layer]), (src.v_buffer[layer], dst.v_buffer[layer])):
            d.index_copy_(0, dst_slots, s.index_select(0, src_slots).to(d.device, non_blocking=d.device.type != "cpu"))


def touched(fb: ForwardBatch) -> tuple[list[int], list[tuple[int, int]], torch.Tensor]:
    """What a forward reads and writes of the exact pool -> (req_to_token rows, per row the positions
    [lo, hi) it reads there, the token indices of fb whose out_cache_loc are exact-pool slots).

    Row kinds in batch order (forward_batch.py): draft rows (DRAFT_DECODE, the first num_draft of MIXED)
    read their exact tail and write an exact slot only when the tail holds the new token
    (new_kv == "exact"); resident rows read their whole context; staged rows (fb.staged; in MIXED the
    rows after the resident ones) read none of it (their prefix streams) and write their new tokens."""
    bs, nd = fb.batch_size, fb.num_draft
    rows = fb.req_pool_indices.tolist()
    seq = fb.seq_lens_cpu or fb.seq_lens.tolist()
    ext = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
    if fb.forward_mode.is_mixed():
        n_staged = bs - nd - fb.num_resident
    else:
        n_staged = bs if fb.staged is not None else 0
    out_rows, extents, exact = [], [], []
    ctx = fb.draft_ctx
    starts = ctx.tail_starts() if ctx is not None else []
    token = 0
    for i in range(bs):
        n = 1 if i < nd else ext[i]
        if i < nd:
            lo = starts[i]
            out_rows.append(rows[i])
            extents.append((lo, lo + ctx.tail_lens[i]))
            if ctx.new_kv == "exact":
                exact.append(token)
        elif i < bs - n_staged:
            out_rows.append(rows[i])
            extents.append((0, seq[i]))
            exact.extend(range(token, token + n))
        else:
            exact.extend(range(token, token + n))
        token += n
    return out_rows, extents, torch.tensor(exact, dtype=torch.int64)
