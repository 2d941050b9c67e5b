"""Scheduler: the process that owns the model, the KV pools and the radix cache.

Each loop iteration: take new requests, then run either one prefill batch (new requests and
the next chunk of a chunked prefill) or one decode step for every running request, then send
what each request emitted. Memory pressure is met by queueing (admission control), prefix-cache
eviction, and finally retraction of running requests, never by failing a request.
The forward passes themselves are in scheduler_forward.py, sampling in
scheduler_output_processor.py, /start_profile in scheduler_profiler.py, what it reports of itself
(limits, the ready message, the tiers' budgets) in scheduler_info.py. The collaborators of
admission and the decode paths (RequestMemory, OutputSink, VeriCacheRound and its driver,
PrefillAdder, RemotePrefill) are built in one place, build_decoding; TwoTierKV and PrefixStore, which the tree and admission need first, in
__init__ (each handed the server args and the pools, the tree or the tier it uses).
"""

from __future__ import annotations

import logging

import zmq

from sglang_vericache.constrained.grammar_backend import grammar_key
from sglang_vericache.distributed.parallel_state import get_tp_group
from sglang_vericache.managers import request_broadcast
from sglang_vericache.managers.batch_log import BatchLog
from sglang_vericache.managers.io_struct import (
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetStatsReq,
    ProfileReq,
    ReqOutput,
    SchedulerError,
    TokenizedGenerateReqInput,
)
from sglang_vericache.managers.output_sink import OutputSink, RecordingSink
from sglang_vericache.managers.request_memory import RequestMemory
from sglang_vericache.managers.request_queues import RequestQueues
from sglang_vericache.managers.schedule_batch import Req
from sglang_vericache.managers.schedule_policy import PrefillAdder
from sglang_vericache.managers.spec_worker_factory import create_spec_worker
from sglang_vericache.managers.scheduler_forward import SchedulerForwardMixin
from sglang_vericache.managers.scheduler_info import SchedulerInfoMixin
from sglang_vericache.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from sglang_vericache.managers.scheduler_profiler import SchedulerProfiler
from sglang_vericache.managers.stats import SchedulerMetrics
from sglang_vericache.managers.watchdog import StepWatchdog
from sglang_vericache.mem_cache.radix_cache import RadixCache
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.sampling.sampling_params import InvalidRequest
from sglang_vericache.server_args import PortArgs, ServerArgs

logger = logging.getLogger(__name__)


class Scheduler(SchedulerForwardMixin, SchedulerOutputProcessorMixin, SchedulerInfoMixin):
    def __init__(self, server_args: ServerArgs, port_args: PortArgs | None = None):
        self.server_args = server_args
        self.tp = get_tp_group()  # rank 0 reads the sockets and decides; the others follow it
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

            self.two_tier = TwoTierKV(server_args, self.model_runner)
            comp = self.two_tier.compressor
            if comp.needs_reconstruction:  # kvzip: the model's pass of every folded page, handed to the cache
                from sglang_vericache.compress.kvzip_reconstruction import reconstruction_for

                self.two_tier.reconstruction = reconstruction_for(server_args, self.model_runner, self.page_size,
                                                                  comp.config.num_sink_tokens,
                                                                  self.two_tier.segment_scope)
                # Its scratch KV slots are the pass's own: requests get the rest (max_req_len follows).
                self.max_total_num_tokens -= len(self.two_tier.reconstruction.scratch)
            if server_args.disagg_prefill == "verifier":  # remote prefix caching: compressed pages alone
                from sglang_vericache.mem_cache.compressed_prefix_cache import CompressedPrefixCache as TreeCls
            else:
                TreeCls = TwoTierRadixCache
            self.tree_cache = TreeCls(
                self.req_to_token_pool, self.allocator, self.two_tier.pool, self.page_size,
                disable=server_args.disable_radix_cache,
            )
            self.two_tier.tree_cache = self.tree_cache
            self.tree_cache.share_comp = not self.two_tier.segment_scope
        # KV store (--kv-store, issue 8): prefix pages shared across instances; see prefix_store.py.
        self.prefix_store = None
        if server_args.kv_store != "none":
            from sglang_vericache.mem_cache.prefix_store import PrefixStore

            self.prefix_store = PrefixStore(server_args, self.req_to_token_pool, self.allocator,
                                            self.model_runner.token_to_kv_pool, self.tree_cache, self.two_tier)
        self.link = None
        if server_args.uses_link:
            from sglang_vericache.mem_cache.link import Link

            self.link = Link(server_args, self.model_runner.token_to_kv_pool, self.req_to_token_pool,
                             self.model_runner.device)
        self.tokenizer = None
        if not server_args.skip_tokenizer_init:
            from sglang_vericache.utils.hf_tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(server_args)
        self.eos_token_ids = set(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.grammar_backend = None  # xgrammar needs the tokenizer's vocabulary
        if self.tokenizer is not None:
            from sglang_vericache.constrained.grammar_backend import GrammarBackend

            self.grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, self.eos_token_ids)

        from sglang_vericache.layers.batch_invariant import uses_triton_row_kernels
        from sglang_vericache.layers.sampler import RankZeroSampler, Sampler

        sampler = Sampler(uses_triton_row_kernels(server_args.enable_deterministic_inference,
                                                  server_args.attention_backend, server_args.device))
        self.sampler = sampler if self.tp.size == 1 else RankZeroSampler(sampler, self.tp)
        # waiting, running and the prefill in progress, with one owner (request_queues.py)
        self.queues = RequestQueues()
        self.metrics = SchedulerMetrics()
        # "Prefill batch." / "Decode batch." log lines (batch_log.py), from rank 0 alone.
        self.batch_log = BatchLog(server_args.decode_log_interval, self.mode == "vericache", self.tp.is_first)
        # Benchmarks set a list here to get (start, end, tag) of every model forward.
        self.timeline: list[tuple[float, float, str]] | None = None
        self.profiler = SchedulerProfiler(server_args.device)  # /start_profile, /stop_profile

        self.recv_socket = self.send_socket = None
        if port_args is not None and self.tp.is_first:
            ctx = zmq.Context(2)
            self.recv_socket = ctx.socket(zmq.PULL)
            self.recv_socket.bind(port_args.scheduler_input_ipc_name)
            self.send_socket = ctx.socket(zmq.PUSH)
            self.send_socket.connect(port_args.tokenizer_ipc_name)
        self.build_decoding()
        if self.tp.is_first:
            logger.info(self.mode_line())

    def build_decoding(self) -> None:
        """The collaborators of admission and the decode paths, each handed only what it uses (the
        pools, the tree, two_tier and prefix_store are built before), in this order:
          memory     RequestMemory: slots, making room, retraction (pools, tree, queues);
          output     OutputSink (RecordingSink on a verifier): emits with stop checks, releases
                     finished requests through memory;
          round      VeriCacheRound (VeriCache modes and the verifier): plan, draft, verify,
                     accept, commit over memory, output, the forward, the two tiers and the link;
          spec_worker  the one driver of rounds (BaseSpecWorker, chosen by create_spec_worker):
                     lock-step, staggered, adaptive or the remote drafter (bookings go back through
                     memory.on_leave -> release);
          prefill_adder  PrefillAdder: admission through memory (a retraction tells it through
                     memory.on_retract), with the adaptive driver's admission_gate;
          remote_prefill  RemotePrefill (--disagg-prefill verifier): admission instead of prefill,
                     through memory, output and the remote drafter's worker."""
        args = self.server_args
        self.memory = RequestMemory(self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size,
                                    self.two_tier, self.queues, self.metrics)
        sink = RecordingSink if args.disagg_role == "verifier" else OutputSink
        self.output = sink(self.memory, self.queues, self.metrics, self.eos_token_ids, self.tokenizer,
                           self.context_len)
        vericache = self.mode == "vericache"
        self.round = self.make_round() if vericache or args.disagg_role == "verifier" else None
        # The one driver of VeriCache rounds (spec_worker_factory.py); its bookings go back when a
        # request leaves, and it may gate admission (the adaptive controller).
        self.spec_worker = create_spec_worker(args, self) if vericache else None
        self.admission_gate = None
        if self.spec_worker is not None:
            self.memory.on_leave = self.spec_worker.release
            self.admission_gate = self.spec_worker.admission_gate
        self.prefill_adder = PrefillAdder(args, self.queues, self.req_to_token_pool,
                                          self.allocator, self.tree_cache, self.memory, self.metrics,
                                          self.two_tier, self.prefix_store, self.admission_gate)
        self.memory.on_retract = self.prefill_adder.on_retract
        self.remote_prefill = None
        if args.disagg_prefill == "verifier":  # the verifier prefills (remote prefix caching)
            from sglang_vericache.disagg.remote_prefill import RemotePrefill

            self.remote_prefill = RemotePrefill(
                args, self.queues, self.req_to_token_pool, self.allocator,
                self.model_runner.token_to_kv_pool, self.tree_cache, self.two_tier, self.memory, self.output,
                self.metrics, self.spec_worker, self.prefix_store, self.recv_socket)

    def make_round(self):
        from sglang_vericache.speculative.acceptance import DraftLengthPolicy
        from sglang_vericache.speculative.vericache_round import VeriCacheRound, make_draft_pool

        args, runner = self.server_args, self.model_runner
        max_draft = args.max_draft_tokens
        policy = DraftLengthPolicy(args.draft_tokens, max_draft)  # draft_tokens: None under "auto"
        draft_pool = None  # a verifier never drafts
        if self.mode == "vericache":
            draft_pool = make_draft_pool(max_draft, self.req_to_token_pool.size, runner.model_config,
                                         runner.token_to_kv_pool, runner.device)
        return VeriCacheRound(policy, self.sampler, self.vocab_size, self.eos_token_ids, self.memory, self.output,
                              self.metrics, self.forward, self.two_tier, self.link, draft_pool,
                              args.ngram_config() if self.mode == "vericache" else None)

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def waiting_queue(self):
        return self.queues.waiting

    @property
    def chunked_req(self) -> Req | None:
        return self.queues.chunked

    @property
    def outbox(self) -> list[ReqOutput]:
        return self.output.outbox

    @outbox.setter
    def outbox(self, value: list[ReqOutput]) -> None:
        self.output.outbox = value

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
        return self.queues.has_work() or bool(self.remote_prefill is not None and self.remote_prefill.prefilling)

    def recv_requests(self, block: bool = False) -> None:
        """Handles what arrived (rank 0: its socket; other ranks: rank 0's broadcast of it)."""
        msgs = []
        if self.recv_socket is not None:
            if block:
                self.recv_socket.poll(timeout=1000)
            while True:
                try:
                    msgs.append(self.recv_socket.recv_pyobj(zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
        elif self.tp.is_first:
            return
        for msg in request_broadcast.exchange(self.tp, msgs):
            reply = self.handle_message(msg)
            if reply is not None and self.send_socket is not None:
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
            rec = getattr(self.two_tier, "reconstruction", None)
            why = "" if rec is None or self.max_req_len != self.max_total_num_tokens - self.page_size else (
                f" (kvzip's reconstruction pass holds {len(rec.scratch)} of the KV pool's slots; "
                "raise --max-total-tokens)")
            return SchedulerError(
                r.rid,
                f"the request needs {n_in} prompt + {r.sampling_params.max_new_tokens} new tokens, "
                f"more than the {self.max_req_len} tokens a request may have{why}",
            )
        req = Req.from_input(r)
        if self.spec_worker is not None:  # dual-instance: the verifier's session opens now
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
        self.queues.enqueue(req)
        self.metrics.num_requests_total += 1
        return None

    def abort_request(self, rid: str) -> None:
        prefilling = list(self.remote_prefill.prefilling.values()) if self.remote_prefill is not None else []
        for req in [*self.queues.all(), *prefilling]:
            if req.rid == rid:
                self.abort(req, "aborted by the client")
                return

    def abort(self, req: Req, message: str) -> None:
        """Ends req with an abort carrying message: now if it waits, at the next step if it runs."""
        if req in self.queues.waiting:
            self.queues.drop_waiting(req)
            if req.req_pool_idx is not None:  # a retracted request holds nothing; a fresh one neither
                self.tree_cache.cache_finished_req(req)
            req.finished_reason = {"type": "abort", "message": message}
            self.output.emit(req)
        else:
            req.to_abort = message  # running, chunked or prefilling: drop_aborted (or RemotePrefill) ends it

    def flush_cache(self) -> FlushCacheReqOutput:
        if self.queues.has_work():
            return FlushCacheReqOutput(False, "requests are still running")
        self.tree_cache.reset()
        self.allocator.clear()  # idle: every slot was either free or owned by the tree
        return FlushCacheReqOutput(True)

    def get_stats(self):
        return self.metrics.snapshot(self)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        if self.spec_worker is not None:  # the remote drafter: verifier results, heartbeat
            self.spec_worker.poll()
        self.drop_aborted()
        if self.remote_prefill is not None:  # prompts prefill on the verifier: admission only, here
            self.remote_prefill.step()
            if self.running:
                self.batch_log.on_decode(self)
                self.run_decode()
            else:
                self.remote_prefill.wait()
            return
        batch = self.prefill_adder.build(self.chunked_req)
        if batch:
            self.batch_log.on_prefill(self, batch)
            self.run_extend(batch)
        elif self.running:
            self.batch_log.on_decode(self)
            self.run_decode()

    def drop_aborted(self) -> None:
        for req in [r for r in self.running if r.to_abort]:
            self.queues.stop_running(req)
            req.finished_reason = {"type": "abort", "message": req.to_abort}
            self.output.release(req)
        if self.chunked_req is not None and self.chunked_req.to_abort:
            req = self.queues.take_chunked()
            req.finished_reason = {"type": "abort", "message": req.to_abort}
            self.output.release(req)
