"""VeriCacheRound: one VeriCache round, in one place (ARCHITECTURE.md section 3).

A request's round, committed tokens t_1..t_n, exact KV for positions [0, n-1):
  plan    plan(req) -> x, the draft length (DraftLengthPolicy, cut to the tokens left); start(req, x).
  draft   x DRAFT_DECODE rows: feed t_n, d_1, ... at positions n-1, n, ...; attention reads the
          compressed chunks + the exact tail + this round's draft KV (a scratch pool, one row of
          X+1 slots per request row); each draft is sampled under its grammar's mask.
          --speculative-ngram: a draft forward of a request may also hold k n-gram proposals q_1..q_k
          (speculative/ngram.py) as a causal chain of rows after its last token; row i is sampled
          exactly as the i-th next draft step would be, and the drafts gain the samples up to the
          first that differs from its proposal (that one included): up to k+1 drafts in one forward.
  verify  one row group [t_n, d_1..d_x] over the exact KV of [0, n-1), whose own exact KV goes to
          fresh exact slots of positions n-1..n-1+x; the targets p_0..p_x are sampled as full mode
          samples those positions (same seed, position, penalties, and the drafts' masks).
  accept  j = longest prefix of drafts equal to the targets -> Verdict: emit d_1..d_j, p_j, with
          their logprob rows.
  commit  emit through the output sink, which cuts at the first stop (m tokens); grammar rollback;
          the kept queries; kv_committed_len += m and the slots past it released; stats; whole
          committed pages fold into the compressed tier; finished requests are released.
Drafter and verifier sample each position with the same counter-based noise, so a seeded request
emits exactly what full mode emits. A round with x = 0 is a plain decode row: one verify row whose
target is the token full mode samples there.

One forward (`run`) holds, in this order, draft rows, verify rows whose exact KV is read from the
pool (`resident`) and verify rows whose exact KV streams over the link (`staged`, mem_cache/link.py);
which verifier is which is its driver's choice, per request. The drivers are the BaseSpecWorkers
(speculative/base_spec_worker.py): lock-step, the RoundLoop's staggered and adaptive plans, the
remote drafter (a VerifyResult becomes a Verdict and goes through the same commit) and the verifier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_vericache.constrained.grammar import vocab_mask
from sglang_vericache.layers.sampler import sample_with_logprobs
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.model_executor.forward_batch import ForwardBatch, ForwardMode, make_forward_batch
from sglang_vericache.sampling.sampling_batch_info import SamplingBatchInfo, SamplingRow
from sglang_vericache.speculative.acceptance import DraftLengthPolicy, accepted_length, draft_len
from sglang_vericache.speculative.ngram import NgramConfig, chain_masks, chain_proposals

if TYPE_CHECKING:
    from sglang_vericache.layers.sampler import Sampler
    from sglang_vericache.managers.output_sink import OutputSink
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.managers.stats import SchedulerMetrics
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.mem_cache.two_tier import TwoTierKV


@dataclass(frozen=True)
class Targets:
    """The verifier's choice at every verify row of a batch (request by request, [t_n, drafts])."""

    tokens: list[int]
    logprobs: list[float] | None  # per row: the chosen token's logprob (when a request wants them)
    top_logprobs: tuple[list, list] | None  # (values, ids), per row


@dataclass(frozen=True)
class Verdict:
    """One request's accepted round: emit tokens = d_1..d_j, p_j (before any stop cuts them)."""

    req: Req
    drafted: int  # drafts verified
    accepted: int  # j
    tokens: list[int]
    logprobs: list[float] | None = None  # row k: logprob of tokens[k]
    top_logprobs: tuple[list, list] | None = None  # (values, ids), row k for tokens[k]
    kv_start: int = 0  # position of t_n: the verify rows' exact KV starts here

    @property
    def correction(self) -> int:
        """p_j: the verifier's token (a correction, or a bonus when every draft was accepted)."""
        return self.tokens[-1]


@dataclass
class RoundBatch:
    fb: ForwardBatch
    drafting: list[Req]
    verifiers: list[Req]  # resident then staged, in row order
    captured: dict | None  # the verify rows' queries (query-scored compressors)
    proposals: list[list[int]] | None = None  # per drafting request, the n-gram proposals in its rows

    @property
    def num_draft_rows(self) -> int:
        """Drafting request i has 1 + len(proposals[i]) rows (its last token, then its proposals)."""
        return len(self.drafting) + sum(map(len, self.proposals or ()))

    @property
    def tag(self) -> str:
        return "mixed" if self.drafting and self.verifiers else ("draft" if self.drafting else "verify")


def make_draft_pool(max_draft: int, num_req_rows: int, model_config, exact_pool, device) -> MHATokenToKVPool:
    """Scratch KV of the drafts: request row r owns slots [1 + r*(X+1), 1 + (r+1)*(X+1))."""
    return MHATokenToKVPool(
        num_slots=1 + num_req_rows * (max_draft + 1),
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=exact_pool.dtype,
        device=device,
    )


class VeriCacheRound:
    def __init__(self, policy: DraftLengthPolicy, sampler: Sampler, vocab_size: int, eos_token_ids: set[int],
                 memory: RequestMemory, output: OutputSink, metrics: SchedulerMetrics,
                 forward: Callable[[ForwardBatch, str], torch.Tensor], two_tier: TwoTierKV | None = None,
                 link: Link | None = None, draft_pool: MHATokenToKVPool | None = None,
                 ngram: NgramConfig | None = None):
        self.policy = policy
        self.max_draft = policy.max_len
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.memory = memory
        self.output = output
        self.metrics = metrics
        self.forward = forward
        self.two_tier = two_tier  # None on a verifier: no compressed tier, no drafting
        self.link = link
        self.draft_pool = draft_pool
        self.stride = self.max_draft + 1
        self.ngram = ngram  # None: one row per drafting request and forward

    # ------------------------------------------------------------------ plan

    def plan(self, req: Req) -> int:
        """The draft length of req's next round: the policy's, at most the tokens left less one."""
        return draft_len(req, self.policy.next_len(self.accept_ema(req)))

    def accept_ema(self, req: Req) -> float:
        st = req.spec
        if st.accept_ema is None:
            st.accept_ema = self.policy.initial_state()
        return st.accept_ema

    def start(self, req: Req, draft_target: int, decode_step: bool = False) -> None:
        """Opens req's round of draft_target drafts (decode_step: a planned decode step, not a round)."""
        req.spec.start(draft_target, decode_step)

    def is_drafting(self, req: Req) -> bool:
        st = req.spec
        return len(st.drafts) < st.draft_target and not self.draft_stopped(req)

    def draft_stopped(self, req: Req) -> bool:
        """No use drafting past a draft that would end the request."""
        d = req.spec.drafts
        if not d:
            return False
        sp = req.sampling_params
        if len(req.output_ids) + len(d) < sp.min_new_tokens:
            return False
        if req.grammar is not None and req.grammar.terminated:
            return True
        return d[-1] in sp.stop_token_ids or (not sp.ignore_eos and d[-1] in self.eos_token_ids)

    # ------------------------------------------------------------------ one forward

    def run(self, drafting: Sequence[Req] = (), resident: Sequence[Req] = (), staged: Sequence[Req] = (),
            draft_s: float = 0.0, timed: bool = False) -> list[Verdict]:
        """One forward: a draft step of `drafting`, and the verification, acceptance and commit of
        `resident` + `staged`. timed: each verifier's verify seconds are this forward's share."""
        t0 = time.perf_counter()
        batch = self.build(drafting, resident, staged)
        logits = self.forward(batch.fb, batch.tag)
        n = len(batch.verifiers)
        verify_s = (time.perf_counter() - t0) / n if timed and n else 0.0
        return self.apply(batch, logits, draft_s, verify_s)

    def build(self, drafting: Sequence[Req], resident: Sequence[Req], staged: Sequence[Req]) -> RoundBatch:
        drafting, verifiers = list(drafting), list(resident) + list(staged)
        items, input_ids, positions, prefix, out_loc = [], [], [], [], []
        draft_slots = proposals = None
        if drafting:
            proposals = [self.proposals(r) for r in drafting]
            d_rows, d_ids, d_pos, d_loc, draft_slots = self.draft_inputs(drafting, proposals)
            items += [(r, 1) for r in d_rows]
            input_ids += d_ids
            positions += d_pos
            prefix += d_pos  # a draft row's logical prefix is its position
            out_loc.append(d_loc)
        if verifiers:
            v_items, v_ids, v_pos, v_loc = self.verify_inputs(verifiers)
            items += v_items
            input_ids += v_ids
            positions += v_pos
            prefix += [r.kv_committed_len for r in verifiers]
            out_loc.append(v_loc)
        if (drafting and verifiers) or (resident and staged):
            mode = ForwardMode.MIXED
        else:
            mode = ForwardMode.DRAFT_DECODE if drafting else ForwardMode.TARGET_VERIFY
        out = torch.cat([loc.to(out_loc[-1].device) for loc in out_loc])  # draft slots: host
        fb = make_forward_batch(mode, items, input_ids, positions, out, prefix_lens=prefix)
        if drafting:
            fb.draft_ctx = self.two_tier.draft_context(d_rows, self.draft_pool, draft_slots)
            self.metrics.spec_draft_forwards_total += 1
            self.metrics.spec_draft_rows_total += len(d_rows)
        if verifiers:
            fb.logits_indices = torch.arange(len(input_ids), dtype=torch.int64)
        if mode == ForwardMode.MIXED and resident:
            fb.num_resident = len(resident)
        if staged:
            fb.staged = self.link.staged(list(staged))
        needs_q = verifiers and self.two_tier is not None and self.two_tier.keeps_queries(verifiers)
        fb.captured_q = {} if needs_q else None
        return RoundBatch(fb, drafting, verifiers, fb.captured_q, proposals)

    def apply(self, batch: RoundBatch, logits: torch.Tensor, draft_s: float = 0.0,
              verify_s: float = 0.0) -> list[Verdict]:
        nd = batch.num_draft_rows
        if batch.drafting:
            self.sample_drafts(batch.drafting, logits[:nd], batch.proposals)
        if not batch.verifiers:
            return []
        verdicts = self.accept(batch.verifiers, self.sample_targets(batch.verifiers, logits[nd:]))
        self.commit(verdicts, batch.captured, q_row0=nd, draft_s=draft_s, verify_s=verify_s)
        return verdicts

    # ------------------------------------------------------------------ draft

    def draft_inputs(self, group: list[Req], proposals: list[list[int]] | None = None):
        """(the request of each row, input ids, positions, out slots in the draft pool, draft slots
        per row). A request's rows: its last token (t_n or its newest draft), then its proposals,
        each one position and one draft slot further on; every row's K/V is written before any row
        attends, so row i sees rows 0..i-1 of its request (a causal chain)."""
        rows, input_ids, positions, draft_slots = [], [], [], []
        for r, props in zip(group, proposals or [[]] * len(group)):
            d = r.spec.drafts
            for i, tok in enumerate([d[-1] if d else r.output_ids[-1]] + props):
                rows.append(r)
                input_ids.append(tok)
                positions.append(r.seqlen - 1 + len(d) + i)
                draft_slots.append(self.draft_slots(r, len(d) + 1 + i))
        out_loc = torch.stack([ds[-1] for ds in draft_slots])
        return rows, input_ids, positions, out_loc, draft_slots

    def proposals(self, req: Req) -> list[int]:
        """The n-gram proposals checked in req's next draft forward ([] without --speculative-ngram)."""
        return [] if self.ngram is None else chain_proposals(req, self.ngram)

    def draft_slots(self, req: Req, n: int) -> torch.Tensor:
        base = 1 + req.req_pool_idx * self.stride
        return torch.arange(base, base + n, dtype=torch.int64)

    def sample_drafts(self, group: list[Req], logits: torch.Tensor,
                      proposals: list[list[int]] | None = None) -> None:
        """Row i of a request (input: its proposal q_i; row 0: its last token) is sampled as its
        next draft step after q_1..q_i would be: same seed, position and history output_ids + drafts
        + q_1..q_i, over the same context. Its sample s_i is that step's draft exactly when
        q_1..q_i = s_0..s_{i-1}, so the drafts gain s_0, s_1, ... up to the first s_i != q_{i+1}
        (kept: its own context was right) or a draft that ends the request. Under a grammar row i is
        masked as that step would be (chain_masks), and each draft is accepted by the matcher and
        keeps its mask for the verifier's row at its position."""
        props = proposals or [[]] * len(group)
        rows = [
            SamplingRow(params=r.sampling_params, seed=r.seed,
                        position=len(r.output_ids) + len(r.spec.drafts) + i,
                        output_ids=r.output_ids + r.spec.drafts + q[:i], prompt_ids=r.origin_input_ids)
            for r, q in zip(group, props)
            for i in range(len(q) + 1)
        ]
        info = SamplingBatchInfo.from_rows(rows, self.vocab_size, logits.device, self.eos_token_ids)
        masks = [chain_masks(r, q) if r.grammar is not None else [None] * (len(q) + 1)
                 for r, q in zip(group, props)]
        info.vocab_mask = vocab_mask([m for ms in masks for m in ms], self.vocab_size)
        sampled, row = self.sampler(logits, info).next_token_ids.tolist(), 0
        for r, q, ms in zip(group, props, masks):
            toks, row = sampled[row : row + len(q) + 1], row + len(q) + 1
            st = r.spec
            taken = 0
            for tok, mask in zip(toks, ms):
                if r.grammar is not None:
                    if not r.grammar.accept(tok):  # nothing allowed: stop drafting, verify decides
                        st.draft_target = len(st.drafts)
                        break
                    st.draft_masks.append(mask)  # the verifier's row for this draft uses the same mask
                st.drafts.append(tok)
                if taken == len(q) or tok != q[taken] or self.draft_stopped(r):
                    break
                taken += 1
            if q:
                self.account_proposals(r, len(q), taken)
                st.ngram.adapt(len(q), taken, self.ngram.branch_length)

    # ------------------------------------------------------------------ verify

    def verify_inputs(self, group: list[Req]):
        """(batch items, input ids, positions, fresh exact slots) for [t_n, drafts] of each request.
        The driver made room for len(drafts)+1 slots per request before the round."""
        items, input_ids, positions, out_loc = [], [], [], []
        for req in group:
            drafts = req.spec.drafts
            n = len(drafts) + 1
            slots = self.memory.alloc_slots(req, n)
            assert slots is not None, "verify slots: the driver reserves them before a round"
            items.append((req, n))
            input_ids.extend([req.output_ids[-1]] + drafts)
            positions.extend(range(req.seqlen - 1, req.seqlen - 1 + n))
            out_loc.append(slots)
        return items, input_ids, positions, torch.cat(out_loc)

    def sample_targets(self, group: list[Req], logits: torch.Tensor) -> Targets:
        """Row i of a request: the token full mode samples after output_ids + drafts[:i]."""
        rows = [
            SamplingRow(params=r.sampling_params, seed=r.seed, position=len(r.output_ids) + i,
                        output_ids=r.output_ids + r.spec.drafts[:i], prompt_ids=r.origin_input_ids)
            for r in group
            for i in range(len(r.spec.drafts) + 1)
        ]
        info = SamplingBatchInfo.from_rows(rows, self.vocab_size, logits.device, self.eos_token_ids)
        info.vocab_mask = vocab_mask(
            [m for r in group for m in (r.spec.draft_masks + [r.grammar.next_bitmask()] if r.grammar else
                                        [None] * (len(r.spec.drafts) + 1))],
            self.vocab_size,
        )
        return Targets(*sample_with_logprobs(self.sampler, logits, info, group))

    # ------------------------------------------------------------------ accept

    def accept(self, group: list[Req], targets: Targets) -> list[Verdict]:
        verdicts, row = [], 0
        for req in group:
            d = req.spec.drafts
            rows = slice(row, row + len(d) + 1)
            p = targets.tokens[rows]
            j = accepted_length(d, p)
            lps = targets.logprobs[rows] if targets.logprobs is not None else None
            tops = (targets.top_logprobs[0][rows], targets.top_logprobs[1][rows]) if targets.top_logprobs else None
            verdicts.append(Verdict(req, len(d), j, d[:j] + [p[j]], lps, tops, req.kv_committed_len))
            row = rows.stop
        return verdicts

    # ------------------------------------------------------------------ commit

    def commit(self, verdicts: list[Verdict], captured: dict | None = None, q_row0: int = 0,
               draft_s: float = 0.0, verify_s: float = 0.0) -> None:
        """Emits, commits and accounts each verdict's round. The exact KV of its verify rows is in
        slots [kv_start, kv_start + drafted + 1) of its request; captured: those rows' queries, the
        first at row q_row0 (after any draft rows of the forward)."""
        row = q_row0
        for v in verdicts:
            req = v.req
            emitted, dead_end = v.tokens, False
            if req.grammar is not None:  # back to the accepted prefix, then the verifier's token
                req.grammar.rollback(v.drafted - v.accepted)
                if not req.grammar.terminated and not req.grammar.accept(v.correction):
                    emitted, dead_end = v.tokens[:-1], True
            m = self.output.append_tokens(req, emitted, v.logprobs, v.top_logprobs)
            if dead_end and not req.finished:
                self.output.grammar_dead_end(req)
            if captured is not None:
                self.two_tier.record_queries(req, captured, slice(row, row + v.drafted + 1), n_keep=m)
            req.kv_committed_len += m
            self.memory.truncate_slots(req, req.kv_committed_len)
            if not req.spec.decode_step:  # a planned decode step (adaptive.py) is not a round
                self.account(req, v.drafted, v.accepted, draft_s, verify_s)
            req.spec.decode_step = False
            req.spec.end()
            row += v.drafted + 1
        if self.two_tier is not None:
            for v in verdicts:
                if not v.req.finished:
                    self.two_tier.fold(v.req)
        self.output.finish_round([v.req for v in verdicts])

    def account_proposals(self, req: Req, proposed: int, taken: int) -> None:
        """taken of proposed n-gram proposal tokens were the drafter's own samples."""
        m = req.meta
        m["spec_ngram_proposed_tokens"] = m.get("spec_ngram_proposed_tokens", 0) + proposed
        m["spec_ngram_accepted_tokens"] = m.get("spec_ngram_accepted_tokens", 0) + taken
        self.metrics.spec_ngram_proposed_total += proposed
        self.metrics.spec_ngram_accepted_total += taken

    def account(self, req: Req, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        req.spec.accept_ema = self.policy.update(self.accept_ema(req), accepted, drafted)
        m = req.meta
        m["spec_rounds"] = m.get("spec_rounds", 0) + 1
        m["spec_drafted_tokens"] = m.get("spec_drafted_tokens", 0) + drafted
        m["spec_accepted_tokens"] = m.get("spec_accepted_tokens", 0) + accepted
        m["spec_draft_time_s"] = m.get("spec_draft_time_s", 0.0) + draft_s
        m["spec_verify_time_s"] = m.get("spec_verify_time_s", 0.0) + verify_s
        # Tokens emitted per round: accepted drafts + the verifier's token.
        m["spec_accept_length"] = (m["spec_accepted_tokens"] + m["spec_rounds"]) / m["spec_rounds"]
        self.metrics.on_spec_round(drafted, accepted)
