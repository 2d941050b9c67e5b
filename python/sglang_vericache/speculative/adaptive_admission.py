"""AdaptiveAdmission: the adaptive schedule's say in admission (PrefillAdder's admission_gate), a
part of AdaptiveVeriCache (adaptive.py): whether a waiting request joins the running set now, and
how (decode-only or VeriCache), from the controller's predicted throughput of the batch with it and
without it (speculative/controller.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sglang_vericache.mem_cache.placement import residency
from sglang_vericache.speculative.acceptance import draft_len, tokens_left
from sglang_vericache.speculative.controller import Acceptance, RequestView

if TYPE_CHECKING:
    from sglang_vericache.managers.schedule_batch import Req

REPLAN_EVERY = 16  # iterations between plans (and admission answers) remade on the same batch
# A request is admitted only if the batch's predicted tokens/s with it beats that without it by this
# fraction (predictions are fitted costs: a tie is no reason to take device room or link time).
ADMIT_MARGIN = 0.02


class AdaptiveAdmission:
    """Reads AdaptiveVeriCache's controller, placement, plans' acceptance and running set."""

    @property
    def admission_gate(self) -> Callable[[Req, list[Req]], bool]:
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
            acc = self.accept.get(r.rid) or Acceptance()
            comp = (n // ps) * self.comp_rows_per_chunk + n % ps
            fold = 0.0 if o else self.fold_cost(r, n, id(r) in running)
            views.append(RequestView(committed=n, resident=res, accept_rate=acc.rate(), comp_keys=comp,
                                     max_draft=draft_len(r, self.max_draft), can_draft=not o,
                                     fold_s_per_token=fold))
        d = self.controller.decide(views)
        return d.throughput, d.plans[-1].run, keeps

    def _batch(self, req: Req | None, pending: list[Req]) -> tuple[list[Req], list[int], list[int]]:
        """The running requests, `pending` and req (if any) in admission order, with their committed
        lengths now (one not yet prefilled: its prefill) and at their ends (every new token)."""
        running = set(id(r) for r in self.running)
        reqs = list(self.running) + list(pending) + ([req] if req is not None else [])
        lens = [r.kv_committed_len if id(r) in running else r.prefill_target_len() for r in reqs]
        final = [n + max(tokens_left(r), 0) for r, n in zip(reqs, lens)]
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
