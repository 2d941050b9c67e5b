"""PrefillAdder: which waiting requests join the next prefill batch, and how much of each.

Admission keeps room for the running requests' next tokens: each reserves
min(remaining new tokens, CLIP) * new_token_ratio slots. The ratio starts optimistic, decays
while decoding goes well, and jumps to 1 after a retraction (as SGLang's does).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.request_queues import RequestQueues
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.stats import SchedulerMetrics
    from sglang_vericache.mem_cache.prefix_store import PrefixStore
    from sglang_vericache.mem_cache.two_tier import TwoTierKV
    from sglang_vericache.server_args import ServerArgs

RESERVE_CLIP = 256
# --schedule-policy lpm sorts at most this many waiting requests (each sort matches every one
# against the tree); a longer queue is taken first come, first served, as in SGLang.
LPM_MAX_QUEUE = 128
# lpm, within one prefill batch: of the requests whose first IN_BATCH_PREFIX tokens are alike and
# not cached, only the first is admitted; the others wait a step and find its prefix cached.
IN_BATCH_PREFIX = 32
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class PrefillAdder:
    """Admission: takes requests off waiting_queue into a prefill batch (build), placing each
    matched prefix and allocating its slots through memory. admission_gate (adaptive VeriCache) may
    refuse a request that memory would take."""

    def __init__(self, args: ServerArgs, queues: RequestQueues, req_to_token_pool,
                 allocator, tree_cache, memory: RequestMemory, metrics: SchedulerMetrics,
                 two_tier: TwoTierKV | None = None, prefix_store: PrefixStore | None = None,
                 admission_gate: Callable[[Req, list[Req]], bool] | None = None):
        self.args = args
        self.queues = queues  # admission takes requests off queues.waiting (read only here otherwise)
        self.waiting_queue = queues.waiting
        self.running = queues.running
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.memory = memory
        self.metrics = metrics
        self.two_tier = two_tier
        self.prefix_store = prefix_store
        self.admission_gate = admission_gate
        self.page_size = args.page_size
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.skip_next = False

    def on_retract(self) -> None:
        self.new_token_ratio = 1.0

    def back_off(self) -> None:
        """A prefill had to be undone for lack of memory: let the running requests decode once
        before admitting again, so admission can never starve decoding."""
        self.on_retract()
        self.skip_next = True

    def reserve_for(self, req: Req) -> int:
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return int(min(max(left, 0), RESERVE_CLIP) * self.new_token_ratio)

    def build(self, chunked_req: Req | None) -> list[tuple[Req, int]]:
        """The next prefill batch: chunked_req's next chunk (the prefill in progress) first, then
        waiting requests while the token budget, memory and --max-running-requests allow."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if not self.waiting_queue and chunked_req is None:
            return []
        if self.skip_next and self.running:
            self.skip_next = False
            return []
        lpm = self.args.schedule_policy == "lpm"
        if lpm:
            self.sort_longest_prefix_first()
        avail = self.allocator.available_size() + self.tree_cache.evictable_size()
        avail -= sum(self.reserve_for(r) for r in self.running)
        budget = self.args.max_prefill_tokens
        batch: list[tuple[Req, int]] = []
        partial = False

        if chunked_req is not None:
            req = chunked_req
            n = self.chunk_len(req, budget, avail)
            if n <= 0 or self.memory.alloc_slots(req, n) is None:
                return []
            batch.append((req, n))
            budget -= n
            avail -= n
            partial = req.kv_committed_len + n < req.prefill_target_len()

        heads = set()  # lpm: first tokens of the uncached prompts this batch prefills
        if lpm and chunked_req is not None:
            heads.add(tuple(chunked_req.fill_ids[:IN_BATCH_PREFIX]))
        i = 0  # the waiting request considered next; lpm may pass over some
        while i < len(self.waiting_queue) and not partial and budget > 0:
            if len(self.running) + len(batch) >= self.args.max_running_requests:
                break
            req = self.waiting_queue[i]
            if self.prefix_store is not None:
                # KV store: extend the tree's match with stored pages (inserted into the tree, so
                # the match below finds them and they count as a locked prefix like any other).
                self.prefix_store.lookup_into(req, room=avail - self.reserve_for(req))
            key = req.fill_ids[: req.max_prefix_len()]
            match = self.tree_cache.match_prefix(key, record_stats=False)
            if self.two_tier is not None:
                match = self.two_tier.usable_match(match)
            prefix_len = len(match.device_indices)
            head = tuple(req.fill_ids[:IN_BATCH_PREFIX])
            if lpm and prefix_len < IN_BATCH_PREFIX and len(head) == IN_BATCH_PREFIX:
                if head in heads:
                    i += 1
                    continue
                heads.add(head)
            remaining = req.prefill_target_len() - prefix_len
            # The matched prefix gets locked: it stops being evictable (counted conservatively).
            n = self.chunk_len(req, budget, avail - prefix_len - self.reserve_for(req), remaining)
            if n <= 0:
                break
            if self.admission_gate is not None and not self.admission_gate(req, [r for r, _ in batch]):
                break  # adaptive VeriCache: req would not add throughput now (may mark it decode_only)
            if self.two_tier is not None and not self.two_tier.can_admit(req, match, n, batch, self.running,
                                                                         chunked_req):
                break
            if not self.admit(req, match, n):
                break
            self.tree_cache.num_queried_tokens += len(key)
            self.tree_cache.num_matched_tokens += prefix_len
            if self.two_tier is not None:
                self.tree_cache.num_comp_matched_tokens += match.comp_len
            self.queues.take_waiting(i)
            batch.append((req, n))
            budget -= n
            avail -= n + self.reserve_for(req)
            partial = n < remaining
        return batch

    def sort_longest_prefix_first(self) -> None:
        """--schedule-policy lpm: the waiting requests with the longest cached prefix go first
        (stable: equal matches keep their arrival order)."""
        if not 1 < len(self.waiting_queue) <= LPM_MAX_QUEUE:
            return

        def cached_len(req: Req) -> int:
            match = self.tree_cache.match_prefix(req.fill_ids[: req.max_prefix_len()], record_stats=False)
            return len(match.device_indices)

        self.queues.reorder_waiting(sorted(self.waiting_queue, key=cached_len, reverse=True))

    def chunk_len(self, req: Req, budget: int, avail: int, remaining: int | None = None) -> int:
        """Tokens of req to prefill now: whole request if it fits, else a page-aligned chunk."""
        if remaining is None:
            remaining = req.prefill_target_len() - req.kv_committed_len
        n = min(remaining, self.args.chunked_prefill_size, budget, max(avail, 0))
        if n < remaining:
            n -= n % self.page_size
            # A running batch with room for nothing but a sliver waits for memory instead.
            if n < self.page_size:
                return 0
        return n

    def admit(self, req: Req, match, n: int) -> bool:
        idx = self.req_to_token_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        req.prefix_indices = match.device_indices
        req.last_node = match.last_node
        self.tree_cache.inc_lock_ref(req.last_node)
        if self.two_tier is not None:
            self.tree_cache.inc_comp_lock_ref(req.last_node)
            req.comp_indices = match.comp_indices
            req.comp_prefix_len = match.comp_len
            req.comp_layer_chunks = None
        prefix_len = len(match.device_indices)
        self.req_to_token_pool.write(idx, 0, match.device_indices)
        req.kv_committed_len = req.kv_allocated_len = prefix_len
        # A hit whose compressed copy is shorter: rebuild the missing chunks from exact KV.
        ok = self.two_tier is None or self.two_tier.fold(req, prefilling=True)
        if ok and self.memory.alloc_slots(req, n) is not None:
            if req.num_retractions == 0:
                req.cached_tokens = prefix_len
                self.metrics.num_cached_tokens_total += prefix_len
            return True
        self.tree_cache.dec_lock_ref(req.last_node)
        if self.two_tier is not None:
            self.tree_cache.dec_comp_lock_ref(req.last_node)
            self.two_tier.pool.free(req.comp_indices[len(match.comp_indices) :])
        self.req_to_token_pool.free(idx)
        req.reset_for_retract()
        req.num_retractions -= 1
        return False
