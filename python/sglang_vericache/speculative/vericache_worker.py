"""VeriCacheWorker: draft over the compressed tier, verify over the exact tier, emit exactly.

One round of a request (ARCHITECTURE.md section 3), committed tokens t_1..t_n, exact KV for
positions [0, n-1):
  draft   x DRAFT_DECODE steps: feed t_n, d_1, ... at positions n-1, n, ...; attention reads
          the compressed chunks + the exact tail + this round's draft KV (a scratch pool);
  verify  one TARGET_VERIFY pass of [t_n, d_1..d_x] over the exact tier, whose exact KV goes to
          fresh exact slots of positions n-1..n-1+x;
  accept  j = longest prefix of drafts equal to the verifier's choices; emit d_1..d_j, p_j, cut
          at the first stop condition (m tokens emitted);
  commit  positions n-1..n-2+m keep their exact KV (kv_committed_len += m), the slots past them
          are released, and whole committed pages fold into the compressed tier.
Drafter and verifier sample each position with the same counter-based noise, so a seeded
request emits exactly what full mode emits.

`run_round` runs rounds in lock-step (everyone drafts, then everyone verifies). The building
blocks (draft_inputs/after_draft, verify_inputs/after_verify) are shared with the staggered
schedule, which mixes drafting and verifying requests in one forward.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.constrained.grammar import vocab_mask
from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow
from sglang_vericache.speculative.acceptance import DraftLengthPolicy, accepted_length

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
            dtype=s.model_runner.token_to_kv_pool.dtype,
            device=s.model_runner.device,
        )

    # ------------------------------------------------------------------ lock-step rounds

    def run_round(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.start_round(req)
        t0 = time.perf_counter()
        while True:
            group = [r for r in reqs if self.is_drafting(r)]
            if not group:
                break
            fb = self.draft_batch(group)
            self.after_draft(group, self.s.forward(fb, "draft"))
        t1 = time.perf_counter()
        link = self.s.link
        # With a link, exact KV streams from the host tier in groups that fit the staging area.
        for group in [reqs] if link is None else link.split(reqs):
            t = time.perf_counter()
            fb, captured = self.verify_batch(group)
            if link is not None:
                fb.staged = link.staged(group)
            logits = self.s.forward(fb, "verify")
            self.after_verify(group, logits, captured, draft_s=(t1 - t0) / len(reqs),
                              verify_s=(time.perf_counter() - t) / len(group))

    def start_round(self, req: Req) -> None:
        req.drafts = []
        req.draft_masks = []
        req.draft_target = self.draft_len(req)

    def is_drafting(self, req: Req) -> bool:
        return len(req.drafts) < req.draft_target and not self.draft_stopped(req)

    def draft_len(self, req: Req) -> int:
        ema = req.meta.get("_accept_ema")
        if ema is None:
            ema = req.meta["_accept_ema"] = self.policy.initial_state()
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        return max(0, min(self.policy.next_len(ema), left - 1))

    def draft_stopped(self, req: Req) -> bool:
        """No use drafting past a draft that would end the request."""
        d = req.drafts
        if not d:
            return False
        sp = req.sampling_params
        if len(req.output_ids) + len(d) < sp.min_new_tokens:
            return False
        if req.grammar is not None and req.grammar.terminated:
            return True
        return d[-1] in sp.stop_token_ids or (not sp.ignore_eos and d[-1] in self.s.eos_token_ids)

    # ------------------------------------------------------------------ draft step

    def draft_inputs(self, group: list[Req]):
        """(batch items, input ids, positions, out slots in the draft pool, draft slots per req)."""
        input_ids = [r.drafts[-1] if r.drafts else r.output_ids[-1] for r in group]
        positions = [r.seqlen - 1 + len(r.drafts) for r in group]
        draft_slots = [self.draft_slots(r, len(r.drafts) + 1) for r in group]
        out_loc = torch.stack([ds[-1] for ds in draft_slots])
        return [(r, 1) for r in group], input_ids, positions, out_loc, draft_slots

    def draft_batch(self, group: list[Req]):
        s = self.s
        items, input_ids, positions, out_loc, draft_slots = self.draft_inputs(group)
        fb = s.make_forward_batch(ForwardMode.DRAFT_DECODE, items, input_ids, positions, out_loc)
        fb.draft_ctx = s.two_tier.draft_context(group, self.draft_pool, draft_slots)
        return fb

    def after_draft(self, group: list[Req], logits: torch.Tensor) -> None:
        s = self.s
        rows = [
            SamplingRow(params=r.sampling_params, seed=r.seed, position=len(r.output_ids) + len(r.drafts),
                        output_ids=r.output_ids + r.drafts, prompt_ids=r.origin_input_ids)
            for r in group
        ]
        info = SamplingBatchInfo.from_rows(rows, s.vocab_size, logits.device, s.eos_token_ids)
        masks = [r.grammar and r.grammar.next_bitmask() for r in group]
        info.vocab_mask = vocab_mask(masks, s.vocab_size)
        for r, tok, mask in zip(group, s.sampler(logits, info).next_token_ids.tolist(), masks):
            if r.grammar is not None:
                if not r.grammar.accept(tok):  # nothing allowed: stop drafting, verify decides
                    r.draft_target = len(r.drafts)
                    continue
                r.draft_masks.append(mask)  # the verifier's row for this draft uses the same mask
            r.drafts.append(tok)

    def draft_slots(self, req: Req, n: int) -> torch.Tensor:
        base = 1 + req.req_pool_idx * self.stride
        return torch.arange(base, base + n, dtype=torch.int64)

    # ------------------------------------------------------------------ verify

    def verify_inputs(self, group: list[Req]):
        """(batch items, input ids, positions, fresh exact slots) for [t_n, drafts] of each request.
        The scheduler made room for len(drafts)+1 slots per request before the round."""
        items, input_ids, positions, out_loc = [], [], [], []
        for req in group:
            n = len(req.drafts) + 1
            slots = self.s.alloc_slots(req, n)
            assert slots is not None, "verify slots: the scheduler reserves them before a round"
            items.append((req, n))
            input_ids.extend([req.output_ids[-1]] + req.drafts)
            positions.extend(range(req.seqlen - 1, req.seqlen - 1 + n))
            out_loc.append(slots)
        return items, input_ids, positions, torch.cat(out_loc)

    def verify_batch(self, group: list[Req]):
        s = self.s
        items, input_ids, positions, out_loc = self.verify_inputs(group)
        fb = s.make_forward_batch(ForwardMode.TARGET_VERIFY, items, input_ids, positions, out_loc)
        fb.logits_indices = torch.arange(len(input_ids), dtype=torch.int64)
        captured = {} if s.two_tier.needs_queries else None
        fb.captured_q = captured
        return fb, captured

    def after_verify(self, group: list[Req], logits: torch.Tensor, captured: dict | None,
                     draft_s: float = 0.0, verify_s: float = 0.0, q_row0: int = 0) -> None:
        """Accepts, emits and commits each request's round; logits rows = [t_n, drafts] per request.
        q_row0: the first verify token's row in `captured` (after any draft rows of a mixed batch)."""
        s = self.s
        targets, logprobs, tops = self.sample_targets(group, logits)
        row = 0
        for req in group:
            d = req.drafts
            n_rows = len(d) + 1
            j = accepted_length(d, targets[row : row + n_rows])
            emitted = d[:j] + [targets[row + j]]
            dead_end = False
            if req.grammar is not None:  # back to the accepted prefix, then the verifier's token
                req.grammar.rollback(len(d) - j)
                if not req.grammar.terminated and not req.grammar.accept(targets[row + j]):
                    emitted, dead_end = d[:j], True
            m = s.append_tokens(req, emitted, logprobs[row : row + n_rows] if logprobs else None, tops, row)
            if dead_end and not req.finished:
                s.grammar_dead_end(req)
            if captured is not None:
                s.two_tier.record_queries(req, captured, slice(q_row0 + row, q_row0 + row + n_rows), n_keep=m)
            req.kv_committed_len += m
            s.truncate_slots(req, req.kv_committed_len)
            self.account(req, drafted=len(d), accepted=j, draft_s=draft_s, verify_s=verify_s)
            req.drafts = []
            req.draft_masks = []
            row += n_rows
        for req in group:
            if not req.finished:
                s.two_tier.fold(req)
        s.finish_round(group)

    def sample_targets(self, group: list[Req], logits: torch.Tensor):
        s = self.s
        rows = [
            SamplingRow(params=r.sampling_params, seed=r.seed, position=len(r.output_ids) + i,
                        output_ids=r.output_ids + r.drafts[:i], prompt_ids=r.origin_input_ids)
            for r in group
            for i in range(len(r.drafts) + 1)
        ]
        info = SamplingBatchInfo.from_rows(rows, s.vocab_size, logits.device, s.eos_token_ids)
        info.vocab_mask = vocab_mask(
            [m for r in group for m in (r.draft_masks + [r.grammar.next_bitmask()] if r.grammar else
                                        [None] * (len(r.drafts) + 1))],
            s.vocab_size,
        )
        want_lp = any(r.return_logprob for r in group)
        top_n = max((r.top_logprobs_num for r in group if r.return_logprob), default=0)
        out = s.sampler(logits, info, return_logprob=want_lp, top_logprobs_num=top_n)
        lps = out.logprobs.tolist() if want_lp else None
        tops = None
        if top_n:
            vals, idx = out.top_logprobs
            tops = (vals.tolist(), idx.tolist())
        return out.next_token_ids.tolist(), lps, tops

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
