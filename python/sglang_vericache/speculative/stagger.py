"""Staggered VeriCache (the paper's P1): in every iteration the drafting requests take one draft
step while the few whose booked verification iteration has come verify, in ONE mixed forward;
the verifiers' exact KV streams over the link layer by layer during that forward.

When a request starts a round it books its verification iteration in the reservation rings
(speculative/reservations.py): the first iteration at least x away (x = its draft length) whose link
bytes (bandwidth x iteration time) and staging rows still have room for its exact KV; it drafts
until then. So the link moves roughly one iteration's worth of exact KV per iteration, overlapped
with the compute of everyone else's drafting, instead of everyone drafting and then everyone
waiting on the link (lock-step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.speculative.reservations import VerifyReservations

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.scheduler import Scheduler

ITER_TIME_EMA = 0.2
INITIAL_ITER_TIME_S = 0.02


class StaggeredVeriCache:
    def __init__(self, scheduler: Scheduler):
        s = scheduler
        self.s = s
        self.worker = s.spec_worker
        self.link = s.link
        self.iter_time = INITIAL_ITER_TIME_S
        horizon = 2 * s.server_args.max_draft_tokens + 2
        self.rings = VerifyReservations(horizon, self.link_bytes_per_iter(), self.link.max_tokens)

    def link_bytes_per_iter(self) -> float:
        bw = self.link.bandwidth
        return float("inf") if bw is None else bw * self.iter_time

    # ------------------------------------------------------------------ bookings

    def book(self, req: Req) -> None:
        """Starts req's round: books its verification iteration, and drafts until then."""
        w = self.worker
        x = w.draft_len(req)
        n = req.kv_committed_len
        nbytes = self.link.bytes_for(n)
        at = self.rings.reserve(x, nbytes, n)
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        req.drafts = []
        req.draft_target = max(0, min(at - self.rings.iteration, w.max_draft, left - 1))
        req.meta["_booking"] = (at, nbytes, n)

    def cancel(self, req: Req) -> None:
        booking = req.meta.pop("_booking", None)
        if booking is not None:
            self.rings.cancel(*booking)

    def verifies_now(self, req: Req) -> bool:
        return req.meta["_booking"][0] <= self.rings.iteration

    # ------------------------------------------------------------------ one iteration

    def step(self) -> None:
        s, w = self.s, self.worker
        for req in s.running:
            if "_booking" not in req.meta:
                self.book(req)
        # The verifiers need len(drafts)+1 exact slots each; retraction may drop requests.
        s.make_room(lambda r: len(r.drafts) + 1 if self.verifies_now(r) else 0)
        verifiers = [r for r in s.running if self.verifies_now(r)]
        if verifiers:  # over-budget bookings (past the horizon) wait one more iteration
            verifiers, late = self.link.split(verifiers)[0], self.link.split(verifiers)[1:]
            for r in (r for group in late for r in group):
                self.cancel(r)
                n = r.kv_committed_len
                r.meta["_booking"] = (self.rings.reserve(1, self.link.bytes_for(n), n), self.link.bytes_for(n), n)
        drafting = [r for r in s.running if not self.verifies_now(r) and w.is_drafting(r)]
        if not verifiers and not drafting:
            self.rings.advance()  # everyone waits for its booked iteration (idle link budget)
            return
        t0 = time.perf_counter()
        fb, captured = self.mixed_batch(drafting, verifiers)
        logits = s.forward(fb, "mixed" if drafting and verifiers else ("draft" if drafting else "verify"))
        nd = len(drafting)
        if drafting:
            w.after_draft(drafting, logits[:nd])
        if verifiers:
            for r in verifiers:
                del r.meta["_booking"]
            w.after_verify(verifiers, logits[nd:], captured, q_row0=nd)
        self.iter_time = (1 - ITER_TIME_EMA) * self.iter_time + ITER_TIME_EMA * (time.perf_counter() - t0)
        self.rings.set_link_budget(self.link_bytes_per_iter())
        self.rings.advance()

    def mixed_batch(self, drafting: list[Req], verifiers: list[Req]):
        s, w = self.s, self.worker
        items, input_ids, positions, out_loc, prefix = [], [], [], [], []
        if drafting:
            d_items, d_ids, d_pos, d_loc, draft_slots = w.draft_inputs(drafting)
            items += d_items
            input_ids += d_ids
            positions += d_pos
            out_loc.append(d_loc)
            prefix += d_pos  # a draft row's logical prefix is its position
        if verifiers:
            v_items, v_ids, v_pos, v_loc = w.verify_inputs(verifiers)
            items += v_items
            input_ids += v_ids
            positions += v_pos
            out_loc.append(v_loc)
            prefix += [r.kv_committed_len for r in verifiers]
        mode = ForwardMode.MIXED if drafting and verifiers else (
            ForwardMode.DRAFT_DECODE if drafting else ForwardMode.TARGET_VERIFY)
        out_loc = torch.cat([loc.to(out_loc[-1].device) for loc in out_loc])  # draft slots: host
        fb = s.make_forward_batch(mode, items, input_ids, positions, out_loc, prefix_lens=prefix)
        if drafting:
            fb.draft_ctx = s.two_tier.draft_context(drafting, w.draft_pool, draft_slots)
        if verifiers:
            fb.staged = self.link.staged(verifiers)
            fb.logits_indices = torch.arange(len(input_ids), dtype=torch.int64)
        captured = {} if verifiers and s.two_tier.needs_queries else None
        fb.captured_q = captured
        return fb, captured
