"""TokenizerManager: the main-process half of the engine.

It tokenizes and checks requests, starts the Scheduler process and talks to it over ZMQ (typed
io_struct messages), detokenizes incrementally, and turns scheduler outputs into SGLang's response
dicts (see docs/SGLANG_API.md). All of its state lives on one asyncio event loop.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import random
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from sglang_vericache.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetStatsReq,
    ProfileReq,
    ProfileReqOutput,
    ReqOutput,
    SchedulerError,
    SchedulerStats,
)
from sglang_vericache.managers.metrics import RequestMetrics
from sglang_vericache.managers.req_input import GenerateReqInput
from sglang_vericache.managers.req_state import ReqState
from sglang_vericache.managers.request_checks import Limits
from sglang_vericache.managers.request_log import log_finish, log_receive
from sglang_vericache.managers.scheduler_launcher import start_scheduler, wait_scheduler_ready
from sglang_vericache.managers.tokenizer_requests import TokenizerRequestsMixin
from sglang_vericache.managers.watchdog import describe_exit
from sglang_vericache.server_args import PortArgs, ServerArgs
from sglang_vericache.utils.hf_tokenizer import load_tokenizer
from sglang_vericache.utils.sampling_defaults import model_sampling_defaults

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
CONTROL_TIMEOUT_S = 30.0


class GenerateError(Exception):
    """A request that ends in an HTTP error (status_code) instead of an output."""

    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def _resolve_next(waiters: deque, msg: Any) -> None:
    if waiters:
        fut = waiters.popleft()
        if not fut.done():
            fut.set_result(msg)


class TokenizerManager(TokenizerRequestsMixin):
    def __init__(self, server_args: ServerArgs, port_args: PortArgs | None = None) -> None:
        self.server_args = server_args
        self.port_args = port_args or PortArgs.init_new()
        self.model_path = server_args.model_path
        self.served_model_name = server_args.served_model_name
        self.sampling_defaults = {}  # OpenAI requests' unset knobs (--sampling-defaults model)
        if server_args.sampling_defaults == "model":
            self.sampling_defaults = model_sampling_defaults(server_args.model_path)

        # Bind our end before the scheduler exists, so its first messages are never lost.
        self.zmq_ctx = zmq.asyncio.Context(2)
        self.recv_from_scheduler = self.zmq_ctx.socket(zmq.PULL)
        self.recv_from_scheduler.bind(self.port_args.tokenizer_ipc_name)
        # The scheduler loads the model while this process loads the tokenizer.
        self.scheduler_proc, readers = start_scheduler(server_args, self.port_args)  # one per local TP rank
        try:
            self.tokenizer = None if server_args.skip_tokenizer_init else load_tokenizer(server_args)
        except BaseException:
            self.scheduler_proc.kill()
            raise
        ready = wait_scheduler_ready(self.scheduler_proc, readers)
        self.send_to_scheduler = self.zmq_ctx.socket(zmq.PUSH)
        self.send_to_scheduler.setsockopt(zmq.LINGER, 0)
        self.send_to_scheduler.connect(self.port_args.scheduler_input_ipc_name)

        self.ready = ready
        self.context_len = ready.context_length
        self.max_req_input_len = ready.max_req_input_len
        self.vocab_size = ready.vocab_size
        self.limits = Limits(
            vocab_size=ready.vocab_size,
            context_len=ready.context_length,
            max_req_input_len=ready.max_req_input_len,
            has_tokenizer=self.tokenizer is not None,
            # The scheduler advertises a grammar backend in SchedulerReady.server_info once it has one.
            supports_grammar=bool((ready.server_info or {}).get("grammar_backend")),
        )
        self.grammar_backend = None  # compiles constraints to reject a bad one before any work
        if self.limits.supports_grammar and self.tokenizer is not None:
            from sglang_vericache.constrained.grammar_backend import GrammarBackend

            eos = self.tokenizer.eos_token_id
            eos_ids = [] if eos is None else [eos]
            self.grammar_backend = GrammarBackend(self.tokenizer, self.vocab_size, eos_ids)
        self.rng = random.Random(server_args.random_seed)
        self.stream_interval = server_args.stream_interval
        self.log_requests = server_args.log_requests
        self.rid_to_state: dict[str, ReqState] = {}
        self.metrics = RequestMetrics()
        self.last_stats: SchedulerStats | None = None
        self._stats_waiters: deque[asyncio.Future] = deque()
        self._flush_waiters: deque[asyncio.Future] = deque()
        self._profile_waiters: deque[asyncio.Future] = deque()
        self._loop_task: asyncio.Task | None = None
        self._watchdog_task: asyncio.Task | None = None
        self.dead_reason: str | None = None
        self.on_scheduler_exit = None  # called with the reason once the scheduler (any TP rank) has exited

    # ------------------------------------------------------------------ lifecycle

    def ensure_loop(self) -> None:
        """Starts the receive loop on the running event loop (once)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._handle_loop())
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog())

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.scheduler_proc.is_alive()

    def shutdown(self) -> None:
        for task in (self._loop_task, self._watchdog_task):
            if task is not None:
                task.cancel()
        if self.scheduler_proc.is_alive():
            self.scheduler_proc.terminate()
            self.scheduler_proc.join(5)
            if self.scheduler_proc.is_alive():
                self.scheduler_proc.kill()
                self.scheduler_proc.join(5)
        self.send_to_scheduler.close(0)
        self.recv_from_scheduler.close(0)
        self.zmq_ctx.term()

    def _send(self, obj: Any) -> None:
        if not self.is_healthy:
            raise GenerateError(f"the scheduler is not running: {self.dead_reason or 'it exited'}", 503)
        self.send_to_scheduler.send_pyobj(obj)

    async def _watchdog(self) -> None:
        while self.scheduler_proc.is_alive():
            await asyncio.sleep(1.0)
        self._fail_all(describe_exit(self.scheduler_proc.exitcode, self.scheduler_proc.failed_rank))
        if self.on_scheduler_exit is not None:
            self.on_scheduler_exit(self.dead_reason)

    def _fail_all(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error(reason)
        for state in list(self.rid_to_state.values()):
            state.error = GenerateError(reason, 500)
            state.event.set()
        self.rid_to_state.clear()
        for waiters in (self._stats_waiters, self._flush_waiters, self._profile_waiters):
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(GenerateError(reason, 503))

    # ------------------------------------------------------------------ receive

    async def _handle_loop(self) -> None:
        sock = self.recv_from_scheduler
        while True:
            self._handle_frame(await sock.recv())
            # Drain whatever else is queued before consumers run: a backlog (this process was
            # descheduled) then becomes one event per request instead of a burst of them.
            while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                self._handle_frame(await sock.recv())

    def _handle_frame(self, frame: bytes) -> None:
        try:
            self._handle_message(pickle.loads(frame))
        except Exception:  # one bad message must not stop every request
            logger.exception("failed to handle a scheduler message")

    def _handle_message(self, msg: Any) -> None:
        if isinstance(msg, BatchTokenIDOut):
            for out in msg.outputs:
                self._handle_req_output(out)
        elif isinstance(msg, SchedulerError):
            state = self.rid_to_state.pop(msg.rid, None)
            if state is not None:
                state.error = GenerateError(msg.message, msg.status_code)
                state.event.set()
        elif isinstance(msg, SchedulerStats):
            self.last_stats = msg
            _resolve_next(self._stats_waiters, msg)
        elif isinstance(msg, FlushCacheReqOutput):
            _resolve_next(self._flush_waiters, msg)
        elif isinstance(msg, ProfileReqOutput):
            _resolve_next(self._profile_waiters, msg)
        else:
            logger.warning("unexpected message from the scheduler: %r", type(msg).__name__)

    def _handle_req_output(self, out: ReqOutput) -> None:
        state = self.rid_to_state.get(out.rid)
        if state is None:  # aborted by us, or a health check that already returned
            return
        state.update(out, self.tokenizer)
        if state.finished:
            del self.rid_to_state[out.rid]
            if state.log_metrics:
                self.metrics.observe_finished(state)
            if self.log_requests and not state.no_logs:
                log_finish(state)
        state.event.set()

    # ------------------------------------------------------------------ requests

    def generate_request(self, obj: GenerateReqInput, request=None) -> AsyncIterator[Any]:
        """Checks and tokenizes now (raising InvalidRequest), then returns the output iterator.

        The iterator yields one response (a dict, or a list for batches and n > 1) or, when
        streaming, one dict per event (with "index" for batches). Sequences still running when the
        caller stops iterating (client disconnect, error) are aborted: the scheduler frees their KV.
        """
        self.ensure_loop()
        return self._generate(obj, self._build_states(obj), request)

    async def _generate(self, obj: GenerateReqInput, built, request) -> AsyncIterator[Any]:
        states = [s for s, _ in built]
        for state in states:
            self.rid_to_state[state.rid] = state
            if self.log_requests and not state.no_logs:
                log_receive(state)
        try:
            for _, req in built:
                self._send(req)
            if obj.stream:
                # Several sequences (a list of prompts, or n > 1) share one stream: events carry "index".
                with_index = len(states) > 1 or not obj.is_single
                async for event in self._stream(states, request, with_index):
                    yield event
            else:
                tasks = [asyncio.ensure_future(self._wait_final(s, request)) for s in states]
                try:
                    outs = await asyncio.gather(*tasks)
                finally:
                    for task in tasks:
                        task.cancel()
                yield outs[0] if obj.is_single and len(outs) == 1 else list(outs)
        finally:
            for state in states:
                if not state.finished:
                    self.abort_request(state.rid)

    def abort_running(self, rid: str) -> None:
        """An abort from outside the request (/abort_request): the scheduler's final abort
        output still reaches the waiting client. Unknown rids are ignored, as in SGLang."""
        if rid in self.rid_to_state:
            self._send(AbortReq(rid))

    def abort_request(self, rid: str) -> None:
        """Forgets the request (its client is gone) and tells the scheduler to free it."""
        state = self.rid_to_state.pop(rid, None)
        if state is None:
            return
        self.metrics.num_aborted_requests_total += 1
        if self.is_healthy:
            self.send_to_scheduler.send_pyobj(AbortReq(rid))

    async def _wait_event(self, state: ReqState, request) -> None:
        while True:
            if request is None:
                await state.event.wait()
                break
            try:
                await asyncio.wait_for(state.event.wait(), DISCONNECT_POLL_S)
                got = True
            except TimeoutError:
                got = False
            now = time.perf_counter()
            # Polled every DISCONNECT_POLL_S whether or not outputs keep arriving: a non-stream request's
            # outputs come at every step, and a client gone must not go unnoticed until it finishes.
            if not got or now - state.disconnect_checked >= DISCONNECT_POLL_S:
                state.disconnect_checked = now
                if await request.is_disconnected():
                    raise GenerateError(f"the client disconnected; request {state.rid} aborted", 499)
            if got:
                break
        state.event.clear()
        if state.error is not None:
            raise state.error

    async def _wait_final(self, state: ReqState, request) -> dict:
        while not state.finished:
            await self._wait_event(state, request)
        return state.make_output(final=True)

    async def _stream(self, states: list[ReqState], request, with_index: bool) -> AsyncIterator[dict]:
        pending = {asyncio.ensure_future(self._wait_event(s, request)): s for s in states}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    state = pending.pop(task)
                    task.result()  # raises the request's error
                    # An event only when there is something new: tokens, or the finish.
                    new = len(state.output_ids) - state.sent_ids
                    # `finished` is read once, before yielding: the state may finish while the
                    # consumer holds an event, and that finish still needs an event of its own.
                    finished = state.finished
                    interval = state.params.stream_interval or self.stream_interval
                    if finished or (new > 0 and (state.sent_ids == 0 or new >= interval)):
                        state.sent_ids = len(state.output_ids)
                        event = state.make_output(final=False)
                        if with_index:
                            event["index"] = state.index
                        yield event
                    if not finished:
                        pending[asyncio.ensure_future(self._wait_event(state, request))] = state
        finally:
            for task in pending:
                task.cancel()

    # ------------------------------------------------------------------ control

    async def _ask(self, msg: Any, waiters: deque) -> Any:
        """Sends a control message; replies of one kind come back in order (FIFO waiters)."""
        self.ensure_loop()
        fut = asyncio.get_running_loop().create_future()
        waiters.append(fut)
        try:
            self._send(msg)
            return await asyncio.wait_for(asyncio.shield(fut), CONTROL_TIMEOUT_S)
        except TimeoutError:
            what = f"{type(msg).__name__} in {CONTROL_TIMEOUT_S:.0f} s"
            raise GenerateError(f"the scheduler did not answer {what}", 504) from None
        finally:
            if not fut.done():
                fut.cancel()  # stays queued: the late reply resolves (and is dropped by) this future

    async def get_stats(self) -> SchedulerStats:
        return await self._ask(GetStatsReq(), self._stats_waiters)

    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self._ask(FlushCacheReq(), self._flush_waiters)

    async def profile(self, req: ProfileReq) -> ProfileReqOutput:
        """/start_profile and /stop_profile: the scheduler starts or stops torch.profiler."""
        return await self._ask(req, self._profile_waiters)
