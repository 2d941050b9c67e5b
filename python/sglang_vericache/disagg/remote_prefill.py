"""RemotePrefill: admission on a drafter whose prompts the verifier prefills (--disagg-prefill verifier).

Remote prefix caching (the paper's second scenario): this instance reaches the KV store over a slow
link, the verifier over a fast one. So the drafter moves only compressed pages and never a prompt's
exact KV:

    prefetch  for the first PREFETCH_AHEAD waiting requests, a thread fetches the compressed pages
              of their prompts that are neither cached nor being fetched (the store's slow link
              moves them while this instance drafts); fetched pages go into the cache as they land.
    admit     the request at the head of the queue, once its fetch is in: its cached compressed
              prefix, a req_to_token row whose exact slots start at that prefix's end, and
              OpenSession(kv_from = prefix tokens). Runs instead of prefill.
    on result the verifier loaded the exact prefix from its own store, prefilled the rest and sent
              the first token and the exact KV of prompt positions [kv_from, prompt_len): that KV
              goes into this request's slots, its whole pages fold into the compressed tier and are
              adopted by the cache (and written through to the store), the token is emitted as a
              prefill's first token, and the request starts drafting.

Per request (Req.remote_prefill, a RemotePrefillState): exact_from = kv_from (exact slots exist
from here on; positions before it have none, and nothing reads them: drafting reads compressed
pages and the exact tail past them, and verification is remote); held_keys = the cache pages it
holds locked (comp_indices[:len]); its page keys and prefetch.
The drafter's messages and the first token are exactly what local prefill would give: the verifier
samples it as full mode does, and the KV it sends is the exact KV.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from sglang_vericache.disagg.messages import PrefillResult
from sglang_vericache.mem_cache.prefix_store import model_identity
from sglang_vericache.mem_cache.storage.hash_chain import StoreNamespace, page_keys

if TYPE_CHECKING:

    from sglang_vericache.disagg.remote_verify import RemoteVerifyWorker
    from sglang_vericache.managers.output_sink import OutputSink
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.request_queues import RequestQueues
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.stats import SchedulerMetrics
    from sglang_vericache.mem_cache.compressed_prefix_cache import CompressedPrefixCache
    from sglang_vericache.mem_cache.prefix_store import PrefixStore
    from sglang_vericache.mem_cache.two_tier import TwoTierKV
    from sglang_vericache.server_args import ServerArgs

logger = logging.getLogger(__name__)

WAIT_MS = 20  # longest wait for a prefill result (or a prefetch) when nothing else can run
PREFETCH_AHEAD = 4  # waiting requests whose pages are fetched ahead of their admission


@dataclass
class RemotePrefillState:
    """Req.remote_prefill: a request's way through RemotePrefill (and CompressedPrefixCache)."""

    page_keys: list[str] | None = None  # hash-chain keys of the prompt's whole pages before its last token
    fetch_started: bool = False  # prefetch looked at it (fetch None: nothing it lacks was fetched for it)
    fetch: Future | None = None
    exact_from: int | None = None  # admitted: its exact slots start here (= kv_from)
    held_keys: list[str] = field(default_factory=list)  # cache pages it holds locked
    sent_at: float | None = None  # when its OpenSession went out


def prefill_state(req: Req) -> RemotePrefillState:
    if req.remote_prefill is None:
        req.remote_prefill = RemotePrefillState()
    return req.remote_prefill


class RemotePrefill:
    """Built by the scheduler after the remote drafter's worker (which carries the OpenSession and
    PrefillResult messages): admits off waiting_queue into running through memory, fills exact
    slots (req_to_token_pool, kv_pool) with the KV the verifier sends, folds it (two_tier) into
    tree_cache, and emits through output. recv_socket: the scheduler's input, polled while idle."""

    def __init__(self, args: ServerArgs, queues: RequestQueues, req_to_token_pool,
                 allocator, kv_pool, tree_cache: CompressedPrefixCache, two_tier: TwoTierKV,
                 memory: RequestMemory, output: OutputSink, metrics: SchedulerMetrics,
                 worker: RemoteVerifyWorker, prefix_store: PrefixStore | None = None, recv_socket=None):
        self.args = args
        self.queues = queues  # admission takes requests off queues.waiting into queues.running
        self.waiting_queue = queues.waiting
        self.running = queues.running
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.kv_pool = kv_pool
        self.cache = tree_cache
        self.two_tier = two_tier
        self.memory = memory
        self.output = output
        self.metrics = metrics
        self.worker = worker
        self.prefix_store = store = prefix_store
        self.recv_socket = recv_socket
        self.P = args.page_size
        if store is not None and store.comp is not None:
            self.namespace = store.comp.namespace
        else:
            dtype = str(kv_pool.dtype).removeprefix("torch.")
            self.namespace = StoreNamespace(model_identity(args.model_path), "compressed", self.P, dtype,
                                            args.kv_compressor, args.kv_compression_ratio)
        self.prefilling: dict[str, Req] = {}
        self.arrived: list[PrefillResult] = []
        # Prefetch: one thread moves store pages over the slow link while this one drafts.
        has_store = store is not None and store.comp is not None
        self.fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-prefetch") if has_store else None
        self.fetches: list[tuple[Future, list[str], int, Req]] = []  # (future, req's keys, first fetched, req)
        self.fetching_keys: set[str] = set()
        self.stats = {"prefills_requested": 0, "prefills_applied": 0, "prefix_pages": 0,
                      "store_pages_loaded": 0, "kv_bytes_received": 0}

    # ------------------------------------------------------------------ the scheduler's step

    def step(self) -> None:
        """Applies the prefills that arrived, drops cancelled ones, admits waiting requests."""
        self.arrived += [r for r in self.worker.take_prefill_results() if r.rid in self.prefilling]
        now = time.perf_counter()
        ready = [r for r in self.arrived if r.meta.get("ready_at", 0.0) <= now]  # --disagg-bandwidth
        self.arrived = [r for r in self.arrived if r.meta.get("ready_at", 0.0) > now]
        for res in ready:
            self.apply(res)
        for rid, req in list(self.prefilling.items()):
            if req.to_abort or rid not in self.worker.sessions:  # aborted, or failed by the worker
                self.drop(req, req.to_abort or "the verifier session ended")
        self.admit()

    def wait(self) -> None:
        """Nothing is running: sleep until the verifier (or a new request) speaks, or a fetch lands."""
        if not self.prefilling:
            if self.fetches:
                wait_futures([f for f, *_ in self.fetches], timeout=WAIT_MS / 1000, return_when=FIRST_COMPLETED)
            return
        poller = zmq.Poller()
        poller.register(self.worker.link.sock, zmq.POLLIN)
        if self.recv_socket is not None:
            poller.register(self.recv_socket, zmq.POLLIN)
        poller.poll(WAIT_MS)

    def drop(self, req: Req, message: str) -> None:
        self.prefilling.pop(req.rid, None)
        if req.finished:
            return
        req.finished_reason = {"type": "abort", "message": message}
        self.output.release(req)

    # ------------------------------------------------------------------ admission

    def admit(self) -> None:
        P = self.P
        self.prefetch()
        while self.waiting_queue:
            if len(self.running) + len(self.prefilling) >= self.args.max_running_requests:
                return
            req = self.waiting_queue[0]
            if not self.worker.link.up:
                self.queues.take_waiting()
                link = self.worker.link
                self.fail_waiting(req, link.refused or f"verifier at {link.addr} is not reachable")
                continue
            if self.fetch_pending(req):
                return  # its pages are on the way; running requests draft meanwhile
            n_prompt = len(req.origin_input_ids)
            keys = self.keys(req)
            ids = self.cache.match(keys)
            held = keys[: len(ids)]
            self.cache.lock(held)
            if not self.reserve(req, len(ids)):
                self.cache.unlock(held)
                if not self.running and not self.prefilling:
                    self.queues.take_waiting()
                    self.fail_waiting(req, "the prompt does not fit in this drafter's KV pools")
                    continue
                return
            prefix = len(ids) * P
            req.req_pool_idx = self.req_to_token_pool.alloc()
            req.comp_indices, req.comp_prefix_len = ids, prefix
            req.kv_committed_len = req.kv_allocated_len = prefix
            st = prefill_state(req)
            st.exact_from, st.held_keys = prefix, held
            if self.memory.alloc_slots(req, n_prompt - prefix) is None:  # reserve() checked the room
                raise RuntimeError("exact slots vanished between reserve and alloc")
            req.cached_tokens = prefix
            req.meta["compressed_prefix_tokens"] = prefix
            self.stats["prefix_pages"] += len(ids)
            self.queues.take_waiting()
            if not self.worker.send_open(req, kv_from=prefix):
                self.drop(req, f"verifier at {self.worker.link.addr} is not reachable")
                continue
            self.prefilling[req.rid] = req
            st.sent_at = time.perf_counter()
            self.stats["prefills_requested"] += 1

    def fail_waiting(self, req: Req, message: str) -> None:
        req.finished_reason = {"type": "abort", "message": message}
        self.output.emit(req)

    def reserve(self, req: Req, n_prefix_pages: int) -> bool:
        """Room for req's prompt past its compressed prefix (exact slots; chunks for its whole pages)
        and for every running or prefilling request's next round, evicting unlocked cached pages."""
        P = self.P
        n_prompt = len(req.origin_input_ids)
        rest = n_prompt - n_prefix_pages * P
        round_tokens = self.args.max_draft_tokens + 1
        others = list(self.running) + list(self.prefilling.values())
        pages = self.allocator.pages_needed(n_prefix_pages * P, rest + round_tokens)
        pages += sum(self.allocator.pages_needed(r.kv_allocated_len, round_tokens) for r in others)
        if pages * P > self.allocator.available_size() + self.cache.evictable_size():
            return False
        chunks = n_prompt // P - n_prefix_pages + (len(others) + 1) * (1 + (round_tokens + P - 1) // P)
        short = chunks - self.two_tier.pool.available_chunks()
        if short > 0:
            self.cache.evict_compressed(short)
        return chunks <= self.two_tier.pool.available_chunks()

    # ------------------------------------------------------------------ prefetch

    def keys(self, req: Req) -> list[str]:
        """Hash-chain keys of the prompt's whole pages before its last token."""
        st = prefill_state(req)
        if st.page_keys is None:
            n = (len(req.origin_input_ids) - 1) // self.P * self.P
            st.page_keys = page_keys(req.origin_input_ids[:n], self.namespace)
        return st.page_keys

    def prefetch(self) -> None:
        """Collects landed fetches, then starts one for each of the first waiting requests whose
        prompt misses pages that no fetch is bringing (each request fetches at most once)."""
        self.collect()
        if self.fetcher is None:
            return
        for req in list(self.waiting_queue)[:PREFETCH_AHEAD]:
            st = prefill_state(req)
            if st.fetch_started:
                continue
            keys = self.keys(req)
            start = len(self.cache.match(keys))
            if start == len(keys):
                st.fetch_started = True  # all cached: nothing to fetch
            elif keys[start] not in self.fetching_keys:  # else: wait for the fetch that brings it
                missing = keys[start:]
                future = self.fetcher.submit(self.prefix_store.fetch_compressed, missing)
                self.fetches.append((future, keys, start, req))
                self.fetching_keys.update(missing)
                st.fetch_started, st.fetch = True, future

    def fetch_pending(self, req: Req) -> bool:
        """True while req's fetch, or one bringing a page it misses, is in flight."""
        if self.fetcher is None:
            return False
        self.prefetch()  # req is at the head of the queue: started now if it was waiting on another
        st = prefill_state(req)
        if not st.fetch_started:
            return True  # a fetch started for another request brings its first missing page
        mine = st.fetch
        return mine is not None and any(f is mine for f, *_ in self.fetches)  # not collected yet

    def collect(self) -> None:
        """Landed fetches -> chunks in the cache (under the keys they were fetched for)."""
        still = []
        for future, keys, start, req in self.fetches:
            if not future.done():
                still.append((future, keys, start, req))
                continue
            self.fetching_keys.difference_update(keys[start:])
            try:
                payloads, nbytes, seconds = future.result()
            except Exception:  # a DegradingStore never raises; anything else must not stop serving
                logger.exception("prefetching compressed pages failed; the verifier will send that KV")
                continue
            cached = len(self.cache.match(keys))
            if cached < start:  # the prefix it continues was evicted meanwhile: no place for them
                continue
            payloads = payloads[cached - start :]
            ids = self.prefix_store.install_compressed(payloads, nbytes, seconds)
            taken = self.cache.insert(keys, ids, cached)
            self.two_tier.pool.free(ids[taken:])
            self.stats["store_pages_loaded"] += taken
        self.fetches = still

    # ------------------------------------------------------------------ results

    def apply(self, res: PrefillResult) -> None:
        req = self.prefilling.pop(res.rid, None)
        if req is None or req.to_abort:
            if req is not None:
                self.drop(req, req.to_abort)
            return
        self.stats["prefills_applied"] += 1
        n_prompt = len(req.origin_input_ids)
        if res.k is not None:
            kv = self.kv_pool
            slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, req.kv_committed_len : n_prompt]
            for layer in range(kv.num_layers):
                kv.set_kv_buffer(layer, slots, res.k[layer], res.v[layer])
            self.stats["kv_bytes_received"] += res.k.numel() * res.k.element_size() * 2
            req.kv_committed_len = n_prompt
            if not self.two_tier.fold(req):
                self.drop(req, "the drafter's compressed tier is full")
                return
            self.adopt(req)
            if self.prefix_store is not None:
                self.prefix_store.write_through(req)
        st = req.remote_prefill
        req.meta["remote_prefill_s"] = round(time.perf_counter() - st.sent_at, 6)
        if req.return_logprob:
            req.input_token_logprobs = list(res.input_token_logprobs or [])
            req.input_top_logprobs = list(res.input_top_logprobs or [])
        req.input_logprobs_done = True
        self.metrics.num_prompt_tokens_total += n_prompt - st.exact_from
        if res.token < 0:  # max_new_tokens == 0
            req.finished_reason = {"type": "length", "length": 0}
            self.output.release(req)
            return
        top = res.top_logprobs or []
        tops = ([[v for v, _ in top]], [[i for _, i in top]])
        self.output.append_tokens(req, [res.token], [res.logprob], tops, 0)
        if not req.finished:
            self.queues.start_running(req)
        self.output.finish_round([req])

    def adopt(self, req: Req) -> None:
        """Gives the prompt's newly folded whole pages to the cache (req keeps them locked)."""
        P, st = self.P, req.remote_prefill
        keys = st.held_keys
        n = len(keys)
        n_pages = min(len(req.comp_indices), (len(req.origin_input_ids) - 1) // P)
        if n_pages <= n:
            return
        all_keys = page_keys(req.origin_input_ids[: n_pages * P], self.namespace)
        taken = self.cache.insert(all_keys, req.comp_indices[n:n_pages], n)
        self.cache.lock(all_keys[n : n + taken])
        st.held_keys = all_keys[: n + taken]
