"""Adaptive VeriCache (--vericache-schedule adaptive): never slower than full mode.

Every iteration is ONE forward of three kinds of rows (a MIXED batch):
  draft rows     requests in a round, drafting over the compressed tier;
  resident rows  requests whose exact KV stays in device memory (mem_cache/placement.py) that
                 verify now, or decode like full mode (a one-row verify of the last token, no
                 drafts: under deterministic inference the same arithmetic as a decode step);
  staged rows    host-tier requests that verify now, their exact KV streamed over the link layer
                 by layer (booked in the reservation rings as the staggered schedule does).
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

from sglang_vericache.mem_cache.placement import ExactPlacement, residency
from sglang_vericache.server_args import parse_bytes
from sglang_vericache.speculative.base_spec_worker import BaseSpecWorker
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
from sglang_vericache.speculative.reservations import VerifyReservations
from sglang_vericache.speculative.round_state import Booking
from sglang_vericache.speculative.stagger import INITIAL_ITER_TIME_S, ITER_TIME_EMA

if TYPE_CHECKING:
    from sglang_vericache.managers.request_memory import RequestMemory
    from sglang_vericache.managers.schedule_batch import Req
    from sglang_vericache.mem_cache.link import Link
    from sglang_vericache.mem_cache.two_tier import TwoTierKV
    from sglang_vericache.model_executor.model_runner import ModelRunner
    from sglang_vericache.server_args import ServerArgs
    from sglang_vericache.speculative.vericache_round import VeriCacheRound

logger = logging.getLogger(__name__)

REPLAN_EVERY = 16
# A plan of decodes only is never tested against rounds by its own measurements (no forward has
# verify rows of several tokens): at least this often, one request runs a round anyway.
EXPLORE_EVERY = 64
EXPLORE_DRAFT = 8
# A request is admitted only if the batch's predicted tokens/s with it beats that without it by this
# fraction (predictions are fitted costs: a tie is no reason to take device room or link time).
ADMIT_MARGIN = 0.02
# Priors for the cost model before any forward is measured (CPU / CUDA device).
PRIOR_BANDWIDTH = {"cpu": 20e9, "cuda": 2e12}
PRIOR_FLOPS = {"cpu": 1e11, "cuda": 3e14}


class AdaptiveVeriCache(BaseSpecWorker):
    def __init__(self, args: ServerArgs, round: VeriCacheRound, memory: RequestMemory, running: list[Req],
                 link: Link | None, two_tier: TwoTierKV, runner: ModelRunner, page_size: int):
        self.round = round
        self.memory = memory
        self.running = running
        self.link = link
        self.stats = {}
        self.two_tier = two_tier
        self.page_size = page_size
        kv_bytes = runner.token_to_kv_pool.bytes_per_token()
        self.max_draft = round.max_draft
        fixed = args.speculative_num_draft_tokens != "auto"
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
        self.iter_time = INITIAL_ITER_TIME_S
        self.rings = None
        if link is not None:
            self.rings = VerifyReservations(2 * self.max_draft + 2, self._link_bytes_per_iter(), link.max_tokens)
        self.plans: dict[str, Plan] = {}
        self.accept: dict[str, Acceptance] = {}
        self.iteration = 0
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

    def _link_bytes_per_iter(self) -> float:
        bw = self.link.bandwidth
        return float("inf") if bw is None else bw * self.iter_time

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
            left = max(req.sampling_params.max_new_tokens - len(req.output_ids), 1)
            cost += per_page * max(committed // self.page_size - len(req.comp_indices), 0) / left
        return cost

    def replan(self, running: list[Req], resident: list[bool]) -> None:
        key = (tuple(r.rid for r in running), tuple(resident))
        if key == self._plan_key and self.iteration % REPLAN_EVERY:
            return
        self._plan_key = key
        views = []
        for r, res in zip(running, resident):
            left = r.sampling_params.max_new_tokens - len(r.output_ids)
            acc = self.accept.setdefault(r.rid, Acceptance())
            views.append(RequestView(committed=r.kv_committed_len, resident=res, accept_rate=acc.rate(),
                                     comp_keys=self.comp_keys(r), max_draft=min(self.max_draft, left - 1),
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

    # ------------------------------------------------------------------ admission

    @property
    def admission_gate(self):
        return self.admits

    def admits(self, req: Req, pending: list[Req]) -> bool:
        """Whether to admit req now (after `pending`, admitted in this prefill batch), and how. Two
        ways are weighed by the controller's predicted throughput of everything running then:
          decode-only  req's exact KV resident and no compressed tier of its own (it decodes as full
                       mode does; its device room is its exact KV alone), if it fits;
          VeriCache    req's prompt folded into the compressed tier, resident if its exact KV still
                       fits, else on the host tier (the only way when the KV store takes compressed pages);
        req is admitted the better way among those that are admissible: one that keeps req resident
        to its end (full mode would run it: never refused), or one the controller runs whose
        predicted batch throughput beats the batch's without req by ADMIT_MARGIN (a host-tier
        request, whose compressed chunks may also push others' exact KV off the device); else it
        waits in the queue. "Beats the batch without req" means beats the better of that and full
        mode's batch (_full_reference): a running set of host-tier rounds that predicts less than the
        same requests decoding resident as full mode would hold them takes no more. VeriCache is
        preferred to decode-only only if it beats it by ADMIT_MARGIN. Nothing running: always.

        Before the cost model is measured (StepCostModel.measured: requests arriving together are
        admitted during the first prefills, before any decode forward), predictions rest on the
        prior's KV-read costs, and a wrong guess is not undone (the folds are paid, host-tier
        requests hold compressed chunks on the device): then only ways that keep req and everyone
        resident are admissible, decode-only first (full mode's schedule); the rest wait the few
        forwards it takes to measure. Ways that put exact KV on the host tier also wait for measured
        draft forwards (StepCostModel.drafts_measured: rounds of resident VeriCache requests measure
        them): a draft forward's costs are not seen in decode forwards (measured on an AVX-512 CPU, a
        one-row draft forward took 1.6x a one-row decode), and admitting host-tier rounds on a guess
        locked a one-request budget into rounds at 0.6x full mode's throughput.

        Each VeriCache way also pays its fold (RequestView.fold_s_per_token): its prompt's pages
        and every page it commits, at the measured seconds per page."""
        cost = self.controller.cost
        key = (tuple(r.rid for r in self.running), tuple(r.rid for r in pending), req.rid,
               self.iteration // REPLAN_EVERY, cost.measured, cost.drafts_measured)
        if key != self._admit_key:
            self._admit_key = key
            measured = cost.measured
            # A way that moves exact KV to the host tier (req's, or others' pushed off by its chunks) is
            # not undone once taken: it is taken only on measured draft costs (drafts_measured).
            host_ok = measured and cost.drafts_measured
            without = self._predict(None, pending, False)[0] if (self.running or pending) else 0.0
            ways = [(self._predict(req, pending, d), d) for d in self.admission_ways]
            host = self.realized.host_factor()  # host-tier ways: as realized so far (RealizedThroughput)
            ways = [((tput * (1 if keeps or d else host), runs, keeps), d) for (tput, runs, keeps), d in ways]
            floor = max(without, self._full_reference(req, pending)) if measured else 0.0
            ok = [(tput * (1 + ADMIT_MARGIN if d else 1), d) for (tput, runs, keeps), d in ways
                  if runs and keeps or (host_ok and runs and tput > floor * (1 + ADMIT_MARGIN))]
            if ok and not measured:
                self._admit_answer = (True, max(d for _, d in ok))
            elif ok:
                self._admit_answer = (True, max(ok)[1])
            else:  # waits; alone it is admitted anyway, the better way
                self._admit_answer = (False, max((w[0][0], w[1]) for w in ways)[1])
        admit, decode_only = self._admit_answer
        if not self.running and not pending:
            admit = True  # never leave the server idle
        if admit:
            req.spec.decode_only = decode_only
        return admit

    def _predict(self, req: Req | None, pending: list[Req], decode_only: bool) -> tuple[float, bool, bool]:
        """(predicted tok/s, whether req runs, whether it and everyone resident before stay resident to
        their ends) with req admitted decode-only or as VeriCache (req None: the others alone)."""
        ps, chunk = self.page_size, self.two_tier.pool.bytes_per_chunk()
        reqs, lens, final = self._batch(req, pending)
        if not reqs:
            return 0.0, False, False
        only = [r.spec.decode_only for r in reqs]
        if req is not None:
            only[-1] = decode_only
        # Residency is judged at every request's end (its prompt and all its new tokens), so a request
        # admitted resident stays so as it and the others grow: a decode-only request pushed onto the
        # host later would stream one-row verifies, slower than waiting in the queue.
        running = set(id(r) for r in self.running)
        new_comp = sum((f // ps - (len(r.comp_indices) if id(r) in running else 0)) * chunk
                       for r, f, o in zip(reqs, final, only) if not o)
        sizes = [self.placement.exact_bytes(f) for f in final]
        drafters = sum(1 for o in only if not o)
        resident = residency(sizes, self.placement.free_bytes(drafters) - new_comp)
        if not all(resident):
            resident = residency(sizes, self.placement.free_bytes(drafters, staging=True) - new_comp)
        if req is not None and decode_only and not resident[-1]:
            return -1.0, False, False
        keeps = req is not None and resident[-1] and all(resident)
        views = []
        for r, n, res, o in zip(reqs, lens, resident, only):
            left = r.sampling_params.max_new_tokens - len(r.output_ids)
            acc = self.accept.get(r.rid) or Acceptance()
            comp = (n // ps) * self.comp_rows_per_chunk + n % ps
            fold = 0.0 if o else self.fold_cost(r, n, id(r) in running)
            views.append(RequestView(committed=n, resident=res, accept_rate=acc.rate(), comp_keys=comp,
                                     max_draft=min(self.max_draft, max(left - 1, 0)), can_draft=not o,
                                     fold_s_per_token=fold))
        d = self.controller.decide(views)
        return d.throughput, d.plans[-1].run, keeps

    def _batch(self, req: Req | None, pending: list[Req]) -> tuple[list[Req], list[int], list[int]]:
        """The running requests, `pending` and req (if any) in admission order, with their committed
        lengths now (one not yet prefilled: its prefill) and at their ends (every new token)."""
        running = set(id(r) for r in self.running)
        reqs = list(self.running) + list(pending) + ([req] if req is not None else [])
        lens = [r.kv_committed_len if id(r) in running else r.prefill_target_len() for r in reqs]
        final = [n + max(r.sampling_params.max_new_tokens - len(r.output_ids), 0) for r, n in zip(reqs, lens)]
        return reqs, lens, final

    def _full_reference(self, req: Req, pending: list[Req]) -> float:
        """Predicted tok/s of full mode's batch of the running requests, `pending` and req: each
        decoding, resident in admission order while their exact KV alone (at its end) fits the
        device budget; the rest wait in the queue."""
        _, lens, final = self._batch(req, pending)
        budget = self.placement.device_bytes
        fits = residency([self.placement.exact_bytes(f) for f in final],
                         float("inf") if budget is None else budget)
        views = [RequestView(committed=n, resident=True, accept_rate=0.0, comp_keys=0, max_draft=0,
                             can_draft=False) for n, f in zip(lens, fits) if f]
        return self.controller.decide(views).throughput if views else 0.0

    # ------------------------------------------------------------------ rounds

    def start_round(self, req: Req, resident: bool) -> bool:
        """Starts req's next round per its plan (x = 0: a decode step); False if it waits now."""
        plan = self.plans.get(req.rid)
        if plan is None or not plan.run:
            return False
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        x = max(0, min(plan.draft_len, self.max_draft, left - 1))
        st = req.spec
        st.decode_step = x == 0
        if resident or self.rings is None:
            self.round.start(req, x)
            st.booking = Booking(self.iteration + x, 0, 0)  # no link: verify once drafted
            return True
        n = req.kv_committed_len
        nbytes = self.link.bytes_for(n)
        st.booking = Booking(self.rings.reserve(x, nbytes, n), nbytes, n)
        self.round.start(req, max(0, min(st.booking.at - self.iteration, x)))
        return True

    def release(self, req: Req) -> None:
        """req leaves the running set (finished, aborted, retracted): its booking goes back."""
        b, req.spec.booking = req.spec.booking, None
        if b is not None and b.nbytes and self.rings is not None:
            self.rings.cancel(b.at, b.nbytes, b.tokens)
        self.plans.pop(req.rid, None)
        self.accept.pop(req.rid, None)

    def rebook_next(self, req: Req) -> None:
        """A host-tier verification that did not fit the staging area waits one iteration."""
        self.cancel_booking(req)
        n = req.kv_committed_len
        nbytes = self.link.bytes_for(n)
        req.spec.booking = Booking(self.rings.reserve(1, nbytes, n), nbytes, n)

    def cancel_booking(self, req: Req) -> None:
        b, req.spec.booking = req.spec.booking, None
        if b is not None and b.nbytes and self.rings is not None:
            self.rings.cancel(b.at, b.nbytes, b.tokens)

    # ------------------------------------------------------------------ one iteration

    def forward_batch_generation(self) -> None:
        start, reqs = time.perf_counter(), list(self.running)
        before = sum(len(q.output_ids) for q in reqs)
        host = self._step()
        w = self._window
        w[0] += 1
        w[1] += sum(len(q.output_ids) for q in reqs) - before
        w[2] += time.perf_counter() - start
        w[3] += host
        if w[0] >= REPLAN_EVERY:
            self.realized.window(w[3] * 2 > w[0], w[1], w[2], self._predicted)
            self._window = [0, 0, 0.0, 0.0]

    def _step(self) -> bool:
        """One iteration; -> whether host-tier requests ran rounds in it."""
        r = self.round
        running = list(self.running)
        resident = self.placement.update(running)
        res_of = {q.rid: res for q, res in zip(running, resident)}
        self.max_resident = max(self.max_resident, sum(resident))
        self.replan(running, resident)
        for q in running:
            if q.spec.booking is None:
                self.start_round(q, res_of[q.rid])

        def verifies_now(q: Req) -> bool:
            b = q.spec.booking
            if b is None:
                return False
            # A resident request whose drafts stopped early verifies at once (no link slot to keep).
            return b.at <= self.iteration or (res_of.get(q.rid, False) and not r.is_drafting(q))

        self.memory.make_room(lambda q: len(q.spec.drafts) + 1 if verifies_now(q) else 0)
        running = list(self.running)  # make_room may retract
        on_device = [q for q in running if verifies_now(q) and res_of.get(q.rid)]
        streamed = [q for q in running if verifies_now(q) and not res_of.get(q.rid)]
        if streamed:  # what does not fit the staging area waits one more iteration
            streamed, *late = self.link.split(streamed)
            for q in (q for g in late for q in g):
                self.rebook_next(q)
        drafting = [q for q in running if q.spec.booking is not None and not verifies_now(q) and r.is_drafting(q)]
        if not (drafting or on_device or streamed):
            self.advance()
            return False
        verifiers = on_device + streamed
        shape = [(len(q.spec.drafts), q.kv_committed_len) for q in verifiers]
        comp = sum(self.comp_keys(q) for q in drafting)
        draft_keys = comp + sum(len(q.spec.drafts) + 1 for q in drafting)
        for q in verifiers:
            q.spec.booking = None
        t0 = time.perf_counter()
        verdicts = r.run(drafting=drafting, resident=on_device, staged=streamed)
        elapsed = time.perf_counter() - t0
        self.observe(len(drafting), comp, draft_keys, shape, elapsed - self._stall_seconds(since=t0))
        for v in verdicts:
            if v.drafted:
                self.last_round_at = self.iteration
                if v.req.rid in self.accept:
                    self.accept[v.req.rid].update(v.drafted, v.accepted)
        self.iter_time = (1 - ITER_TIME_EMA) * self.iter_time + ITER_TIME_EMA * elapsed
        self.advance()
        return bool(streamed) or any(not res_of.get(q.rid, True) for q in drafting)

    def advance(self) -> None:
        if self.rings is not None:
            self.rings.set_link_budget(self._link_bytes_per_iter())
            self.rings.advance()
        self.iteration += 1

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
