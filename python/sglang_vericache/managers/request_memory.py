"""RequestMemory: a running request's exact slots, and what the scheduler does under memory pressure.

Extending and truncating a request's slots, making room for the running requests' next tokens
(evict cached prefixes, then retract the newest: a prefill in progress first), retracting (its KV goes to the prefix cache,
evictable, and it waits first in line), and freeing a finished one. The KV invariant it keeps is
Req's: slots req_to_token[req_pool_idx, :kv_allocated_len], whole pages owned past the prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_vericache.managers.request_queues import RequestQueues
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.stats import SchedulerMetrics
    from sglang_vericache.mem_cache.two_tier import TwoTierKV


class RequestMemory:
    def __init__(self, req_to_token_pool, allocator, tree_cache, page_size: int, two_tier: TwoTierKV | None,
                 queues: RequestQueues, metrics: SchedulerMetrics):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.two_tier = two_tier
        self.queues = queues  # it retracts (the newest running request first, or the prefill in progress)
        self.running = queues.running  # read only: changed through queues
        self.metrics = metrics
        # Called when a request leaves (finished, aborted or retracted): the staggered schedule
        # gives back its booking.
        self.on_leave: Callable[[Req], None] | None = None
        # Called after a retraction: admission (PrefillAdder.on_retract) stops being optimistic.
        self.on_retract: Callable[[], None] | None = None

    def alloc_slots(self, req: Req, num_new: int) -> torch.Tensor | None:
        """Extends `req`'s slots by num_new positions, evicting cached prefixes if needed."""
        need_pages = self.allocator.pages_needed(req.kv_allocated_len, num_new)
        short = need_pages * self.page_size - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        last_slot = 0
        if req.kv_allocated_len > 0:
            last_slot = int(self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_allocated_len - 1])
        slots = self.allocator.alloc_extend(last_slot, req.kv_allocated_len, num_new)
        if slots is None:
            return None
        self.req_to_token_pool.write(req.req_pool_idx, req.kv_allocated_len, slots)
        req.kv_allocated_len += num_new
        return slots

    def truncate_slots(self, req: Req, new_len: int) -> None:
        """Gives back the whole pages past position new_len-1 (rejected drafts' slots)."""
        ps = self.page_size
        keep = -(-new_len // ps) * ps
        if req.kv_allocated_len > keep:
            self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, keep : req.kv_allocated_len])
        req.kv_allocated_len = new_len

    def make_room(self, new_tokens: Callable[[Req], int]) -> None:
        """Ensures every running request can grow by new_tokens(req) exact slots (and, in two-tier
        modes, fold the pages that fill), evicting cached prefixes, then retracting the newest."""
        while True:
            need = sum(self.allocator.pages_needed(r.kv_allocated_len, new_tokens(r)) for r in self.running)
            free = self.allocator.available_size() // self.page_size
            if need > free:
                self.tree_cache.evict((need - free) * self.page_size)
                free = self.allocator.available_size() // self.page_size
            ok = need <= free
            if ok and self.two_tier is not None:
                ok = self.two_tier.reserve_fold_chunks(self.running, new_tokens)
            if ok:
                return
            chunked = self.queues.take_chunked()  # the newest request: retracted before any running one
            if chunked is not None:  # a partial prefill holds pages a running request needs to grow
                self.retract(chunked)
                continue
            if len(self.running) == 1:
                return
            self.retract(self.queues.pop_newest())

    def retract(self, req: Req) -> None:
        """Gives back a running request's KV (into the prefix cache, evictable) and requeues it first."""
        if self.on_leave is not None:
            self.on_leave(req)
        self.tree_cache.cache_finished_req(req)
        req.reset_for_retract()
        self.queues.requeue_first(req)
        self.metrics.num_retracted_total += 1
        if self.on_retract is not None:
            self.on_retract()

    def free(self, req: Req) -> None:
        """A request that is done: its KV goes to the radix tree, the rest back to the pools."""
        if self.on_leave is not None:
            self.on_leave(req)
        if req.req_pool_idx is not None:
            self.tree_cache.cache_finished_req(req)
