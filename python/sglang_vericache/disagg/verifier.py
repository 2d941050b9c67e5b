"""The verifier instance (--disagg-role verifier): exact KV only, verification for remote drafters.

It is a full-mode Scheduler (exact pools, radix cache, --kv-store exact tier) driven by this loop
instead of the tokenizer-facing event loop:

    receive   Hello -> Pong(epoch); OpenSession -> a Req in the waiting queue (the normal admission
              and prefill path: prefix match, store lookup, chunked prefill, write-through);
              VerifyRun -> the session's pending run; CloseSession -> the Req is released.
    prefill   one prefill batch per iteration (its first token is sampled as the drafter's own
              prefill samples it; the first VerifyRun must start with that token, or the session
              is out of sync and fails).
    verify    every prefilled session with a pending run, in ONE TARGET_VERIFY forward: the
              scheduler's round driver, VerifyWorker (verify_worker.py), over its VeriCacheRound.
    expire    a drafter not heard from for --disagg-timeout seconds loses its sessions.

Invariant per session (as in Req): between rounds, output_ids equals the drafter's and
kv_committed_len == seqlen - 1. Stop conditions are the drafter's business (it closes the session
when the request ends): the verifier's scheduler emits into a RecordingSink (managers/output_sink.py),
which checks no stop and streams nothing, so every round commits j + 1 positions.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

import torch
import zmq

from sglang_vericache.disagg.messages import (
    CloseSession,
    Hello,
    OpenSession,
    Pong,
    PrefillResult,
    TO_VERIFIER,
    Refused,
    VerifyResult,
    VerifyRun,
)
from sglang_vericache.disagg.verify_worker import VerifyWorker
from sglang_vericache.disagg.wire import Codec, DropLog, VersionMismatch, WireError
from sglang_vericache.managers.io_struct import SchedulerError, TokenizedGenerateReqInput
from sglang_vericache.managers.schedule_batch import Req
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.sampling.sampling_params import InvalidRequest
from sglang_vericache.server_args import ServerArgs

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
MAX_FRAME_BYTES = 64 << 20  # drafters send token ids only: a larger frame closes its connection


@dataclass(eq=False)
class Session:
    drafter: bytes  # the drafter's ZMQ routing id
    rid: str  # the drafter's request id
    req: Req
    pending: VerifyRun | None = None
    kv_from: int | None = None  # the drafter wants a PrefillResult (--disagg-prefill verifier)
    prefill_sent: bool = False


def new_epoch() -> int:
    """A value no earlier instance on this host had (pid and start time), never 0."""
    return (time.time_ns() << 20 | os.getpid() & 0xFFFFF) & ((1 << 62) - 1) or 1


class VerifierServer:
    def __init__(self, server_args: ServerArgs, scheduler: Scheduler | None = None):
        if server_args.kv_mode != "full":
            raise ValueError("the verifier keeps exact KV only "
                             "(no --kv-compressor / --speculative-algorithm)")
        self.args = server_args
        self.sched = scheduler if scheduler is not None else Scheduler(server_args)
        self.epoch = new_epoch()
        self.timeout = server_args.disagg_timeout
        # A private context, terminated when serve_forever ends: term() waits until the port is
        # released, so a successor can bind it at once.
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.addr = f"tcp://{server_args.host}:{server_args.disagg_port}"
        self.sock.bind(self.addr)
        # The wire format (wire.py): no pickle; frames it refuses are dropped and logged once per peer.
        self.codec = Codec(server_args.disagg_secret, accept=TO_VERIFIER)
        self.drops = DropLog("verifier")
        self.refused_at: dict[bytes, float] = {}  # peers of another protocol version: last Refused sent
        if server_args.disagg_secret is None:
            logger.warning("verifier: %s is unauthenticated (no --disagg-secret or "
                           "SGLANG_VERICACHE_DISAGG_SECRET): any process that reaches it can open sessions%s",
                           self.addr, "" if server_args.host in ("127.0.0.1", "localhost", "::1")
                           else f", and --host {server_args.host} reaches beyond this machine")
        self.sessions: dict[str, Session] = {}  # key: session_key(drafter, rid), also the Req's rid
        self.drafter_seen: dict[bytes, float] = {}
        self.stats = {"sessions_opened": 0, "sessions_dropped": 0, "verify_forwards": 0, "runs_verified": 0,
                      "prefills_sent": 0, "frames_dropped": 0}
        # The round driver of this instance (speculative/base_spec_worker.py), on the scheduler.
        self.worker = VerifyWorker(self.sched, self.sessions, self.epoch, self.addr, self.send, self.fail, self.stats)
        self.sched.spec_worker = self.worker
        self._stop = False
        logger.info("verifier listening on %s (epoch %d)", self.addr, self.epoch)

    @staticmethod
    def session_key(drafter: bytes, rid: str) -> str:
        return f"{drafter.hex()}/{rid}"

    # ------------------------------------------------------------------ loop

    def serve_forever(self) -> None:
        try:
            while not self._stop:
                busy = self.sched.waiting_queue or self.sched.chunked_req or self.worker.ready_sessions()
                if self.sock.poll(0 if busy else IDLE_POLL_MS):
                    self.receive()
                self.expire_drafters()
                self.step()
        finally:
            self.sock.close(0)
            self.ctx.term()

    def stop(self) -> None:
        """Ends serve_forever after the current iteration (its socket closes without lingering)."""
        self._stop = True

    def step(self) -> None:
        s = self.sched
        s.drop_aborted()  # closed sessions
        batch = s.prefill_adder.build(s.chunked_req)
        if batch:
            s.run_extend(batch)
            self.send_prefills()
        self.worker.forward_batch_generation()  # the sessions' pending runs, in one verify forward

    def receive(self) -> None:
        while True:
            try:
                drafter, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.codec.decode(frames)
            except VersionMismatch as e:
                self.drop(drafter, e)
                self.refuse_version(drafter, e)
                continue
            except WireError as e:  # never acted on; the verifier keeps serving everyone else
                self.drop(drafter, e)
                continue
            self.drafter_seen[drafter] = time.monotonic()
            try:
                self.handle(drafter, msg)
            except Exception as e:  # a well-formed but impossible message must not stop the verifier
                logger.debug("verifier: message from %s failed", drafter.hex(), exc_info=True)
                self.drop(drafter, WireError(f"a {type(msg).__name__} it could not handle ({e!r})"))

    def drop(self, drafter: bytes, error: WireError) -> None:
        self.drops.drop(drafter, error)
        self.stats["frames_dropped"] = self.drops.count

    def refuse_version(self, drafter: bytes, e: VersionMismatch) -> None:
        """Answers a peer of another protocol version (at most once a second per peer) with Refused,
        whose header's version is all that peer needs to read."""
        now = time.monotonic()
        if now - self.refused_at.get(drafter, -1e9) < 1.0:
            return
        if len(self.refused_at) >= DropLog.MAX_PEERS:
            self.refused_at.clear()
        self.refused_at[drafter] = now
        self.send(drafter, Refused(self.epoch, (
            f"verifier at {self.addr} speaks disagg wire protocol version {e.own_version}; the drafter sent "
            f"version {e.peer_version!r} (run the same sglang-vericache version on both instances)")))

    def send(self, drafter: bytes, msg) -> None:
        try:
            self.sock.send_multipart([drafter, *self.codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # a drafter that went away: its sessions expire
            logger.warning("verifier: cannot answer drafter %s: %s", drafter.hex(), e)

    def fail(self, drafter: bytes, rid: str, round_id: int, error: str) -> None:
        self.send(drafter, VerifyResult(rid=rid, round_id=round_id, epoch=self.epoch, error=error))

    # ------------------------------------------------------------------ messages

    def handle(self, drafter: bytes, msg) -> None:
        if isinstance(msg, Hello):
            self.send(drafter, Pong(self.epoch, len(self.sessions)))
            return
        rid = getattr(msg, "rid", None)
        if getattr(msg, "epoch", None) != self.epoch:  # meant for an earlier instance: never act on it
            if rid is not None and not isinstance(msg, CloseSession):
                self.fail(drafter, rid, getattr(msg, "round_id", -1),
                          f"verifier at {self.addr} restarted; the session is gone")
            return
        key = self.session_key(drafter, rid)
        if isinstance(msg, OpenSession):
            self.open_session(drafter, key, msg)
        elif isinstance(msg, VerifyRun):
            sess = self.sessions.get(key)
            if sess is None:
                self.fail(drafter, rid, msg.round_id, "no such session on the verifier")
            elif max(msg.tokens) >= self.sched.vocab_size:
                self.fail(drafter, rid, msg.round_id, "a verify run with token ids outside the vocabulary")
            elif sess.pending is not None:
                self.fail(drafter, rid, msg.round_id, "a verification of this session is already pending")
            else:
                sess.pending = msg
        elif isinstance(msg, CloseSession):
            self.close_session(key)
        else:
            logger.warning("verifier got an unknown message %r", type(msg).__name__)

    def open_session(self, drafter: bytes, key: str, msg: OpenSession) -> None:
        if key in self.sessions:
            self.fail(drafter, msg.rid, -1, "a session with this request id is already open")
            return
        vocab = self.sched.vocab_size
        try:
            msg.sampling_params.verify(vocab)
            if msg.top_logprobs_num > vocab:
                raise InvalidRequest(f"top_logprobs_num must be <= {vocab}, got {msg.top_logprobs_num}")
            if msg.kv_from is not None and msg.kv_from > len(msg.input_ids):
                raise InvalidRequest(f"kv_from {msg.kv_from} is past the prompt's "
                                     f"{len(msg.input_ids)} tokens")
        except InvalidRequest as e:
            self.fail(drafter, msg.rid, -1, f"the verifier refused the request: {e}")
            return
        err = self.sched.handle_message(TokenizedGenerateReqInput(
            rid=key, input_ids=list(msg.input_ids), sampling_params=msg.sampling_params, seed=msg.seed,
            return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len if msg.kv_from is not None else -1,
        ))
        if isinstance(err, SchedulerError):
            self.fail(drafter, msg.rid, -1, f"the verifier refused the request: {err.message}")
            return
        self.sessions[key] = Session(drafter, msg.rid, self.sched.waiting_queue[-1], kv_from=msg.kv_from)
        self.stats["sessions_opened"] += 1

    def send_prefills(self) -> None:
        """PrefillResult for each session whose prompt prefill just completed and whose drafter asked
        for it: the first token, logprobs, and the exact KV of prompt positions [kv_from, prompt_len)
        (none if the first token ended the request: its KV went to the tree with the release)."""
        s = self.sched
        kv = s.model_runner.token_to_kv_pool
        for sess in self.sessions.values():
            req = sess.req
            if sess.kv_from is None or sess.prefill_sent or not (req.output_ids or req.finished):
                continue
            sess.prefill_sent = True
            res = PrefillResult(rid=sess.rid, epoch=self.epoch, token=req.output_ids[0] if req.output_ids else -1)
            if req.return_logprob:
                res.input_token_logprobs = req.input_token_logprobs
                res.input_top_logprobs = req.input_top_logprobs
                if req.output_ids:
                    res.logprob = req.output_token_logprobs[0][0]
                    if req.top_logprobs_num:
                        res.top_logprobs = req.output_top_logprobs[0]
            if not req.finished:
                n = len(req.origin_input_ids)
                slots = s.req_to_token_pool.req_to_token[req.req_pool_idx, sess.kv_from : n]
                res.k = torch.stack([kv.k_buffer[layer][slots] for layer in range(kv.num_layers)])
                res.v = torch.stack([kv.v_buffer[layer][slots] for layer in range(kv.num_layers)])
            self.stats["prefills_sent"] += 1
            self.send(sess.drafter, res)

    def close_session(self, key: str) -> None:
        sess = self.sessions.pop(key, None)
        if sess is not None and not sess.req.finished:
            self.sched.abort_request(key)  # waiting: released now; running: at the next drop_aborted

    def expire_drafters(self) -> None:
        now = time.monotonic()
        gone = [d for d, t in self.drafter_seen.items() if now - t > self.timeout]
        for d in gone:
            del self.drafter_seen[d]
            keys = [k for k, sess in self.sessions.items() if sess.drafter == d]
            if keys:
                logger.warning("verifier: drafter %s silent for %.1f s; dropping its %d sessions",
                               d.hex(), self.timeout, len(keys))
            for k in keys:
                self.close_session(k)
            self.stats["sessions_dropped"] += len(keys)


def run_verifier(server_args: ServerArgs) -> None:
    """`launch_server --disagg-role verifier`: serve until SIGINT/SIGTERM."""
    if server_args.num_threads:
        torch.set_num_threads(server_args.num_threads)
    server = VerifierServer(server_args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
    print(f"verifier ready on {server.addr} (epoch {server.epoch})", flush=True)
    server.serve_forever()
