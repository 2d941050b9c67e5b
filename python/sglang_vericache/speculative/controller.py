"""The adaptive VeriCache controller: per request, decode like full mode or run rounds, and where
its exact KV lives (ARCHITECTURE.md section 11).

Inputs, per running request (RequestView): committed length L, whether its exact KV is resident
in device memory, its acceptance so far. Outputs, per request (Plan): a draft length x
(0 = decode exactly as full mode does: a one-row verify, no drafts, which under deterministic
inference is the same arithmetic as a decode step) and whether it runs this iteration at all
(a host-tier request whose round would cost the batch more than it gives is parked).

Costs come from StepCostModel (speculative/cost_model.py): one forward's seconds as a linear
function of what it computes, fitted to the forwards measured so far. The link moves
E_r = kv_bytes * L_r per round of a host-tier request.

The decision (staggered iterations: every running request adds rows to ONE forward per
iteration): a request with plan x emits e = (1 + A(x)) / (x + 1) tokens per iteration on average
(x draft iterations and one verify, A(x) accepted drafts expected) and adds
d = (x * draft_row + verify_rows(x)) / (x + 1) seconds of forward time per iteration;
decode (x = 0, resident only) emits e = 1 and adds d = c_row + (c_exact + c_qk) * L; a request with a
compressed tier also adds e * f seconds of folding, f = RequestView.fold_s_per_token. A verify reads
the exact KV once for its x + 1 rows; that sharing (memory-bound attention) is where a round
saves over x + 1 decode steps, and the fit says how much of it this machine has. Throughput is
sum(e) / T. The link is not averaged over iterations: host-tier requests make v = sum 1/(x + 1)
verifications per iteration, each t_v = E_r / bandwidth seconds on the link, and an iteration with
k of them lasts max(F, k * t_v) (F = c0 + sum(d), the forward), so with k = floor(v) or floor(v) + 1
T = (1 - f) * max(F, floor(v) * t_v) + f * max(F, (floor(v) + 1) * t_v), f = v - floor(v): one long
transfer stalls every row of its iteration. The controller maximizes sum(e) / T (Dinkelbach's
method over the per-request choices, with a price on link seconds searched over a small grid,
each candidate scored by the exact T), so a round is chosen only where it beats decoding, and a
host-tier request runs only while it adds throughput; it never parks everyone.
Acceptance: a geometric model (each draft right with probability p, estimated per request from
its rounds, starting from a prior), A(x) = p (1 - p^x) / (1 - p).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The cost model is the controller's input; its names are importable from here too.
from sglang_vericache.speculative.cost_model import (  # noqa: F401
    FIT_WINDOW,
    MIN_MEASURED,
    ForwardSample,
    StepCostModel,
)

PRIOR_ACCEPT = 0.8
ACCEPT_PRIOR_ROUNDS = 2.0  # the acceptance prior counts as this many rounds


@dataclass
class Acceptance:
    """Per request: drafts accepted and rounds that ended in a rejection (geometric MLE)."""

    accepted: float = 0.0
    rejected_rounds: float = 0.0

    def update(self, drafted: int, accepted: int) -> None:
        self.accepted += accepted
        self.rejected_rounds += 1 if accepted < drafted else 0

    def rate(self) -> float:
        acc = self.accepted + PRIOR_ACCEPT * ACCEPT_PRIOR_ROUNDS / (1 - PRIOR_ACCEPT)
        rej = self.rejected_rounds + ACCEPT_PRIOR_ROUNDS
        return acc / (acc + rej)


def expected_accepted(p: float, x: int) -> float:
    """E[accepted drafts] of a round of x drafts, each right with probability p until the first miss."""
    if x <= 0:
        return 0.0
    if p >= 1.0:
        return float(x)
    return p * (1 - p**x) / (1 - p)


@dataclass
class RequestView:
    """What the controller needs of one running request."""

    committed: int  # exact KV positions (the verify pass reads them)
    resident: bool  # exact KV in device memory (no link at verification)
    accept_rate: float
    comp_keys: int  # keys a draft row reads from the compressed tier (plus the exact tail)
    max_draft: int  # longest round this request may draft now (its budget and max_new_tokens)
    can_draft: bool = True  # False: no compressed tier of its own (decodes, or one-row streamed verifies)
    # Seconds of folding (compressing committed pages into its compressed tier, outside the forwards)
    # per token it emits, whatever its plan: 0 without a compressed tier (see AdaptiveVeriCache.fold_cost).
    fold_s_per_token: float = 0.0


@dataclass
class Plan:
    run: bool
    draft_len: int  # 0: decode like full mode
    tokens_per_iter: float = 0.0
    seconds_per_iter: float = 0.0
    link_seconds_per_iter: float = 0.0


@dataclass
class Decision:
    plans: list[Plan]
    throughput: float  # predicted tokens/s of the batch
    iteration_s: float
    link_bound: bool = False
    options: dict = field(default_factory=dict)


DRAFT_LENGTHS = (2, 4, 6, 8, 12, 16, 24, 30)
REALIZED_EMA = 0.3  # weight of the newest window in RealizedThroughput's ratios


class RealizedThroughput:
    """Realized over predicted tokens/s, measured over windows of iterations, apart for windows in
    which host-tier requests ran rounds ("host") and the rest ("base"). The step-cost fit sees each
    forward, not what lies around it when exact KV streams (staging splits, rebooked verifications,
    folding at commit, stalls past the link model): where host-tier rounds realize less of their
    prediction than the rest do, host_factor() < 1 scales the predictions that admit more of them.
    It never raises them (an error in the hopeful direction is what the floor must not risk)."""

    def __init__(self) -> None:
        self.ratio: dict[str, float | None] = {"host": None, "base": None}

    def window(self, host: bool, tokens: int, seconds: float, predicted: float) -> None:
        if seconds <= 0 or predicted <= 0:
            return
        kind, r = ("host" if host else "base"), tokens / seconds / predicted
        old = self.ratio[kind]
        self.ratio[kind] = r if old is None else (1 - REALIZED_EMA) * old + REALIZED_EMA * r

    def host_factor(self) -> float:
        host, base = self.ratio["host"], self.ratio["base"]
        if host is None:
            return 1.0
        return min(1.0, host / (base if base else 1.0))


class VeriCacheController:
    def __init__(self, cost: StepCostModel, kv_bytes_per_token: float, link_bandwidth: float | None,
                 draft_lengths: tuple[int, ...] = DRAFT_LENGTHS):
        self.cost = cost
        self.kv_bytes = kv_bytes_per_token
        self.bandwidth = link_bandwidth  # None: unthrottled
        self.draft_lengths = draft_lengths

    def options(self, r: RequestView) -> list[Plan]:
        """Every plan r may take: decode (resident only), rounds of each draft length, and (host
        tier) waiting."""
        c0, c_row, c_exact, c_comp, c_qk = self.cost.coef
        out = []
        fold = r.fold_s_per_token
        if r.resident:
            out.append(Plan(True, 0, 1.0, c_row + (c_exact + c_qk) * r.committed + fold, 0.0))
        else:
            out.append(Plan(False, 0))
        link_round = 0.0
        if not r.resident and self.bandwidth is not None:
            link_round = self.kv_bytes * r.committed / self.bandwidth
        draft_row = c_row + (c_comp + c_qk) * r.comp_keys
        # Round lengths: the listed ones that fit, else the longest that does (a host-tier request
        # near its end may have room for no draft at all: a one-row verify over streamed KV).
        lengths = sorted({min(x, max(r.max_draft, 0)) for x in self.draft_lengths}) if r.can_draft else [0]
        if r.resident:
            lengths = [x for x in lengths if x > 0]
        for x in lengths:
            keys = r.committed + x / 2  # a verify row sees the committed keys and the rows before it
            verify = (x + 1) * (c_row + c_qk * keys) + c_exact * keys
            e = (1 + expected_accepted(r.accept_rate, x)) / (x + 1)
            out.append(Plan(True, x, e, (x * draft_row + verify) / (x + 1) + e * fold, link_round / (x + 1)))
        return out

    def decide(self, views: list[RequestView]) -> Decision:
        c0, c_draft = self.cost.coef[0], self.cost.draft_overhead
        opts = [self.options(v) for v in views]
        # The floor every decision is held to: what full mode runs at this budget, the resident
        # requests decoding and the host tier idle; then the best plan with the host tier idle.
        # The search over every choice (host-tier rounds at each link price) must beat them.
        idle = [[p for p in o if not p.link_seconds_per_iter] or o for o in opts]
        best = self._evaluate([next((p for p in o if p.run and p.draft_len == 0 and not p.link_seconds_per_iter),
                                    Plan(False, 0)) for o in opts], c0, c_draft)
        best = self._search(idle, (0.0,), c0, best, c_draft)
        prices = (0.0,) if self.bandwidth is None else (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
        best = self._search(opts, prices, c0, best, c_draft)
        if not any(p.run for p in best.plans) and any(p.run for o in opts for p in o):
            # Never park everyone: run each request's plan with the most tokens per iteration.
            best = self._evaluate([max(o, key=lambda p: p.tokens_per_iter) for o in opts], c0, c_draft)
        return best

    def _search(self, opts: list[list[Plan]], prices: tuple[float, ...], c0: float, best: Decision,
                c_draft: float = 0.0) -> Decision:
        """The best of `best` and, per link price mu, Dinkelbach's iterations over the per-request
        choices (each request's plan maximizing tokens - lam * (seconds + mu * link seconds)); each
        candidate is scored by _evaluate, which also charges the shared c_draft."""
        for mu in prices:
            lam = 0.0
            for _ in range(20):  # Dinkelbach: lam converges to the best ratio at this link price
                pick = [max(o, key=lambda p: p.tokens_per_iter - lam * (p.seconds_per_iter + mu * p.link_seconds_per_iter))
                        for o in opts]
                d = self._evaluate(pick, c0, c_draft)
                if d.throughput > best.throughput * (1 + 1e-9):
                    best = d
                if d.throughput <= lam * (1 + 1e-9):
                    break
                lam = d.throughput
        return best

    @staticmethod
    def _evaluate(plans: list[Plan], c0: float, c_draft: float = 0.0) -> Decision:
        """Expected tokens per second of running `plans` together. An iteration costs c0, each plan's
        seconds, and c_draft when any request drafts in it (a round of x drafts does in x of its x + 1
        iterations; rounds drift apart, so independently: with probability 1 - prod 1 / (x + 1)).
        The link is not averaged: an iteration in which k host-tier verifications fall lasts
        max(forward, k * t_v) (t_v: one verification's link time), and k is floor(v) or floor(v) + 1
        for v verifications per iteration on average, so a long transfer stalls every row of its
        iteration."""
        run = [p for p in plans if p.run]
        tokens = sum(p.tokens_per_iter for p in run)
        no_draft = math.prod(1.0 / (p.draft_len + 1) for p in run)
        compute = c0 + sum(p.seconds_per_iter for p in run) + c_draft * (1.0 - no_draft)
        host = [p for p in run if p.link_seconds_per_iter > 0]
        v = sum(1.0 / (p.draft_len + 1) for p in host)  # host verifications per iteration
        link = sum(p.link_seconds_per_iter for p in host)  # link seconds per iteration
        t = compute
        if v > 0:
            t_v = link / v
            k, f = math.floor(v), v - math.floor(v)
            t = (1 - f) * max(compute, k * t_v) + f * max(compute, (k + 1) * t_v)
        return Decision(plans=plans, throughput=tokens / t if t > 0 else 0.0, iteration_s=t,
                        link_bound=link > compute)


def plan_summary(d: Decision) -> str:
    n = len(d.plans)
    dec = sum(1 for p in d.plans if p.run and p.draft_len == 0)
    rounds = sum(1 for p in d.plans if p.run and p.draft_len > 0)
    xs = [p.draft_len for p in d.plans if p.run and p.draft_len > 0]
    mean_x = sum(xs) / len(xs) if xs else 0
    return (f"{n} requests: {dec} decode, {rounds} rounds (mean x {mean_x:.1f}), {n - dec - rounds} waiting; "
            f"predicted {d.throughput:.1f} tok/s, iteration {d.iteration_s * 1e3:.1f} ms"
            + (" (link-bound)" if d.link_bound else ""))

