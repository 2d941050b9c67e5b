"""The GPU projection's simulator: acceptance sampled from measured round traces, and the policies
(full, lock-step, staggered, adaptive) replayed in discrete iterations timed by gpu_cost_model.CostModel.

The staggered and adaptive policies book their streamed verifications in the same
`VerifyReservations` rings speculative/stagger.py keeps, updated the same way; the adaptive policy
chooses with gpu_cost_model.Policy, round by round.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cost_model import Batch, CostModel, Option, Policy, StepTime, Work
from sglang_vericache.mem_cache.link import split_by_budget
from sglang_vericache.speculative.reservations import VerifyReservations
from sglang_vericache.speculative.booking import INITIAL_ITER_TIME_S, ITER_TIME_EMA

# ---------------------------------------------------------------- acceptance


class Acceptance:
    """Accepted drafts of a simulated round of x drafts: floor(a * x / d) for a sampled trace
    round (d, a) (of the trace whose draft length is nearest x, when traces per length are given),
    or floor(rate * x) for a constant rate (fallback)."""

    def __init__(
        self,
        rounds: list[tuple[int, int]] | None = None,
        rate: float | None = None,
        by_x: dict[int, list] | None = None,
    ):
        traces = dict(by_x or {})
        if rounds:
            traces[0] = rounds  # one trace for every x
        self.traces = {d: [(int(n), int(a)) for n, a in r if n > 0] for d, r in traces.items()}
        self.traces = {d: r for d, r in self.traces.items() if r}
        assert self.traces or rate is not None, "need trace rounds or a constant rate"
        self.rate = rate
        self._expected: dict[int, float] = {}

    @property
    def rounds(self) -> list[tuple[int, int]]:
        return next(iter(self.traces.values()), [])

    def trace(self, x: int) -> list[tuple[int, int]]:
        if 0 in self.traces or len(self.traces) == 1:
            return self.rounds
        return self.traces[min(self.traces, key=lambda d: (abs(d - x), -d))]

    def accepted(self, rng: random.Random, x: int) -> int:
        if x == 0:
            return 0
        if self.traces:
            rounds = self.trace(x)
            d, a = rounds[rng.randrange(len(rounds))]
            return a * x // d
        return min(x, math.floor(self.rate * x + 1e-9))

    def expected(self, x: int) -> float:
        """E[accepted drafts] of a round of x: the mean of what accepted() samples."""
        if x not in self._expected:
            if x == 0:
                v = 0.0
            elif self.traces:
                rounds = self.trace(x)
                v = sum(a * x // d for d, a in rounds) / len(rounds)
            else:
                v = float(min(x, math.floor(self.rate * x + 1e-9)))
            self._expected[x] = v
        return self._expected[x]


def _trace_rows(path: Path, compressor: str, ratio: float) -> list[dict]:
    rows = json.loads(Path(path).read_text())["rows"]
    rows = [
        r
        for r in rows
        if r["compressor"] == compressor and r["ratio"] in (ratio, None) and r.get("round_trace")
    ]
    if not rows:
        raise SystemExit(f"{path}: no row with a round_trace for compressor={compressor} ratio={ratio:g}")
    return rows


def load_trace(path: Path, compressor: str, ratio: float, draft_tokens: int) -> tuple[list, dict]:
    """The round trace of the acceptance.json row for (compressor, ratio), draft length nearest X."""
    rows = _trace_rows(path, compressor, ratio)
    row = min(rows, key=lambda r: (abs(r["draft_tokens"] - draft_tokens), -r["draft_tokens"]))
    meta = {k: row[k] for k in ("compressor", "ratio", "draft_tokens", "accept_rate", "accept_length")}
    return row["round_trace"], meta


def load_traces(path: Path, compressor: str, ratio: float) -> tuple[dict[int, list], dict]:
    """Every draft length's round trace for (compressor, ratio): {draft_tokens: rounds}."""
    rows = _trace_rows(path, compressor, ratio)
    traces: dict[int, list] = {}
    for r in rows:  # rows of one draft length (other contexts or prompt kinds): their rounds pooled
        traces.setdefault(r["draft_tokens"], []).extend(r["round_trace"])
    meta = {}
    for x, rounds in traces.items():
        drafted, accepted = sum(d for d, _ in rounds), sum(a for _, a in rounds)
        meta[x] = {"accept_rate": accepted / max(drafted, 1), "accept_length": (accepted + len(rounds)) / len(rounds),
                   "rows": sum(r["draft_tokens"] == x for r in rows)}
    return traces, meta


# ---------------------------------------------------------------- simulator


@dataclass
class SimReq:
    rid: int
    prompt: int
    max_new: int
    rng: random.Random
    emitted: int = 0
    drafts: int = 0
    target: int = 0
    booking: tuple | None = None  # (iteration, link bytes, staging rows), as stagger.py keeps it
    resident: bool = False  # adaptive: exact KV in device memory
    option: Option | None = None  # adaptive: the choice of its current round

    @property
    def committed(self) -> int:
        return self.prompt + self.emitted

    @property
    def left(self) -> int:
        return self.max_new - self.emitted


@dataclass
class Stats:
    seconds: float = 0.0
    tokens: int = 0
    hbm_s: float = 0.0
    compute_s: float = 0.0
    link_s: float = 0.0
    forwards: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    decodes: int = 0  # adaptive: plain decode steps
    choices: Counter = field(default_factory=Counter)  # adaptive: (tier, x) of each round begun

    def add(self, t: StepTime) -> None:
        self.seconds += t.total_s
        self.hbm_s += t.hbm_s
        self.compute_s += t.compute_s
        self.link_s += t.link_s
        self.forwards += 1

    def summary(self) -> dict:
        s = max(self.seconds, 1e-30)
        out = {
            "tokens_per_s": self.tokens / s,
            "seconds": self.seconds,
            "tokens": self.tokens,
            "link_util": self.link_s / s,
            "hbm_util": self.hbm_s / s,
            "compute_util": self.compute_s / s,
            "forwards": self.forwards,
            "rounds": self.rounds,
            "tokens_per_round": (self.accepted + self.rounds) / self.rounds if self.rounds else None,
        }
        if self.choices or self.decodes:
            out["decode_steps"] = self.decodes
            out["rounds_by_tier_x"] = {f"{tier} x={x}": n for (tier, x), n in sorted(self.choices.items())}
        return out


class Simulator:
    def __init__(
        self,
        cm: CostModel,
        prompt: int,
        output: int,
        max_draft: int,
        staging_tokens: int,
        acceptance: Acceptance,
        seed: int = 0,
        progress: bool = False,
    ):
        assert staging_tokens >= prompt + output, "the staging area must hold one request's exact KV"
        self.cm, self.prompt, self.output = cm, prompt, output
        self.max_draft, self.staging_tokens = max_draft, staging_tokens
        self.acceptance, self.seed, self.progress = acceptance, seed, progress

    def requests(self, n: int) -> list[SimReq]:
        # One RNG per request: request k samples the same rounds in every mode.
        rng = lambda i: random.Random(self.seed * 1_000_003 + i)
        return [SimReq(i, self.prompt, self.output, rng(i)) for i in range(n)]

    def _bar(self, n: int, desc: str):
        return tqdm(total=n * self.output, desc=desc, unit="tok", disable=not self.progress, leave=False)

    def verify(self, st: Stats, r: SimReq) -> None:
        """Accept a round of r.drafts, emit accepted + 1 tokens (cut at max_new)."""
        j = self.acceptance.accepted(r.rng, r.drafts)
        m = min(j + 1, r.left)
        r.emitted += m
        st.tokens += m
        st.rounds += 1
        st.drafted += r.drafts
        st.accepted += j
        r.drafts = 0

    def split(self, group: list[SimReq]) -> list[list[SimReq]]:
        """mem_cache/link.py Link.split: consecutive groups whose committed rows fit the staging area."""
        return split_by_budget(group, lambda r: r.committed, self.staging_tokens)

    # -- full KV in HBM (or, compressed=True, lossy mode: compressed KV only): one token per request per step
    def run_full(self, batch: int, n: int, compressed: bool = False) -> Stats:
        st, waiting, running = Stats(), self.requests(n), []
        with self._bar(n, "lossy" if compressed else "full") as bar:
            while waiting or running:
                while waiting and len(running) < batch:
                    running.append(waiting.pop(0))
                w = Work()
                for r in running:
                    if compressed:
                        self.cm.draft_row(w, r.committed, 0)
                    else:
                        self.cm.full_row(w, r.committed + 1)
                st.add(self.cm.time(w))
                for r in running:
                    r.emitted += 1
                st.tokens += len(running)
                bar.update(len(running))
                running = [r for r in running if r.left > 0]
        return st

    # -- VeriCache lock-step: everyone drafts x steps, then verify groups that fit the staging area
    def run_lockstep(self, batch: int, n: int) -> Stats:
        st, waiting, running = Stats(), self.requests(n), []
        with self._bar(n, "lock-step") as bar:
            while waiting or running:
                while waiting and len(running) < batch:
                    running.append(waiting.pop(0))
                for r in running:
                    r.drafts, r.target = 0, max(0, min(self.max_draft, r.left - 1))
                while group := [r for r in running if r.drafts < r.target]:
                    w = Work()
                    for r in group:
                        self.cm.draft_row(w, r.committed, r.drafts)
                    st.add(self.cm.time(w))
                    for r in group:
                        r.drafts += 1
                before = st.tokens
                for group in self.split(running):
                    w = Work()
                    for r in group:
                        self.cm.verify_row(w, r.committed, r.drafts)
                    st.add(self.cm.time(w))
                    for r in group:
                        self.verify(st, r)
                bar.update(st.tokens - before)
                running = [r for r in running if r.left > 0]
        return st

    # -- the link's reservation rings, as speculative/stagger.py keeps them
    def _rings(self, horizon_x: int) -> tuple[VerifyReservations, callable]:
        rings = VerifyReservations(
            2 * horizon_x + 2, self.cm.gpu.link_bw * INITIAL_ITER_TIME_S, self.staging_tokens
        )

        def book(r: SimReq, min_offset: int) -> int:
            nbytes = r.committed * self.cm.kv
            at = rings.reserve(min_offset, nbytes, r.committed)
            r.booking = (at, nbytes, r.committed)
            return at

        return rings, book

    def _due(self, rings: VerifyReservations, book, host: list[SimReq]) -> list[SimReq]:
        """Host-tier requests whose booked verification is now, as many as the staging area holds;
        the others (over-budget bookings past the horizon) wait one more iteration."""
        verifiers = [r for r in host if r.booking is not None and r.booking[0] <= rings.iteration]
        if verifiers:
            groups = self.split(verifiers)
            verifiers = groups[0]
            for r in (r for g in groups[1:] for r in g):
                rings.cancel(*r.booking)
                book(r, 1)
        return verifiers

    def _tick(self, rings: VerifyReservations, iter_time: float, t: StepTime) -> float:
        bw = self.cm.gpu.link_bw
        iter_time = (1 - ITER_TIME_EMA) * iter_time + ITER_TIME_EMA * t.total_s
        # stagger.py calls set_link_budget every step; with an infinite link that gives
        # inf - inf = NaN slots (reported bug), so only a changed budget is applied.
        if bw * iter_time != rings.link_bytes_per_iter:
            rings.set_link_budget(bw * iter_time)
        rings.advance()
        return iter_time

    # -- VeriCache staggered: speculative/stagger.py's step(), with the cost model's iteration time
    def run_staggered(self, batch: int, n: int) -> Stats:
        cm, X = self.cm, self.max_draft
        iter_time = INITIAL_ITER_TIME_S
        rings, book = self._rings(X)
        st, waiting, running = Stats(), self.requests(n), []
        with self._bar(n, "staggered") as bar:
            while waiting or running:
                while waiting and len(running) < batch:
                    running.append(waiting.pop(0))
                for r in running:
                    if r.booking is None:  # StaggeredVeriCache.book
                        x = max(0, min(X, r.left - 1))
                        at = book(r, x)
                        r.drafts, r.target = 0, max(0, min(at - rings.iteration, X, r.left - 1))
                verifiers = self._due(rings, book, running)
                vset = {r.rid for r in verifiers}
                drafting = [r for r in running if r.rid not in vset and r.drafts < r.target]
                if not verifiers and not drafting:
                    rings.advance()  # everyone waits for its booked iteration
                    continue
                w = Work()
                for r in drafting:
                    cm.draft_row(w, r.committed, r.drafts)
                for r in verifiers:
                    cm.verify_row(w, r.committed, r.drafts)
                t = cm.time(w)
                st.add(t)
                for r in drafting:
                    r.drafts += 1
                before = st.tokens
                for r in verifiers:
                    r.booking = None
                    self.verify(st, r)
                bar.update(st.tokens - before)
                running = [r for r in running if r.left > 0]
                iter_time = self._tick(rings, iter_time, t)
        return st

    # -- adaptive: the controller's rule (gpu_cost_model.Policy), round by round
    def run_adaptive(self, policy: Policy, plan: dict, n: int) -> Stats:
        cm = self.cm
        drafting_res = plan["drafting"]
        iter_time = INITIAL_ITER_TIME_S
        rings, book = self._rings(max(policy.draft_lengths))
        st, waiting, running = Stats(), self.requests(n), []
        batch = Batch()  # the running requests' current options

        def choose(r: SimReq) -> Option:
            o = policy.best(batch, policy.options(r.committed, r.resident, drafting_res, max(0, r.left - 1)))
            batch.add(o)
            return o

        def drop(r: SimReq) -> None:
            if r.option is not None:
                batch.remove(r.option)
                r.option = None

        with self._bar(n, "adaptive") as bar:
            while waiting or running:
                n_res = sum(r.resident for r in running)
                while waiting and n_res < plan["residents"]:
                    r = waiting.pop(0)
                    r.resident = True
                    running.append(r)
                    n_res += 1
                n_host = len(running) - n_res
                while waiting and n_host < plan["host"]:
                    # Admit a host-tier request only while it adds throughput.
                    cand = waiting[0]
                    opts = policy.options(cand.committed, False, True, max(0, cand.left - 1))
                    if running and policy.best(batch, opts).kind == "wait":
                        break
                    running.append(waiting.pop(0))
                    n_host += 1
                for r in running:
                    if r.option is not None:
                        continue
                    if not r.resident and n_res < plan["residents"]:
                        # Device memory has room again (nobody waits for it): its last verify streamed
                        # the exact KV in anyway, so it stays (no extra transfer in this model).
                        r.resident, n_res = True, n_res + 1
                    r.option = o = choose(r)
                    if o.kind == "round":
                        st.choices[("resident" if r.resident else "host", o.x)] += 1
                        r.drafts = 0
                        if r.resident:
                            r.target = o.x
                        else:
                            at = book(r, o.x)
                            r.target = max(0, min(at - rings.iteration, o.x))
                host = [r for r in running if not r.resident and r.option.kind == "round"]
                verifiers = self._due(rings, book, host)
                vset = {r.rid for r in verifiers}
                w = Work()
                decoders, res_verify, drafters = [], [], []
                for r in running:
                    if r.option.kind == "decode":
                        cm.full_row(w, r.committed + 1)
                        decoders.append(r)
                    elif r.option.kind == "round" and r.rid in vset:
                        cm.verify_row(w, r.committed, r.drafts, staged=True)
                    elif r.option.kind == "round" and r.drafts < r.target:
                        cm.draft_row(w, r.committed, r.drafts)
                        drafters.append(r)
                    elif r.option.kind == "round" and r.resident:
                        cm.verify_row(w, r.committed, r.drafts, staged=False)  # exact KV in device memory
                        res_verify.append(r)
                if not w.requests:
                    for r in running:
                        if r.option.kind == "wait":
                            drop(r)
                    rings.advance()  # everyone waits for its booked iteration (or to be rescheduled)
                    continue
                t = cm.time(w)
                st.add(t)
                before = st.tokens
                for r in drafters:
                    r.drafts += 1
                for r in decoders:
                    r.emitted += 1
                    st.tokens += 1
                    st.decodes += 1
                for r in res_verify + verifiers:
                    r.booking = None
                    self.verify(st, r)
                for r in decoders + res_verify + verifiers + [r for r in running if r.option.kind == "wait"]:
                    drop(r)  # its round is over: the next one is chosen afresh
                bar.update(st.tokens - before)
                done = [r for r in running if r.left <= 0]
                for r in done:
                    drop(r)
                running = [r for r in running if r.left > 0]
                iter_time = self._tick(rings, iter_time, t)
        return st
