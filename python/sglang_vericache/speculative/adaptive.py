"""Adaptive VeriCache (--vericache-schedule adaptive): never slower than full mode.

Every iteration is ONE forward of three kinds of rows (a MIXED batch):
  draft rows     requests in a round, drafting over the compressed tier;
  resident rows  requests whose exact KV stays in device memory (mem_cache/placement.py) that
                 verify now, or decode like full mode (a one-row verify of the last token, no
                 drafts: under deterministic inference the same arithmetic as a decode step);
  staged rows    host-tier requests that verify now, their exact KV streamed over the link layer
                 by layer (booked in the reservation rings as the staggered schedule does).
It is the RoundLoop (speculative/round_loop.py) the staggered schedule runs, with the plan remade.
The controller (speculative/controller.py) chooses per request, from step costs fitted to the
forwards measured so far: decode or a round of x drafts, and for host-tier requests whether
they run at all (one that costs the batch more than it adds waits for device room). Choices take
effect when a request starts its next round; the plan is remade every REPLAN_EVERY iterations
and whenever the running set or its placement changes. Tokens are the same whatever it
chooses: every emitted token is the exact verifier's (or the decode step's) choice.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sglang_vericache.mem_cache.placement import ExactPlacement
from sglang_vericache.server_args import parse_bytes
from sglang_vericache.speculative.acceptance import draft_len, tokens_left
from sglang_vericache.speculative.adaptive_admission import REPLAN_EVERY, AdaptiveAdmission
from sglang_vericache.speculative.controller import (
    DRAFT_LENGTHS,
    Acceptance,
    ForwardSample,
    Plan,
    RealizedThroughput,
    RequestView,
    StepCostModel,
    VeriCacheController,
    plan_summary,
)
from sglang_vericache.speculative.full_mode_note import FullModeNote
from sglang_vericache.speculative.round_loop import RoundLoop

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.mem_cache.two_tier import TwoTierKV
    from sglang_vericache.model_executor.model_runner import ModelRunner
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.speculative.vericache_round import VeriCacheRound

logger = logging.getLogger(__name__)

# A plan of decodes only is never tested against rounds by its own measurements (no forward has
# verify rows of several tokens): at least this often, one request runs a round anyway.
EXPLORE_EVERY = 64
EXPLORE_DRAFT = 8
# Priors for the cost model before any forward is measured (CPU / CUDA device).
PRIOR_BANDWIDTH = {"cpu": 20e9, "cuda": 2e12}
PRIOR_FLOPS = {"cpu": 1e11, "cuda": 3e14}


class AdaptiveVeriCache(AdaptiveAdmission, RoundLoop):
    def __init__(self, args: ServerArgs, round: VeriCacheRound, memory: RequestMemory, running: list[Req],
                 link: Link | None, two_tier: TwoTierKV, runner: ModelRunner, page_size: int):
        super().__init__(round, memory, running, link)
        self.two_tier = two_tier
        self.page_size = page_size
        kv_bytes = runner.token_to_kv_pool.bytes_per_token()
        fixed = args.draft_tokens is not None
        lengths = (self.max_draft,) if fixed else tuple(x for x in DRAFT_LENGTHS if x <= self.max_draft)
        device_bytes = None
        if args.device_kv_budget is not None:
            device_bytes = parse_bytes(args.device_kv_budget, "--device-kv-budget")
        elif runner.static_kv_bytes is not None:
            device_bytes = runner.static_kv_bytes
        self.placement = ExactPlacement(
            device_bytes, two_tier.pool, kv_bytes, growth_tokens=self.max_draft + 1,
            scratch_bytes_per_drafter=(self.max_draft + 1) * kv_bytes,
            staging_bytes=link.stager.staging_bytes() if link is not None else 0,
            engine=link.engine if link is not None else None, tree_cache=lambda: two_tier.tree_cache)
        self.controller = VeriCacheController(self._prior(runner, two_tier), kv_bytes,
                                              None if link is None else link.bandwidth, lengths)
        self.comp_rows_per_chunk = two_tier.pool.layouts[0].rows
        self.plans: dict[str, Plan] = {}
        self.accept: dict[str, Acceptance] = {}
        self.max_resident = 0  # most requests resident at once (stats)
        self.last_round_at = 0
        self._plan_key = None
        self._last_summary = ""
        self.full_mode_note = FullModeNote()
        self._admit_key, self._admit_answer = None, (True, False)
        self.realized = RealizedThroughput()
        self._predicted = 0.0  # the plan in force: predicted tok/s
        self._window = [0, 0, 0.0, 0.0]  # iterations, tokens, seconds, of which with host-tier rounds
        # A KV store that takes compressed pages gets them from folding: then every request folds its
        # prompt (it may still decode, x = 0), so admission never picks decode-only.
        self.admission_ways = (False,) if "compressed" in args.kv_store_tier_set else (True, False)

    @staticmethod
    def _prior(runner: ModelRunner, two_tier: TwoTierKV) -> StepCostModel:
        mc = runner.model_config
        dev = "cuda" if str(runner.device).startswith("cuda") else "cpu"
        params = sum(p.numel() for p in runner.model.parameters())
        elem = next(runner.model.parameters()).element_size()
        kv_bytes = runner.token_to_kv_pool.bytes_per_token()
        ratio = max(two_tier.compressor.effective_ratio(), 1.0)
        qk = 4 * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers
        return StepCostModel.from_sizes(params * elem, 2 * params, kv_bytes, kv_bytes / ratio, qk,
                                        PRIOR_BANDWIDTH[dev], PRIOR_FLOPS[dev])

    # ------------------------------------------------------------------ plans

    def comp_keys(self, req: Req) -> int:
        ps = self.page_size
        tail = req.kv_committed_len - len(req.comp_indices) * ps
        return len(req.comp_indices) * self.comp_rows_per_chunk + tail

    def fold_cost(self, req: Req, committed: int, prefilled: bool) -> float:
        """Seconds of folding per token req emits (RequestView.fold_s_per_token), at the measured
        seconds per page (TwoTierKV.fold_seconds_per_page; 0 before any fold): its new tokens' pages,
        and, while it is not prefilled yet, its prompt's pages over the tokens it will emit (the fold
        its VeriCache admission costs). A decode-only request (no compressed tier) folds nothing: its
        callers give it 0."""
        per_page = self.two_tier.fold_seconds_per_page()
        if not per_page:
            return 0.0
        cost = per_page / self.page_size
        if not prefilled:
            left = max(tokens_left(req), 1)
            cost += per_page * max(committed // self.page_size - len(req.comp_indices), 0) / left
        return cost

    def replan(self, running: list[Req], resident: list[bool]) -> None:
        key = (tuple(r.rid for r in running), tuple(resident))
        if key == self._plan_key and self.iteration % REPLAN_EVERY:
            return
        self._plan_key = key
        views = []
        for r, res in zip(running, resident):
            acc = self.accept.setdefault(r.rid, Acceptance())
            views.append(RequestView(committed=r.kv_committed_len, resident=res, accept_rate=acc.rate(),
                                     comp_keys=self.comp_keys(r), max_draft=draft_len(r, self.max_draft),
                                     can_draft=not r.spec.decode_only,
                                     fold_s_per_token=0.0 if r.spec.decode_only
                                     else self.fold_cost(r, r.kv_committed_len, True)))
        decision = self.controller.decide(views)
        self.plans = {r.rid: p for r, p in zip(running, decision.plans)}
        self._predicted = decision.throughput
        if running and not any(p.run and p.draft_len for p in decision.plans):
            self.full_mode_note.maybe_log(self.controller, views, decision)  # says why, now and then
        if (self.iteration - self.last_round_at >= EXPLORE_EVERY and running
                and not any(p.run and p.draft_len for p in decision.plans)):
            # Explore: the request with the best acceptance runs one round (exact either way).
            i = max(range(len(running)),
                    key=lambda k: views[k].accept_rate if resident[k] and views[k].can_draft else -1.0)
            x = min(EXPLORE_DRAFT, views[i].max_draft)
            if x > 0 and views[i].can_draft:
                self.plans[running[i].rid] = Plan(True, x)
                self.last_round_at = self.iteration
                self._plan_key = None  # back to the controller's plan at the next iteration
        summary = plan_summary(decision)
        if summary.split(";")[0] != self._last_summary.split(";")[0]:
            logger.info("adaptive VeriCache: %s", summary)
        self._last_summary = summary

    # ------------------------------------------------------------------ the plan (RoundLoop)

    def place(self, running: list[Req]) -> dict[str, bool]:
        """Re-places the running requests' exact KV (mem_cache/placement.py) and remakes the plan."""
        resident = self.placement.update(running)
        self.max_resident = max(self.max_resident, sum(resident))
        self.replan(running, resident)
        return {q.rid: res for q, res in zip(running, resident)}

    def start_round(self, req: Req, resident: bool) -> bool:
        """Starts req's next round per its plan (x = 0: a decode step); False if it waits now."""
        plan = self.plans.get(req.rid)
        if plan is None or not plan.run:
            return False
        x = draft_len(req, plan.draft_len, self.max_draft)
        if resident or self.bookings.rings is None:
            self.round.start(req, x, decode_step=x == 0)
            self.bookings.book_resident(req, x)  # no link: verify once drafted
            return True
        booking = self.bookings.book(req, x)
        self.round.start(req, max(0, min(booking.at - self.iteration, x)), decode_step=x == 0)
        return True

    def verifies_now(self, req: Req, resident: bool) -> bool:
        # A resident request whose drafts stopped early verifies at once (no link slot to keep).
        return self.bookings.due(req) or (resident and not self.round.is_drafting(req))

    def release(self, req: Req) -> None:
        """req leaves the running set (finished, aborted, retracted): its booking goes back."""
        self.bookings.cancel(req)
        self.plans.pop(req.rid, None)
        self.accept.pop(req.rid, None)

    # ------------------------------------------------------------------ one iteration

    def forward_batch_generation(self) -> None:
        start, reqs = time.perf_counter(), list(self.running)
        before = sum(len(q.output_ids) for q in reqs)
        host = self.iterate()
        w = self._window
        w[0] += 1
        w[1] += sum(len(q.output_ids) for q in reqs) - before
        w[2] += time.perf_counter() - start
        w[3] += host
        if w[0] >= REPLAN_EVERY:
            self.realized.window(w[3] * 2 > w[0], w[1], w[2], self._predicted)
            self._window = [0, 0, 0.0, 0.0]

    def run_forward(self, drafting: list[Req], on_device: list[Req], streamed: list[Req]):
        """The forward, measured for the cost fit (less the time it stalled on the link)."""
        verifiers = on_device + streamed
        shape = [(len(q.spec.drafts), q.kv_committed_len) for q in verifiers]
        comp = sum(self.comp_keys(q) for q in drafting)
        draft_keys = comp + sum(len(q.spec.drafts) + 1 for q in drafting)
        t0 = time.perf_counter()
        verdicts, elapsed = super().run_forward(drafting, on_device, streamed)
        self.observe(len(drafting), comp, draft_keys, shape, elapsed - self._stall_seconds(since=t0))
        for v in verdicts:
            if v.drafted:
                self.last_round_at = self.iteration
                if v.req.rid in self.accept:
                    self.accept[v.req.rid].update(v.drafted, v.accepted)
        return verdicts, elapsed

    def _stall_seconds(self, since: float) -> float:
        """Seconds the compute waited on the link since `since` (the forward's start)."""
        if self.link is None:
            return 0.0
        total = 0.0
        for a, b in reversed(self.link.stager.stalls):
            if a < since:
                break
            total += b - a
        return total

    def observe_prefill(self, spans: list[tuple[int, int]], seconds: float) -> None:
        """A prefill (EXTEND) forward as a cost anchor: spans are (prefix length, rows) per request;
        its rows read the exact keys before them and their own (StepCostModel's docstring)."""
        rows = sum(n for _, n in spans)
        exact = sum(s + n for s, n in spans)
        key_rows = sum(n * s + n * (n + 1) // 2 for s, n in spans)
        self.controller.cost.observe_anchor(ForwardSample(rows, exact, 0, key_rows, seconds))

    def observe(self, n_drafting: int, comp: int, draft_keys: int, verifiers: list[tuple[int, int]],
                seconds: float) -> None:
        """One forward's features (drafting rows; (drafts, committed) per verifier) and seconds."""
        exact = sum(n + d + 1 for d, n in verifiers)
        key_rows = draft_keys + sum((d + 1) * (n + (d + 2) // 2) for d, n in verifiers)
        rows = n_drafting + sum(d + 1 for d, _ in verifiers)
        self.controller.cost.observe(ForwardSample(rows, exact, comp, key_rows, max(seconds, 0.0),
                                                   drafting=n_drafting > 0))
