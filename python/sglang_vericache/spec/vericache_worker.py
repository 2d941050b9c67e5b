"""VeriCacheWorker: draft over the compressed tier, verify over the exact tier, emit exactly.

One round for a batch of running requests (ARCHITECTURE.md section 3). For each request,
committed tokens t_1..t_n with exact KV for positions [0, n-1):
  draft   x steps of DRAFT_DECODE: feed t_n, d_1, ... at positions n-1, n, ...; attention reads
          the compressed chunks + the exact tail + this round's draft KV (a scratch pool).
  verify  one TARGET_VERIFY pass of [t_n, d_1..d_x] over the exact tier; its exact KV goes to
          freshly allocated exact slots for positions n-1..n-1+x.
  accept  j = longest prefix of drafts equal to the verifier's choices; emit d_1..d_j, p_j,
          cut at the first stop condition (m tokens emitted).
  commit  positions n-1..n-2+m keep their exact KV (kv_committed_len += m); slots past that are
          released; whole committed pages fold into the compressed tier.
Drafter and verifier sample each position with the same counter-based noise, so a seeded
request emits exactly what full mode emits.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.model_executor.forward_batch import DraftContext, ForwardMode
from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow
from sglang_vericache.spec.acceptance import DraftLengthPolicy, accepted_length

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.scheduler import Scheduler


class VeriCacheWorker:
    def __init__(self, scheduler: Scheduler):
        s = scheduler
        self.s = s
        args, mc = s.server_args, s.model_runner.model_config
        self.max_draft = args.max_draft_tokens
        fixed = None if args.speculative_num_draft_tokens == "auto" else self.max_draft
        self.policy = DraftLengthPolicy(fixed, self.max_draft)
        # Scratch KV of the drafts: request row r owns slots [1 + r*(X+1), 1 + (r+1)*(X+1)).
        self.stride = self.max_draft + 1
        self.draft_pool = MHATokenToKVPool(
            num_slots=1 + s.req_to_token_pool.size * self.stride,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=mc.dtype,
            device=s.model_runner.device,
        )

    # ------------------------------------------------------------------ one round

    def run_round(self, reqs: list[Req]) -> None:
        s = self.s
        xs = [self.draft_len(r) for r in reqs]
        t0 = time.perf_counter()
        drafts = self.draft(reqs, xs)
        t1 = time.perf_counter()
        # Exact slots for the verify pass; the scheduler made room before calling us.
        out_loc = []
        for req, d in zip(reqs, drafts):
            slots = s.alloc_slots(req, len(d) + 1)
            assert slots is not None, "verify slots: the scheduler must reserve them before a round"
            out_loc.append(slots)
        logits, captured = self.verify(reqs, drafts, torch.cat(out_loc))
        targets, logprobs, tops = self.sample_targets(reqs, drafts, logits)
        t2 = time.perf_counter()
        row = 0
        for req, d in zip(reqs, drafts):
            n_rows = len(d) + 1
            j = accepted_length(d, targets[row : row + n_rows])
            emitted = d[:j] + [targets[row + j]]
            m = s.append_tokens(req, emitted, logprobs[row : row + n_rows] if logprobs else None,
                                tops, row)
            if captured is not None:
                s.two_tier.record_queries(req, captured, slice(row, row + n_rows), n_keep=m)
            req.kv_committed_len += m
            s.truncate_slots(req, req.kv_committed_len)
            self.account(req, drafted=len(d), accepted=j, draft_s=(t1 - t0) / len(reqs),
                         verify_s=(t2 - t1) / len(reqs))
            row += n_rows
        for req in reqs:
            if not req.finished:
                s.two_tier.fold(req)
        s.finish_round(reqs)

    def draft_len(self, req: Req) -> int:
        ema = req.meta.get("_accept_ema")
        if ema is None:
            ema = req.meta["_accept_ema"] = self.policy.initial_state()
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return max(0, min(self.policy.next_len(ema), left - 1))

    def account(self, req: Req, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        m = req.meta
        m["_accept_ema"] = self.policy.update(m["_accept_ema"], accepted, drafted)
        m["spec_rounds"] = m.get("spec_rounds", 0) + 1
        m["spec_drafted_tokens"] = m.get("spec_drafted_tokens", 0) + drafted
        m["spec_accepted_tokens"] = m.get("spec_accepted_tokens", 0) + accepted
        m["spec_draft_time_s"] = m.get("spec_draft_time_s", 0.0) + draft_s
        m["spec_verify_time_s"] = m.get("spec_verify_time_s", 0.0) + verify_s
        # Tokens emitted per round: accepted drafts + the verifier's token.
        m["spec_accept_length"] = (m["spec_accepted_tokens"] + m["spec_rounds"]) / m["spec_rounds"]
        self.s.metrics.on_spec_round(drafted, accepted)

    # ------------------------------------------------------------------ draft

    def draft(self, reqs: list[Req], xs: list[int]) -> list[list[int]]:
        s = self.s
        drafts: list[list[int]] = [[] for _ in reqs]
        for step in range(max(xs, default=0)):
            active = [i for i, x in enumerate(reqs) if step < xs[i] and not self.draft_stopped(reqs[i], drafts[i])]
            if not active:
                break
            batch = [reqs[i] for i in active]
            input_ids = [drafts[i][-1] if step else reqs[i].output_ids[-1] for i in active]
            positions = [reqs[i].seqlen - 1 + step for i in active]
            draft_slots = [self.draft_slots(reqs[i], step + 1) for i in active]
            out_loc = torch.stack([ds[-1] for ds in draft_slots])
            fb = s.make_forward_batch(ForwardMode.DRAFT_DECODE, [(r, 1) for r in batch], input_ids, positions,
                                      out_loc)
            fb.draft_ctx = s.two_tier.draft_context(batch, self.draft_pool, draft_slots)
            logits = s.model_runner.forward(fb)
            rows = [
                SamplingRow(params=reqs[i].sampling_params, seed=reqs[i].seed,
                            position=len(reqs[i].output_ids) + step,
                            output_ids=reqs[i].output_ids + drafts[i], prompt_ids=reqs[i].origin_input_ids)
                for i in active
            ]
            info = SamplingBatchInfo.from_rows(rows, s.vocab_size, logits.device, s.eos_token_ids)
            for i, tok in zip(active, s.sampler(logits, info).next_token_ids.tolist()):
                drafts[i].append(tok)
        return drafts

    def draft_slots(self, req: Req, n: int) -> torch.Tensor:
        base = 1 + req.req_pool_idx * self.stride
        return torch.arange(base, base + n, dtype=torch.int64)

    def draft_stopped(self, req: Req, d: list[int]) -> bool:
        """No use drafting past a draft that would end the request."""
        if not d:
            return False
        sp = req.sampling_params
        if len(req.output_ids) + len(d) < sp.min_new_tokens:
            return False
        return d[-1] in sp.stop_token_ids or (not sp.ignore_eos and d[-1] in self.s.eos_token_ids)

    # ------------------------------------------------------------------ verify

    def verify(self, reqs: list[Req], drafts: list[list[int]], out_loc: torch.Tensor):
        s = self.s
        batch, input_ids, positions = [], [], []
        for req, d in zip(reqs, drafts):
            n = len(d) + 1
            batch.append((req, n))
            input_ids.extend([req.output_ids[-1]] + d)
            start = req.seqlen - 1
            positions.extend(range(start, start + n))
        fb = s.make_forward_batch(ForwardMode.TARGET_VERIFY, batch, input_ids, positions, out_loc)
        fb.logits_indices = torch.arange(len(input_ids), dtype=torch.int64)
        captured = {} if s.two_tier.needs_queries else None
        fb.captured_q = captured
        return s.model_runner.forward(fb), captured

    def sample_targets(self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor):
        s = self.s
        rows = []
        for req, d in zip(reqs, drafts):
            for i in range(len(d) + 1):
                rows.append(SamplingRow(params=req.sampling_params, seed=req.seed,
                                        position=len(req.output_ids) + i,
                                        output_ids=req.output_ids + d[:i], prompt_ids=req.origin_input_ids))
        info = SamplingBatchInfo.from_rows(rows, s.vocab_size, logits.device, s.eos_token_ids)
        want_lp = any(r.return_logprob for r in reqs)
        top_n = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        out = s.sampler(logits, info, return_logprob=want_lp, top_logprobs_num=top_n)
        lps = out.logprobs.tolist() if want_lp else None
        tops = None
        if top_n:
            vals, idx = out.top_logprobs
            tops = (vals.tolist(), idx.tolist())
        return out.next_token_ids.tolist(), lps, tops
