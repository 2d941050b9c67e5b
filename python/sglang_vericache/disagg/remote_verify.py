"""The drafter side of dual-instance VeriCache (--disagg-role drafter): remote, non-blocking verify.

RemoteVerifyWorker drives VeriCacheRound (speculative/vericache_round.py) with a remote verify step:
the round's drafts go out as a VerifyRun message. Per scheduler decode iteration (step), with
results applied as they arrive:
  - requests with a run in flight are skipped; every other running request takes ONE draft step
    (so results and new requests are handled between steps), and a request whose round is
    drafted sends its VerifyRun right away;
  - when nothing is left to draft, the scheduler waits (poll with a timeout) on the verifier and
    the tokenizer sockets together.
A result's exact KV goes to fresh slots, and the result becomes the round's Verdict (accepted j,
tokens d_1..d_j + the correction, the verifier's logprobs), which VeriCacheRound.commit applies as
it applies a local verification (emit with stop checks, commit, fold, finish).

The drafter's KV (a design choice, with its cost):
  - prompt: prefilled here as in single-instance VeriCache (exact KV in the host tier, folded into
    the compressed tier); the first token comes from that exact prefill, as in full mode. So the
    prompt is prefilled twice (here and on the verifier), and the exact KV stays in this
    instance's host tier (the radix tree's nodes always hold exact KV); drafting reads only the
    compressed pages and a sub-page exact tail.
  - decode: the verifier sends the exact KV of the committed positions with each result
    ((j+1) * kv_bytes_per_token per round, e.g. 20 tokens x 320 KB for a 70B model in bf16), so
    the drafter's tail and folded pages are exactly those of single-instance VeriCache (same
    drafts, same acceptance), and the query-free compressors need nothing else. Query-scored
    compressors (snapkv, pyramidkv, h2o) would need the verify pass's queries too: refused.
Staggering across instances: a request's first round drafts half the usual length in every
other session, so about half the requests verify while the other half draft.

Faults: a session ends in an abort with a clear message when the verifier goes away (silent for
--disagg-timeout seconds) or restarts (new epoch), when the verifier refuses or fails it, or when
the drafter retracts the request (the verifier's copy cannot follow a re-prefill).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from sglang_vericache.constrained.grammar_backend import grammar_key
from sglang_vericache.disagg.messages import CloseSession, OpenSession, Pong, PrefillResult, VerifyResult, VerifyRun
from sglang_vericache.disagg.verifier_link import VerifierLink
from sglang_vericache.mem_cache.storage.throttle import LinkThrottle, ThrottledStore
from sglang_vericache.server_args import ServerArgs, parse_bytes
from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker
from sglang_vericache.speculative.vericache_round import Verdict

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.speculative.vericache_round import VeriCacheRound

logger = logging.getLogger(__name__)

WAIT_MS = 20  # longest wait for a result when every running request has a run in flight


@dataclass(slots=True)
class SessionRound:
    """What the drafter keeps of one session's rounds: num_retractions when the verifier's session
    opened (a retraction since then ends the session), whether the first round drafts half its
    length, and when the round in progress started drafting (None: no round open)."""

    retractions_at_open: int
    half_first_round: bool
    round_started_at: float | None = None


class RemoteVerifyWorker(BaseSpecWorker):
    def __init__(self, args: ServerArgs, round: VeriCacheRound, memory: RequestMemory, running: list[Req],
                 exact_pool, abort: Callable[[Req, str], None], recv_socket=None, prefix_store=None):
        if round.two_tier.needs_queries:
            raise ValueError(
                f"--disagg-role drafter cannot use --kv-compressor {args.kv_compressor}: it scores "
                "pages with the verify pass's queries, which stay on the verifier (use a query-free "
                "compressor: streamingllm, knorm, kivi2, kivi4, int8, fp8)")
        self.args = args
        self.round = round
        self.memory = memory
        self.running = running
        self.exact_pool = exact_pool
        self.abort = abort  # ends a request with an error, wherever it is (Scheduler.abort)
        self.recv_socket = recv_socket  # the tokenizer's: a wait for results wakes for new requests too
        self.prefix_store = prefix_store
        self.link = VerifierLink(args.verifier_addr, args.disagg_timeout, args.disagg_secret)
        self.prefill_results: list[PrefillResult] = []  # for RemotePrefill (disagg/remote_prefill.py)
        self.sessions: dict[str, Req] = {}  # rid -> request holding a session on the verifier
        self.rounds: dict[str, SessionRound] = {}  # rid -> its session's round state
        self.inflight: dict[str, tuple[int, float]] = {}  # rid -> (round id, sent at)
        self.arrived: dict[str, VerifyResult] = {}
        self.round_ids = itertools.count()
        self.num_opened = 0
        self.stagger = True  # every other session's first round drafts half-length (see the docstring)
        # Counters, and (when a list is set here) a trace of (time, event, rids) for tests.
        self.stats = {"draft_forwards": 0, "draft_forwards_while_inflight": 0, "runs_sent": 0,
                      "results_applied": 0, "requests_failed": 0, "round_kv_bytes": 0}
        self.trace: list | None = None
        self.rx_link: LinkThrottle | None = None  # --disagg-bandwidth, made at the first message
        self.wait_for_verifier()

    def wait_for_verifier(self) -> None:
        """At start: up to --disagg-timeout for the verifier's first answer (then requests get 503s
        until it answers), so the two instances may start in either order."""
        deadline = time.monotonic() + self.link.timeout
        while not self.link.up and self.link.refused is None and time.monotonic() < deadline:
            self.link.heartbeat()
            if self.link.sock.poll(50):
                for msg in self.link.recv():
                    self.on_message(msg)
        if not self.link.up and self.link.refused is None:
            logger.warning("verifier at %s has not answered yet; requests are refused until it does",
                           self.link.addr)

    # ------------------------------------------------------------------ sessions

    def open_session(self, req: Req) -> tuple[str, int] | None:
        """At admission: opens req's session on the verifier; (error, HTTP status) if it cannot."""
        if grammar_key(req.sampling_params) is not None:
            return ("constrained decoding (json_schema, regex, ebnf, structural_tag) is not supported in the "
                    "dual-instance mode (--disagg-role drafter)", 400)
        self.poll()
        if self.link.refused is not None:
            return self.link.refused, 503
        if not self.link.up:
            return f"verifier at {self.link.addr} is not reachable", 503
        if self.args.disagg_prefill == "verifier":
            return None  # opened at admission, with the compressed prefix it then has (remote_prefill.py)
        if not self.send_open(req):
            return f"verifier at {self.link.addr} is not reachable", 503
        return None

    def send_open(self, req: Req, kv_from: int | None = None) -> bool:
        """Sends req's OpenSession; False if no connection took it."""
        ok = self.link.send(OpenSession(
            rid=req.rid, input_ids=req.origin_input_ids, sampling_params=req.sampling_params, seed=req.seed,
            return_logprob=req.return_logprob, top_logprobs_num=req.top_logprobs_num,
            epoch=self.link.epoch or 0,
            kv_from=kv_from, logprob_start_len=req.logprob_start_len,
        ))
        if not ok:
            return False
        self.sessions[req.rid] = req
        self.rounds[req.rid] = SessionRound(req.num_retractions, bool(self.stagger and self.num_opened % 2))
        self.num_opened += 1
        return True

    def fail(self, req: Req, message: str) -> None:
        """Ends req with an abort carrying message (now if it waits, at the next step if it runs)."""
        self.forget(req.rid)
        self.stats["requests_failed"] += 1
        if not req.finished:
            self.abort(req, message)

    def forget(self, rid: str) -> None:
        self.sessions.pop(rid, None)
        self.rounds.pop(rid, None)
        self.inflight.pop(rid, None)
        self.arrived.pop(rid, None)

    def fail_all(self, message: str) -> None:
        if self.sessions:
            logger.error("%s: failing %d requests", message, len(self.sessions))
        for req in list(self.sessions.values()):
            self.fail(req, message)

    # ------------------------------------------------------------------ messages

    def poll(self) -> None:
        """Every scheduler step: results, heartbeat, a verifier that went away, sessions to close."""
        for msg in self.link.recv():
            self.on_message(msg)
        if self.link.refused is not None:  # another protocol version: no session can go on
            self.fail_all(self.link.refused)
        if self.link.heartbeat():
            self.fail_all(f"verifier at {self.link.addr} went away (no answer for {self.link.timeout:g} s)")
        self.close_finished()
        for rid, req in list(self.sessions.items()):
            if req.num_retractions != self.rounds[rid].retractions_at_open:
                self.link.send(CloseSession(rid, self.link.epoch or 0))
                self.fail(req, "retracted on the drafter (out of KV memory); the dual-instance mode cannot "
                               "resume a request whose verifier session went ahead of it")

    poll_verifier = poll

    def server_info(self, args: ServerArgs) -> dict:
        disagg = {"role": "drafter", "verifier_addr": args.verifier_addr, "prefill": args.disagg_prefill,
                  "bandwidth": args.disagg_bandwidth}
        return {"disagg": disagg, **super().server_info(args)}

    def close_finished(self) -> None:
        for rid, req in list(self.sessions.items()):
            if req.finished or req.to_abort:
                self.link.send(CloseSession(rid, self.link.epoch or 0))
                self.forget(rid)

    def on_message(self, msg) -> None:
        epoch = msg.epoch
        if self.link.epoch is not None and epoch != self.link.epoch:
            self.fail_all(f"verifier at {self.link.addr} went away (it restarted)")
        if self.link.epoch != epoch:
            logger.info("verifier at %s is up (epoch %d)", self.link.addr, epoch)
        self.link.epoch = epoch
        if isinstance(msg, Pong):
            return
        if isinstance(msg, (PrefillResult, VerifyResult)) and msg.k is not None:
            self.book_rx(msg)
        if isinstance(msg, PrefillResult):
            self.prefill_results.append(msg)
            return
        if not isinstance(msg, VerifyResult):
            logger.warning("drafter got an unknown message %r", type(msg).__name__)
            return
        req = self.sessions.get(msg.rid)
        if req is None:
            return  # a closed or failed session
        if msg.error is not None:
            self.fail(req, msg.error)
        elif self.inflight.get(msg.rid, (None,))[0] == msg.round_id:
            self.arrived[msg.rid] = msg
            self.trace_event("result", [msg.rid])

    def take_prefill_results(self) -> list[PrefillResult]:
        out, self.prefill_results = self.prefill_results, []
        return out

    def book_rx(self, msg) -> None:
        """--disagg-bandwidth: msg's KV is usable once the drafter's link has carried it
        (meta["ready_at"]); the link is the store's when both flags name the same rate."""
        args = self.args
        if args.disagg_bandwidth is None:
            return
        if self.rx_link is None:
            store = self.prefix_store.store if self.prefix_store is not None else None
            same = args.kv_store_bandwidth is not None and (
                parse_bytes(args.kv_store_bandwidth) == parse_bytes(args.disagg_bandwidth))
            self.rx_link = store.link if same and isinstance(store, ThrottledStore) else LinkThrottle(
                parse_bytes(args.disagg_bandwidth, "--disagg-bandwidth"))
        nbytes = 2 * msg.k.numel() * msg.k.element_size()
        msg.meta["ready_at"] = self.rx_link.reserve(nbytes, time.perf_counter())

    def trace_event(self, event: str, rids: list[str]) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), event, rids))

    # ------------------------------------------------------------------ rounds

    def forward_batch_generation(self) -> None:
        r = self.round
        self.memory.make_room(lambda req: r.plan(req) + 1)
        reqs = list(self.running)
        self.apply_arrived()
        live = [req for req in reqs if req.rid in self.sessions and not req.finished and not req.to_abort]
        idle = [req for req in live if req.rid not in self.inflight]
        for req in idle:
            if self.rounds[req.rid].round_started_at is None:
                self.start_round(req)
        drafting = [req for req in idle if r.is_drafting(req)]
        if drafting:
            r.run(drafting=drafting)
            self.stats["draft_forwards"] += 1
            if self.inflight:
                self.stats["draft_forwards_while_inflight"] += 1
            self.trace_event("draft", [req.rid for req in drafting])
        for req in idle:
            if not r.is_drafting(req) and not req.to_abort:
                self.send_run(req)
        if not drafting:  # everyone waits on the verifier: sleep until it (or a new request) speaks
            poller = zmq.Poller()
            poller.register(self.link.sock, zmq.POLLIN)
            if self.recv_socket is not None:
                poller.register(self.recv_socket, zmq.POLLIN)
            poller.poll(WAIT_MS)
            for msg in self.link.recv():
                self.on_message(msg)
            self.apply_arrived()

    def start_round(self, req: Req) -> None:
        st = self.rounds[req.rid]
        x = self.round.plan(req)
        self.round.start(req, x // 2 if st.half_first_round else x)
        st.round_started_at, st.half_first_round = time.perf_counter(), False

    def send_run(self, req: Req) -> None:
        rid, round_id = req.rid, next(self.round_ids)
        tokens = [req.output_ids[-1]] + req.spec.drafts
        run = VerifyRun(rid, round_id, len(req.output_ids), tokens, self.link.epoch or 0)
        if not self.link.send(run):
            self.fail(req, f"verifier at {self.link.addr} went away (not reachable)")
            return
        self.inflight[rid] = (round_id, time.perf_counter())
        self.stats["runs_sent"] += 1
        self.trace_event("send", [rid])

    def apply_arrived(self) -> None:
        """Commits the results that arrived: their exact KV into fresh slots, then each result as
        its round's Verdict through VeriCacheRound.commit."""
        kv = self.exact_pool
        verdicts, draft_s, verify_s = [], 0.0, 0.0
        now = time.perf_counter()
        for rid in list(self.arrived):
            if self.arrived[rid].meta.get("ready_at", 0.0) > now:
                continue  # still crossing the drafter's link (--disagg-bandwidth)
            res, req = self.arrived.pop(rid), self.sessions[rid]
            st = self.rounds[rid]
            t_start, st.round_started_at = st.round_started_at, None
            _, t_sent = self.inflight.pop(rid)
            d, j = req.spec.drafts, res.accepted
            kv_start = req.kv_committed_len
            slots = self.memory.alloc_slots(req, len(d) + 1)
            if slots is None:
                self.fail(req, "the drafter ran out of KV memory")
                continue
            for layer in range(kv.num_layers):
                kv.set_kv_buffer(layer, slots[: j + 1], res.k[layer], res.v[layer])
            self.stats["round_kv_bytes"] += 2 * res.k.numel() * res.k.element_size()
            verdicts.append(Verdict(req, len(d), j, d[:j] + [res.correction], res.logprobs, res.top_logprobs,
                                    kv_start))
            draft_s += t_sent - t_start
            verify_s += time.perf_counter() - t_sent
        if verdicts:
            n = len(verdicts)
            self.stats["results_applied"] += n
            self.round.commit(verdicts, draft_s=draft_s / n, verify_s=verify_s / n)
            self.close_finished()
