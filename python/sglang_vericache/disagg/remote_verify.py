"""The drafter side of dual-instance VeriCache (--disagg-role drafter): remote, non-blocking verify.

RemoteVerifyWorker is a VeriCacheWorker whose verify step is a VerifyRun message. Per scheduler
decode iteration (run_round), with results applied as they arrive:
  - requests with a run in flight are skipped; every other running request takes ONE draft step
    (so results and new requests are handled between steps), and a request whose round is
    drafted sends its VerifyRun right away;
  - when nothing is left to draft, the scheduler waits (poll with a timeout) on the verifier and
    the tokenizer sockets together.
A result is applied with VeriCacheWorker.after_verify itself (accept, emit with stop checks,
commit, fold, finish): sample_targets is replaced by the verifier's answer, rebuilt as a target
row per draft ([d_1..d_j, p_j, p_j...], whose accepted length is j because p_j != d_{j+1}).

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
from typing import TYPE_CHECKING

import zmq

from sglang_vericache.constrained.grammar_backend import grammar_key
from sglang_vericache.disagg.messages import CloseSession, OpenSession, Pong, PrefillResult, VerifyResult, VerifyRun
from sglang_vericache.disagg.verifier_link import VerifierLink
from sglang_vericache.mem_cache.storage.throttle import LinkThrottle, ThrottledStore
from sglang_vericache.server_args import parse_bytes
from sglang_vericache.speculative.vericache_worker import VeriCacheWorker

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

WAIT_MS = 20  # longest wait for a result when every running request has a run in flight


class RemoteVerifyWorker(VeriCacheWorker):
    def __init__(self, scheduler: Scheduler):
        super().__init__(scheduler)
        s = scheduler
        if s.two_tier.needs_queries:
            raise ValueError(
                f"--disagg-role drafter cannot use --kv-compressor {s.server_args.kv_compressor}: it scores "
                "pages with the verify pass's queries, which stay on the verifier (use a query-free "
                "compressor: streamingllm, knorm, kivi2, kivi4, int8, fp8)")
        self.link = VerifierLink(s.server_args.verifier_addr, s.server_args.disagg_timeout,
                                 s.server_args.disagg_secret)
        self.sessions: dict[str, Req] = {}  # rid -> request holding a session on the verifier
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
        self.poll_verifier()
        if self.link.refused is not None:
            return self.link.refused, 503
        if not self.link.up:
            return f"verifier at {self.link.addr} is not reachable", 503
        if self.s.server_args.disagg_prefill == "verifier":
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
        req.meta["_retractions"] = req.num_retractions
        req.meta["_first_round"] = self.stagger and self.num_opened % 2
        self.num_opened += 1
        return True

    def fail(self, req: Req, message: str) -> None:
        """Ends req with an abort carrying message (now if it waits, at the next step if it runs)."""
        s = self.s
        self.forget(req.rid)
        self.stats["requests_failed"] += 1
        if req.finished:
            return
        if req in s.waiting_queue:
            s.waiting_queue.remove(req)
            if req.req_pool_idx is not None:
                s.tree_cache.cache_finished_req(req)
            req.finished_reason = {"type": "abort", "message": message}
            s.emit(req)
        else:
            req.to_abort = message  # running or chunked: Scheduler.drop_aborted releases it

    def forget(self, rid: str) -> None:
        self.sessions.pop(rid, None)
        self.inflight.pop(rid, None)
        self.arrived.pop(rid, None)

    def fail_all(self, message: str) -> None:
        if self.sessions:
            logger.error("%s: failing %d requests", message, len(self.sessions))
        for req in list(self.sessions.values()):
            self.fail(req, message)

    # ------------------------------------------------------------------ messages

    def poll_verifier(self) -> None:
        """Every scheduler step: results, heartbeat, a verifier that went away, sessions to close."""
        for msg in self.link.recv():
            self.on_message(msg)
        if self.link.refused is not None:  # another protocol version: no session can go on
            self.fail_all(self.link.refused)
        if self.link.heartbeat():
            self.fail_all(f"verifier at {self.link.addr} went away (no answer for {self.link.timeout:g} s)")
        self.close_finished()
        for rid, req in list(self.sessions.items()):
            if req.num_retractions != req.meta["_retractions"]:
                self.link.send(CloseSession(rid, self.link.epoch or 0))
                self.fail(req, "retracted on the drafter (out of KV memory); the dual-instance mode cannot "
                               "resume a request whose verifier session went ahead of it")

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
            if self.s.remote_prefill is not None:
                self.s.remote_prefill.on_message(msg)
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

    def book_rx(self, msg) -> None:
        """--disagg-bandwidth: msg's KV is usable once the drafter's link has carried it
        (meta["ready_at"]); the link is the store's when both flags name the same rate."""
        args = self.s.server_args
        if args.disagg_bandwidth is None:
            return
        if self.rx_link is None:
            store = self.s.prefix_store.store if self.s.prefix_store is not None else None
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

    def run_round(self, reqs: list[Req]) -> None:
        s = self.s
        self.apply_arrived()
        live = [r for r in reqs if r.rid in self.sessions and not r.finished and not r.to_abort]
        idle = [r for r in live if r.rid not in self.inflight]
        for r in idle:
            if "_round" not in r.meta:
                self.start_round(r)
        drafting = [r for r in idle if self.is_drafting(r)]
        if drafting:
            fb = self.draft_batch(drafting)
            self.after_draft(drafting, s.forward(fb, "draft"))
            self.stats["draft_forwards"] += 1
            if self.inflight:
                self.stats["draft_forwards_while_inflight"] += 1
            self.trace_event("draft", [r.rid for r in drafting])
        for r in idle:
            if not self.is_drafting(r) and not r.to_abort:
                self.send_run(r)
        if not drafting:  # everyone waits on the verifier: sleep until it (or a new request) speaks
            poller = zmq.Poller()
            poller.register(self.link.sock, zmq.POLLIN)
            if s.recv_socket is not None:
                poller.register(s.recv_socket, zmq.POLLIN)
            poller.poll(WAIT_MS)
            for msg in self.link.recv():
                self.on_message(msg)
            self.apply_arrived()

    def start_round(self, req: Req) -> None:
        super().start_round(req)
        req.meta["_round"] = time.perf_counter()
        if req.meta.pop("_first_round", 0):
            req.draft_target = req.draft_target // 2

    def send_run(self, req: Req) -> None:
        rid, round_id = req.rid, next(self.round_ids)
        tokens = [req.output_ids[-1]] + req.drafts
        run = VerifyRun(rid, round_id, len(req.output_ids), tokens, self.link.epoch or 0)
        if not self.link.send(run):
            self.fail(req, f"verifier at {self.link.addr} went away (not reachable)")
            return
        self.inflight[rid] = (round_id, time.perf_counter())
        self.stats["runs_sent"] += 1
        self.trace_event("send", [rid])

    def apply_arrived(self) -> None:
        """Applies the results that arrived, with after_verify (exact KV written to fresh slots first)."""
        s = self.s
        group, draft_s, verify_s = [], 0.0, 0.0
        kv = s.model_runner.token_to_kv_pool
        now = time.perf_counter()
        for rid in list(self.arrived):
            if self.arrived[rid].meta.get("ready_at", 0.0) > now:
                continue  # still crossing the drafter's link (--disagg-bandwidth)
            res, req = self.arrived.pop(rid), self.sessions[rid]
            t_start = req.meta.pop("_round")
            _, t_sent = self.inflight.pop(rid)
            m = res.accepted + 1
            slots = s.alloc_slots(req, len(req.drafts) + 1)
            if slots is None:
                self.fail(req, "the drafter ran out of KV memory")
                continue
            for layer in range(kv.num_layers):
                kv.set_kv_buffer(layer, slots[:m], res.k[layer], res.v[layer])
            self.stats["round_kv_bytes"] += 2 * res.k.numel() * res.k.element_size()
            req.meta["_result"] = res
            group.append(req)
            draft_s += t_sent - t_start
            verify_s += time.perf_counter() - t_sent
        if group:
            self.stats["results_applied"] += len(group)
            self.after_verify(group, None, None, draft_s=draft_s / len(group), verify_s=verify_s / len(group))
            self.close_finished()

    def sample_targets(self, group: list[Req], logits):
        """The verifier's answers as after_verify's target rows (logits is None here)."""
        targets, lps, vals, idx = [], [], [], []
        for r in group:
            res: VerifyResult = r.meta.pop("_result")
            d, j, n_rows = r.drafts, res.accepted, len(r.drafts) + 1
            targets += d[:j] + [res.correction] * (n_rows - j)
            lps += (res.logprobs or []) + [0.0] * (n_rows - len(res.logprobs or []))
            tv, ti = res.top_logprobs or ([], [])
            vals += list(tv) + [[]] * (n_rows - len(tv))
            idx += list(ti) + [[]] * (n_rows - len(ti))
        want_lp = any(r.return_logprob for r in group)
        want_top = any(r.return_logprob and r.top_logprobs_num for r in group)
        return targets, (lps if want_lp else None), ((vals, idx) if want_top else None)
