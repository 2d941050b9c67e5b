"""Scheduler: the process that owns the model, the KV pools and the radix cache.

Each loop iteration: take new requests, then run either one prefill batch (new requests and
the next chunk of a chunked prefill) or one decode step for every running request, then send
what each request emitted. Memory pressure is met by queueing (admission control), prefix-cache
eviction, and finally retraction of running requests, never by failing a request.
The forward passes themselves are in scheduler_forward.py, sampling in
scheduler_output_processor.py, /start_profile in scheduler_profiler.py. The collaborators the
decode paths are handed (RequestMemory, OutputSink, VeriCacheRound and its driver) are built in
one place, build_decoding.
"""

from __future__ import annotations

import logging
from collections import deque

import zmq

from sglang_vericache.constrained.grammar_backend import grammar_key
from sglang_vericache.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetStatsReq,
    ProfileReq,
    ReqOutput,
    SchedulerError,
    SchedulerReady,
    TokenizedGenerateReqInput,
)
from sglang_vericache.managers.output_sink import OutputSink, RecordingSink
from sglang_vericache.managers.request_memory import RequestMemory
from sglang_vericache.managers.schedule_batch import Req
from sglang_vericache.managers.schedule_policy import PrefillAdder
from sglang_vericache.managers.scheduler_forward import SchedulerForwardMixin
from sglang_vericache.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from sglang_vericache.managers.scheduler_profiler import SchedulerProfiler
from sglang_vericache.managers.stats import SchedulerMetrics
from sglang_vericache.managers.watchdog import StepWatchdog
from sglang_vericache.mem_cache.radix_cache import RadixCache
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.sampling.sampling_params import InvalidRequest
from sglang_vericache.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


class Scheduler(SchedulerForwardMixin, SchedulerOutputProcessorMixin):
    def __init__(self, server_args: ServerArgs, port_args: PortArgs | None = None):
        self.server_args = server_args
        self.model_runner = ModelRunner(server_args)
        mc = self.model_runner.model_config
        self.vocab_size = mc.vocab_size
        self.context_len = mc.context_len
        self.page_size = server_args.page_size
        self.req_to_token_pool = self.model_runner.req_to_token_pool
        self.allocator = self.model_runner.token_to_kv_pool_allocator
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.mode = server_args.kv_mode
        self.two_tier = None
        if self.mode == "full":
            self.tree_cache = RadixCache(
                self.req_to_token_pool, self.allocator, self.page_size, disable=server_args.disable_radix_cache
            )
        else:
            from sglang_vericache.mem_cache.two_tier_radix_cache import TwoTierRadixCache
            from sglang_vericache.mem_cache.two_tier import TwoTierKV

            self.two_tier = TwoTierKV(self)
            if server_args.disagg_prefill == "verifier":  # remote prefix caching: compressed pages alone
                from sglang_vericache.mem_cache.compressed_prefix_cache import CompressedPrefixCache as TreeCls
            else:
                TreeCls = TwoTierRadixCache
            self.tree_cache = TreeCls(
                self.req_to_token_pool, self.allocator, self.two_tier.pool, self.page_size,
                disable=server_args.disable_radix_cache,
            )
        # KV store (--kv-store, issue 8): prefix pages shared across instances; see prefix_store.py.
        self.prefix_store = None
        if server_args.kv_store != "none":
            from sglang_vericache.mem_cache.prefix_store import PrefixStore

            self.prefix_store = PrefixStore(self)
        self.link = None
        if server_args.uses_link:
            from sglang_vericache.mem_cache.link import Link

            self.link = Link(server_args, self.model_runner.token_to_kv_pool, self.req_to_token_pool,
                             self.model_runner.device)
        self.tokenizer = None
        if not server_args.skip_tokenizer_init:
            from sglang_vericache.managers.tokenizer_manager import load_tokenizer

            self.tokenizer = load_tokenizer(server_args)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammar_backend = None  # xgrammar needs the tokenizer's vocabulary
        if self.tokenizer is not None:
            from sglang_vericache.constrained.grammar_backend import GrammarBackend

            self.grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)

        from sglang_vericache.layers.sampler import Sampler

        self.sampler = Sampler()
        self.waiting_queue: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.prefill_adder = PrefillAdder(self)
        self.metrics = SchedulerMetrics()
        # Benchmarks set a list here to get (start, end, tag) of every model forward.
        self.timeline: list[tuple[float, float, str]] | None = None
        self.profiler = SchedulerProfiler(server_args.device)  # /start_profile, /stop_profile

        self.recv_socket = self.send_socket = None
        if port_args is not None:
            ctx = zmq.Context(2)
            self.recv_socket = ctx.socket(zmq.PULL)
            self.recv_socket.bind(port_args.scheduler_input_ipc_name)
            self.send_socket = ctx.socket(zmq.PUSH)
            self.send_socket.connect(port_args.tokenizer_ipc_name)
        self.build_decoding()
        self.remote_prefill = None
        if server_args.disagg_prefill == "verifier":  # the verifier prefills (remote prefix caching)
            from sglang_vericache.disagg.remote_prefill import RemotePrefill

            self.remote_prefill = RemotePrefill(self)

    def build_decoding(self) -> None:
        """The collaborators of the decode paths, each handed only what it uses, in this order:
          memory     RequestMemory: slots, making room, retraction (pools, tree, queues);
          output     OutputSink (RecordingSink on a verifier): emits with stop checks, releases
                     finished requests through memory;
          round      VeriCacheRound (VeriCache modes and the verifier): plan, draft, verify,
                     accept, commit over memory, output, the forward, the two tiers and the link;
          spec_worker  the driver that schedules rounds: lock-step, staggered (its bookings go back
                     through memory.on_leave), or the remote drafter."""
        args = self.server_args
        self.memory = RequestMemory(self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size,
                                    self.two_tier, self.running, self.waiting_queue, self.prefill_adder,
                                    self.metrics)
        sink = RecordingSink if args.disagg_role == "verifier" else OutputSink
        self.output = sink(self.memory, self.running, self.metrics, self.eos_token_ids, self.tokenizer,
                           self.context_len)
        self.round = self.spec_worker = None
        # Admission beyond memory (schedule_policy.py): the adaptive controller's say, if any.
        self.admission_gate = None
        if self.mode == "vericache" or args.disagg_role == "verifier":
            self.round = self.make_round()
        if self.mode != "vericache":
            return
        if args.disagg_role == "drafter":  # dual-instance (disagg/): verification on a remote verifier
            from sglang_vericache.disagg.remote_verify import RemoteVerifyWorker

            self.spec_worker = RemoteVerifyWorker(args, self.round, self.memory, self.running,
                                                  self.model_runner.token_to_kv_pool, self.abort,
                                                  self.recv_socket, self.prefix_store)
        elif args.staggered:
            from sglang_vericache.speculative.stagger import StaggeredVeriCache

            self.spec_worker = StaggeredVeriCache(self.round, self.memory, self.running, self.link)
            self.memory.on_leave = self.spec_worker.cancel
        elif args.adaptive:
            from sglang_vericache.speculative.adaptive import AdaptiveVeriCache

            self.spec_worker = AdaptiveVeriCache(args, self.round, self.memory, self.running, self.link,
                                                 self.two_tier, self.model_runner, self.page_size)
            self.memory.on_leave = self.spec_worker.cancel
            self.admission_gate = self.spec_worker.admits
        else:
            from sglang_vericache.speculative.vericache_worker import VeriCacheWorker

            self.spec_worker = VeriCacheWorker(self.round, self.memory, self.running, self.link)

    def make_round(self):
        from sglang_vericache.speculative.acceptance import DraftLengthPolicy
        from sglang_vericache.speculative.vericache_round import VeriCacheRound, make_draft_pool

        args, runner = self.server_args, self.model_runner
        max_draft = args.max_draft_tokens
        policy = DraftLengthPolicy(None if args.speculative_num_draft_tokens == "auto" else max_draft, max_draft)
        draft_pool = None  # a verifier never drafts
        if self.mode == "vericache":
            draft_pool = make_draft_pool(max_draft, self.req_to_token_pool.size, runner.model_config,
                                         runner.token_to_kv_pool, runner.device)
        return VeriCacheRound(policy, self.sampler, self.vocab_size, self.eos_token_ids, self.memory, self.output,
                              self.metrics, self.forward, self.two_tier, self.link, draft_pool,
                              args.ngram_config() if self.mode == "vericache" else None)

    @property
    def outbox(self) -> list[ReqOutput]:
        return self.output.outbox

    @outbox.setter
    def outbox(self, value: list[ReqOutput]) -> None:
        self.output.outbox = value

    # ------------------------------------------------------------------ limits

    @property
    def max_req_len(self) -> int:
        """Longest prompt + output one request may reach: the context, the pool less a page, and
        (when exact KV streams over a link) what one verification may stage."""
        limit = min(self.context_len, self.max_total_num_tokens - self.page_size)
        if self.server_args.uses_link:
            limit = min(limit, self.server_args.verify_staging_tokens)
        return limit

    def ready_message(self) -> SchedulerReady:
        mc = self.model_runner.model_config
        return SchedulerReady(
            max_total_num_tokens=self.max_total_num_tokens,
            max_req_input_len=self.max_req_len - 1,
            context_length=self.context_len,
            vocab_size=self.vocab_size,
            server_info={
                "max_total_num_tokens": self.max_total_num_tokens,
                "page_size": self.page_size,
                "context_length": self.context_len,
                "vocab_size": self.vocab_size,
                "dtype": str(mc.dtype).replace("torch.", ""),
                "num_hidden_layers": mc.num_hidden_layers,
                "kv_bytes_per_token": self.model_runner.token_to_kv_pool.bytes_per_token(),
                "grammar_backend": "xgrammar" if self.grammar_backend is not None else None,
                "enable_deterministic_inference": bool(self.server_args.enable_deterministic_inference),
                "batch_invariant_linear": self.model_runner.batch_invariant_linear_name(),
                **self.tier_info(),
            },
        )

    def tier_info(self) -> dict:
        """Each KV tier's budget: where it lives, and how much it holds."""
        exact = self.model_runner.token_to_kv_pool
        info = {
            "kv_mode": self.mode,
            "exact_tier": {
                "where": "device" if self.mode == "full" else "host",
                "tokens": self.max_total_num_tokens,
                "bytes": self.max_total_num_tokens * exact.bytes_per_token(),
            },
        }
        if self.two_tier is not None:
            pool = self.two_tier.pool
            info["compressed_tier"] = {
                "where": "device",
                "compressor": self.server_args.kv_compressor,
                "chunks": pool.num_chunks,
                "tokens": pool.num_chunks * self.page_size,
                "bytes": pool.num_chunks * pool.bytes_per_chunk(),
                "effective_ratio": round(self.two_tier.compressor.effective_ratio(), 3),
            }
        if self.prefix_store is not None:
            info["kv_store"] = self.prefix_store.info()
        if self.server_args.disagg_role == "drafter":
            args = self.server_args
            info["disagg"] = {"role": "drafter", "verifier_addr": args.verifier_addr, "prefill": args.disagg_prefill,
                              "bandwidth": args.disagg_bandwidth}
        if self.spec_worker is not None:
            info["speculative_algorithm"] = "VERICACHE"
            info["speculative_num_draft_tokens"] = self.server_args.speculative_num_draft_tokens
        return info

    # ------------------------------------------------------------------ event loop

    def event_loop(self) -> None:
        timeout = self.server_args.watchdog_timeout_s
        watchdog = StepWatchdog(timeout) if timeout is not None else None
        while True:
            self.recv_requests(block=not self.has_work())
            busy = self.has_work()
            if watchdog is None:
                self.step()
            else:
                with watchdog.step():
                    self.step()
            self.flush_outbox()
            if busy and self.profiler.running:
                self.profiler.on_step()

    def has_work(self) -> bool:
        return bool(self.waiting_queue or self.running or self.chunked_req
                    or (self.remote_prefill is not None and self.remote_prefill.prefilling))

    def recv_requests(self, block: bool = False) -> None:
        if self.recv_socket is None:
            return
        if block:
            self.recv_socket.poll(timeout=1000)
        while True:
            try:
                msg = self.recv_socket.recv_pyobj(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            reply = self.handle_message(msg)
            if reply is not None:
                self.send_socket.send_pyobj(reply)

    def handle_message(self, msg):
        if isinstance(msg, TokenizedGenerateReqInput):
            return self.add_request(msg)
        if isinstance(msg, AbortReq):
            self.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        elif isinstance(msg, GetStatsReq):
            return self.get_stats()
        elif isinstance(msg, ProfileReq):
            return self.profiler.handle(msg)
        else:
            logger.warning("scheduler got an unknown message %r", type(msg))
        return None

    def add_request(self, r: TokenizedGenerateReqInput) -> SchedulerError | None:
        n_in = len(r.input_ids)
        if n_in == 0:
            return SchedulerError(r.rid, "the prompt is empty")
        bad = [t for t in r.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            return SchedulerError(r.rid, f"input token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if n_in + r.sampling_params.max_new_tokens > self.max_req_len:
            return SchedulerError(
                r.rid,
                f"the request needs {n_in} prompt + {r.sampling_params.max_new_tokens} new tokens, "
                f"more than the {self.max_req_len} tokens a request may have",
            )
        req = Req.from_input(r)
        if self.server_args.disagg_role == "drafter":  # dual-instance: open the verifier's session now
            refused = self.spec_worker.open_session(req)
            if refused is not None:
                return SchedulerError(r.rid, *refused)
        if grammar_key(r.sampling_params) is not None:
            if self.grammar_backend is None:
                return SchedulerError(r.rid, "constrained decoding needs a tokenizer (--skip-tokenizer-init is set)")
            try:
                req.grammar = self.grammar_backend.new_grammar(r.sampling_params)
            except InvalidRequest as e:
                return SchedulerError(r.rid, str(e))
        self.waiting_queue.append(req)
        self.metrics.num_requests_total += 1
        return None

    def abort_request(self, rid: str) -> None:
        prefilling = list(self.remote_prefill.prefilling.values()) if self.remote_prefill is not None else []
        chunked = [self.chunked_req] if self.chunked_req else []
        for req in [*self.waiting_queue, *self.running, *chunked, *prefilling]:
            if req.rid == rid:
                self.abort(req, "aborted by the client")
                return

    def abort(self, req: Req, message: str) -> None:
        """Ends req with an abort carrying message: now if it waits, at the next step if it runs."""
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
            if req.req_pool_idx is not None:  # a retracted request holds nothing; a fresh one neither
                self.tree_cache.cache_finished_req(req)
            req.finished_reason = {"type": "abort", "message": message}
            self.output.emit(req)
        else:
            req.to_abort = message  # running, chunked or prefilling: drop_aborted (or RemotePrefill) ends it

    def flush_cache(self) -> FlushCacheReqOutput:
        if self.running or self.waiting_queue or self.chunked_req:
            return FlushCacheReqOutput(False, "requests are still running")
        self.tree_cache.reset()
        self.allocator.clear()  # idle: every slot was either free or owned by the tree
        return FlushCacheReqOutput(True)

    def get_stats(self):
        return self.metrics.snapshot(self)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        if self.server_args.disagg_role == "drafter":  # verifier results, heartbeat, a verifier gone away
            self.spec_worker.poll_verifier()
        self.drop_aborted()
        if self.remote_prefill is not None:  # prompts prefill on the verifier: admission only, here
            self.remote_prefill.step()
            if self.running:
                self.run_decode()
            else:
                self.remote_prefill.wait()
            return
        batch = self.prefill_adder.build()
        if batch:
            self.run_extend(batch)
        elif self.running:
            self.run_decode()

    def drop_aborted(self) -> None:
        for req in [r for r in self.running if r.to_abort]:
            self.running.remove(req)
            req.finished_reason = {"type": "abort", "message": req.to_abort}
            self.output.release(req)
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req, self.chunked_req = self.chunked_req, None
            req.finished_reason = {"type": "abort", "message": req.to_abort}
            self.output.release(req)
