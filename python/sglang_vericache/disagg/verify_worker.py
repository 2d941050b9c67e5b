"""VerifyWorker: the verifier's side of dual-instance VeriCache rounds, on the BaseSpecWorker
interface (speculative/base_spec_worker.py); VerifierServer (verifier.py) owns the sessions and the
socket, and installs this worker on its full-mode scheduler.

forward_batch_generation: every prefilled session with a pending VerifyRun, in ONE TARGET_VERIFY
forward of the scheduler's VeriCacheRound (speculative/vericache_round.py): the same verify inputs,
target sampling (seed/positions/penalties as the drafter and as full mode), acceptance and commit
as a single instance's round; the KV of t_n, d_1..d_j is committed and sent back in a VerifyResult,
the rejected slots freed. A run out of sync with the verifier's copy, or one the pool cannot hold
(verifying frees nothing, so waiting could hang), fails its session's round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from sglang_vericache.disagg.messages import VerifyResult
from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker

if TYPE_CHECKING:
    from sglang_vericache.disagg.verifier import Session
    from sglang_vericache.managers.scheduler import Scheduler
    from sglang_vericache.server_args import ServerArgs


class VerifyWorker(BaseSpecWorker):
    def __init__(self, sched: Scheduler, sessions: dict[str, Session], epoch: int, addr: str,
                 send: Callable[[bytes, object], None], fail: Callable[[bytes, str, int, str], None],
                 stats: dict):
        self.round = sched.round
        self.running = sched.running
        self.allocator = sched.allocator
        self.tree_cache = sched.tree_cache
        self.page_size = sched.page_size
        self.req_to_token = sched.req_to_token_pool.req_to_token
        self.kv = sched.model_runner.token_to_kv_pool
        self.take_chunked = lambda: sched.chunked_req
        self.sessions = sessions
        self.epoch, self.addr = epoch, addr
        self.send, self.fail = send, fail
        self.stats = stats  # the server's: verify_forwards, runs_verified

    def server_info(self, args: ServerArgs) -> dict:
        return {}  # the verifier answers drafters, not /server_info

    def ready_sessions(self) -> list[Session]:
        chunked = self.take_chunked()
        return [x for x in self.sessions.values()
                if x.pending is not None and x.req in self.running and x.req is not chunked]

    def forward_batch_generation(self) -> None:
        ready = self.ready_sessions()
        if ready:
            self.verify(ready)

    def verify(self, ready: list[Session]) -> None:
        group: list[Session] = []
        need = 0
        for sess in ready:
            run, req = sess.pending, sess.req
            if req.finished or len(req.output_ids) != run.output_len or req.output_ids[-1] != run.tokens[0]:
                sess.pending = None
                self.fail(sess.drafter, sess.rid, run.round_id,
                          f"drafter and verifier are out of sync at output token {run.output_len} "
                          f"(the verifier has {len(req.output_ids)} tokens)")
                continue
            n = self.allocator.pages_needed(req.kv_allocated_len, len(run.tokens))
            short = (need + n) * self.page_size - self.allocator.available_size()
            if short > 0:
                self.tree_cache.evict(short)
            if (need + n) * self.page_size > self.allocator.available_size():
                # Verifying frees nothing (only closed sessions do), so waiting could hang: fail it.
                sess.pending = None
                self.fail(sess.drafter, sess.rid, run.round_id,
                          f"the verifier at {self.addr} is out of KV memory "
                          f"({len(self.sessions)} open sessions)")
                continue
            need += n
            group.append(sess)
        if not group:
            return
        for sess in group:
            sess.req.spec.start(len(sess.pending.tokens) - 1)
            sess.req.spec.drafts = list(sess.pending.tokens[1:])
        verdicts = self.round.run(resident=[x.req for x in group])
        self.stats["verify_forwards"] += 1
        kv = self.kv
        for sess, v in zip(group, verdicts):
            run, req, m = sess.pending, sess.req, v.accepted + 1
            slots = self.req_to_token[req.req_pool_idx, v.kv_start : v.kv_start + m]
            res = VerifyResult(
                rid=sess.rid, round_id=run.round_id, epoch=self.epoch, accepted=v.accepted,
                correction=v.correction,
                k=torch.stack([kv.k_buffer[layer][slots] for layer in range(kv.num_layers)]),
                v=torch.stack([kv.v_buffer[layer][slots] for layer in range(kv.num_layers)]),
            )
            if req.return_logprob:
                res.logprobs = v.logprobs[:m]
                if req.top_logprobs_num:
                    res.top_logprobs = (v.top_logprobs[0][:m], v.top_logprobs[1][:m])
            sess.pending = None
            self.stats["runs_verified"] += 1
            self.send(sess.drafter, res)
