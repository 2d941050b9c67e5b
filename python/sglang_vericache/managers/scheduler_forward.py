"""SchedulerForwardMixin: the scheduler's forward passes: a prefill (EXTEND) batch and a decode step
in each mode (full, lossy, naive offload; VeriCache modes hand the step to their round's driver),
built into ForwardBatches by model_executor/forward_batch.py's make_forward_batch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang_vericache.model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class SchedulerForwardMixin:
    # ------------------------------------------------------------------ prefill

    def run_extend(self, batch: list[tuple[Req, int]]) -> None:
        """Runs one EXTEND pass: each (req, n) computes the next n positions of req.fill_ids."""
        input_ids, positions, out_loc, logit_rows = [], [], [], []
        row_base = 0
        plan = []  # (req, start, n, input-logprob rows, sample row or None)
        for req, n in batch:
            start = req.kv_committed_len
            fill = req.fill_ids
            slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, start : start + n]
            input_ids.extend(fill[start : start + n])
            positions.extend(range(start, start + n))
            out_loc.append(slots)
            lp_rows = []
            if req.wants_input_logprobs:
                # Row for position j predicts token j+1; wanted for j in [start_len, prompt_len-2].
                lo = max(req.logprob_start_len, start)
                hi = min(len(req.origin_input_ids) - 1, start + n)
                lp_rows = list(range(lo, hi))
            done = start + n == req.prefill_target_len()
            sample_row = start + n - 1 if done else None
            rows = sorted(set(lp_rows + ([sample_row] if sample_row is not None else [])))
            plan.append((req, start, n, lp_rows, sample_row, len(logit_rows), rows))
            logit_rows.extend(row_base + (j - start) for j in rows)
            row_base += n

        fb = make_forward_batch(ForwardMode.EXTEND, batch, input_ids, positions, torch.cat(out_loc))
        fb.logits_indices = torch.tensor(logit_rows, dtype=torch.int64)
        tt = self.two_tier
        if tt is not None and tt.keeps_queries([r for r, _ in batch]):
            fb.captured_q = {}
        t0 = time.perf_counter()
        logits = self.forward(fb, "prefill")  # zero rows when only KV is wanted (a middle chunk)
        if self.spec_worker is not None:  # adaptive VeriCache's cost fit
            self.spec_worker.observe_prefill([(start, n) for _, start, n, *_ in plan], time.perf_counter() - t0)

        to_sample = []
        token_row = 0
        for req, start, n, lp_rows, sample_row, base, rows in plan:
            req.kv_committed_len = start + n
            if self.two_tier is not None:
                if fb.captured_q is not None:
                    self.two_tier.record_queries(req, fb.captured_q, slice(token_row, token_row + n))
                token_row += n
                if not self.two_tier.fold(req, prefilling=sample_row is None):  # admission reserves; safety net
                    logger.warning("compressed tier full: requeueing %s", req.rid)
                    self.queues.end_chunked(req)
                    self.memory.retract(req)
                    self.prefill_adder.back_off()
                    continue
            self.metrics.num_prompt_tokens_total += n
            if lp_rows:
                self.collect_input_logprobs(req, logits[base : base + len(rows)], rows, lp_rows)
            if sample_row is None:
                self.queues.set_chunked(req)
                continue
            self.queues.end_chunked(req)
            req.input_logprobs_done = True
            if self.prefix_store is not None:  # KV store write-through: once, when the prefill completes
                self.prefix_store.write_through(req)
            if req.sampling_params.max_new_tokens == 0:
                req.finished_reason = {"type": "length", "length": 0}
                self.output.release(req)
                continue
            self.tree_cache.cache_unfinished_req(req)
            to_sample.append((req, logits[base + rows.index(sample_row)]))
        if to_sample:
            self.sample_and_append([r for r, _ in to_sample], torch.stack([lg for _, lg in to_sample]))

    # ------------------------------------------------------------------ decode

    def run_decode(self) -> None:
        if self.spec_worker is not None:  # VeriCache: the round's driver makes its own room
            self.spec_worker.forward_batch_generation()
            return
        self.memory.make_room(lambda r: 1)
        if self.mode == "lossy":
            self.lossy_decode_step(list(self.running))
            return
        # Naive offload streams each group's whole exact context from the host at every step.
        for reqs in [list(self.running)] if self.link is None else self.link.split(list(self.running)):
            self.decode_step(reqs)

    def decode_step(self, reqs: list[Req]) -> None:
        out_loc = []
        for req in reqs:
            slots = self.memory.alloc_slots(req, 1)
            assert slots is not None, "a lone request outgrew the KV pool; admission should prevent this"
            out_loc.append(slots)
        input_ids = [r.output_ids[-1] for r in reqs]
        positions = [r.seqlen - 1 for r in reqs]
        batch = [(r, 1) for r in reqs]
        fb = make_forward_batch(ForwardMode.DECODE, batch, input_ids, positions, torch.cat(out_loc))
        if self.link is not None:
            fb.staged = self.link.staged(reqs)
        logits = self.forward(fb, "decode")
        for req in reqs:
            req.kv_committed_len += 1
        self.sample_and_append(reqs, logits)

    def lossy_decode_step(self, reqs: list[Req]) -> None:
        """One decode step from the compressed tier alone (the baseline VeriCache must beat):
        the new token's KV joins the tail and is folded like exact KV."""
        tt = self.two_tier
        out_loc = [self.memory.alloc_slots(r, 1) for r in reqs]
        fb = make_forward_batch(ForwardMode.DRAFT_DECODE, [(r, 1) for r in reqs],
                                [r.output_ids[-1] for r in reqs], [r.seqlen - 1 for r in reqs],
                                torch.cat(out_loc))
        fb.draft_ctx = tt.draft_context(reqs, new_kv="exact")
        fb.captured_q = {} if tt.needs_queries else None
        logits = self.forward(fb, "lossy")
        for i, r in enumerate(reqs):
            r.kv_committed_len += 1
            if fb.captured_q is not None:
                tt.record_queries(r, fb.captured_q, slice(i, i + 1))
            tt.fold(r)
        self.sample_and_append(reqs, logits)

    # ------------------------------------------------------------------ shared

    def forward(self, fb: ForwardBatch, tag: str) -> torch.Tensor:
        """One model forward; with a timeline attached, its compute interval is recorded."""
        if self.timeline is None:
            return self.model_runner.forward(fb)
        t0 = time.perf_counter()
        logits = self.model_runner.forward(fb)
        self.timeline.append((t0, time.perf_counter(), tag))
        return logits

