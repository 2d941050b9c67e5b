"""PROJECTION (not a measurement): VeriCache on an NVIDIA H200, from a cost model.

    .venv/bin/python benchmark/project_gpu.py                    # Llama-3-70B (TP=4), Qwen2.5-32B (TP=1)
    .venv/bin/python benchmark/project_gpu.py --acceptance-json benchmark/results/acceptance.json

Replays the staggering policy of speculative/stagger.py -- the same `VerifyReservations` rings, booked
the same way -- and lock-step VeriCache and full-KV serving, over simulated requests in discrete
iterations whose times come from a cost model instead of a wall clock. Acceptance per round is
sampled (seeded) from round traces measured on the bundled model (bench_acceptance.py).

Cost model, per GPU of a TP group (every GPU holds 1/TP of weights and KV heads, own PCIe link):
  W        = params * 2 / TP                               weight bytes (bf16)
  kv       = 2 * layers * (kv_heads / TP) * head_dim * 2   exact KV bytes per token
  forward  = max(HBM bytes / hbm_bw, FLOPs / peak) + TP all-reduces
    HBM bytes = W + kv * (keys read by all rows) + link bytes (the copy engine's staging writes)
    FLOPs     = 2 * matmul_params / TP * query tokens + 4 * (q_heads / TP) * head_dim * layers * sum(q x keys)
    all-reduce= 2 * layers * (latency + 2 (TP-1)/TP * query tokens * hidden * 2 / nvlink_bw)   (TP > 1)
  rows: full decode (1 query, keys = seq len), draft (1 query, keys = committed / R + drafts + 1,
        compressed KV in HBM), verify (x+1 queries, keys = committed + x + 1, exact KV from staging)
  iteration with verifiers = max(forward, link) + min(forward, link) / layers
    link = sum(verifiers' committed tokens) * kv / link_bw: the exact KV crosses PCIe layer by layer
    into a double-buffered staging area; only the first layer's load (or last layer's compute)
    does not overlap.
Memory, per GPU: usable = HBM * mem_fraction; free = usable - W.
  full      max batch = floor(free / ((P + O) * kv))
  VeriCache max batch = min(floor((free - staging) / ((ceil((P + O) / R) + X + 1) * kv)),
                            floor(host / ((P + O) * kv)))      staging = 2 layers * S rows * kv / layers
Acceptance mapping: a trace round (d drafted, a accepted) sampled uniformly gives the simulated
round of x drafts floor(a * x / d) accepted (a fully accepted round stays fully accepted); a round
emits accepted + 1 tokens. Without traces: a stated constant rate, floor(rate * x). The trace row
is the one whose X is nearest the simulated X: with equal X the mapping is the identity (only
rounds cut short near a request's end are rescaled); across X it assumes the rate carries over
(optimistic for x > d, since a real first mismatch stays where it is).
Prefill is excluded in every mode (decode throughput only); all requests have P prompt and O
output tokens; N = waves * max batch requests per mode, admitted as others finish.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from sglang_vericache.mem_cache.link import split_by_budget
from sglang_vericache.speculative.reservations import VerifyReservations
from sglang_vericache.speculative.stagger import INITIAL_ITER_TIME_S, ITER_TIME_EMA

RESULTS = Path(__file__).parent / "results"
PAPER_SPEEDUP = (1.92, 2.73)  # the paper, Llama-70B, long-context decoding
LABEL = "PROJECTION (cost model of an H200, not a measurement)"


# ---------------------------------------------------------------- shapes and hardware


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tp: int = 1
    qkv_bias: bool = False
    dtype_bytes: int = 2

    def __post_init__(self):
        assert self.kv_heads % self.tp == 0 and self.q_heads % self.tp == 0, "TP must divide the heads"

    @property
    def params(self) -> int:
        """Dense LLaMA-style: q/k/v/o, gated MLP, two norms per layer, untied embedding + lm_head."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden

    @property
    def matmul_params(self) -> int:
        return self.params - self.vocab * self.hidden  # the input embedding is a lookup

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes / self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * (self.kv_heads // self.tp) * self.head_dim * self.dtype_bytes


LLAMA3_70B = ModelShape("Llama-3-70B", layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128,
                        intermediate=28672, vocab=128256, tp=4)
QWEN25_32B = ModelShape("Qwen2.5-32B", layers=64, hidden=5120, q_heads=40, kv_heads=8, head_dim=128,
                        intermediate=27648, vocab=152064, tp=1, qkv_bias=True)


@dataclass(frozen=True)
class GPU:
    hbm_bytes: float = 141e9
    mem_fraction: float = 0.90  # usable for weights + KV; the rest: activations, graphs, allocator
    hbm_bw: float = 4.8e12
    flops: float = 790e12  # bf16 dense
    link_bw: float = 55e9  # host -> GPU, effective, per GPU
    host_bytes: float = 256e9  # host memory for exact KV, per GPU (2 TB / 8 GPUs)
    nvlink_bw: float = 450e9  # per direction
    allreduce_latency_s: float = 0.0


# ---------------------------------------------------------------- cost model


@dataclass
class Work:
    """What one forward does: query tokens, KV bytes read from HBM, sum over queries of keys."""
    tokens: int = 0
    kv_bytes: float = 0.0
    qk: float = 0.0
    link_bytes: float = 0.0

    def add(self, queries: int, keys: float, bytes_per_key: float) -> None:
        self.tokens += queries
        self.kv_bytes += keys * bytes_per_key
        self.qk += queries * keys


@dataclass
class StepTime:
    hbm_s: float
    compute_s: float
    comm_s: float
    link_s: float
    total_s: float


class CostModel:
    def __init__(self, shape: ModelShape, gpu: GPU, ratio: float):
        self.shape, self.gpu, self.ratio = shape, gpu, ratio
        self.kv = shape.kv_bytes_per_token

    # rows
    def full_row(self, w: Work, seq_len: int) -> None:
        w.add(1, seq_len, self.kv)

    def draft_row(self, w: Work, committed: int, drafts: int) -> None:
        w.add(1, committed / self.ratio + drafts + 1, self.kv)

    def verify_row(self, w: Work, committed: int, drafts: int) -> None:
        w.add(drafts + 1, committed + drafts + 1, self.kv)
        w.link_bytes += committed * self.kv

    # time
    def time(self, w: Work) -> StepTime:
        s, g = self.shape, self.gpu
        # The staged exact KV is written to HBM by the copy engine and read back by attention.
        hbm = (s.weight_bytes + w.kv_bytes + w.link_bytes) / g.hbm_bw
        flops = 2 * s.matmul_params / s.tp * w.tokens + 4 * (s.q_heads // s.tp) * s.head_dim * s.layers * w.qk
        compute = flops / g.flops
        comm = 0.0
        if s.tp > 1:
            ar_bytes = 2 * (s.tp - 1) / s.tp * w.tokens * s.hidden * s.dtype_bytes
            comm = 2 * s.layers * (g.allreduce_latency_s + ar_bytes / g.nvlink_bw)
        fwd = max(hbm, compute) + comm
        link = w.link_bytes / g.link_bw if w.link_bytes else 0.0
        total = max(fwd, link) + min(fwd, link) / s.layers
        return StepTime(hbm, compute, comm, link, total)

    # memory
    def free_hbm(self) -> float:
        return self.gpu.hbm_bytes * self.gpu.mem_fraction - self.shape.weight_bytes

    def staging_bytes(self, staging_tokens: int) -> float:
        return 2 * staging_tokens * self.kv / self.shape.layers

    def full_max_batch(self, max_len: int) -> int:
        return max(0, math.floor(self.free_hbm() / (max_len * self.kv)))

    def vc_max_batch(self, max_len: int, max_draft: int, staging_tokens: int) -> int:
        per_req = (math.ceil(max_len / self.ratio) + max_draft + 1) * self.kv
        hbm = math.floor((self.free_hbm() - self.staging_bytes(staging_tokens)) / per_req)
        host = math.floor(self.gpu.host_bytes / (max_len * self.kv))
        return max(0, min(hbm, host))


# ---------------------------------------------------------------- acceptance


class Acceptance:
    """Accepted drafts of a simulated round of x drafts: floor(a * x / d) for a sampled trace
    round (d, a), or floor(rate * x) for a constant rate (fallback)."""

    def __init__(self, rounds: list[tuple[int, int]] | None = None, rate: float | None = None):
        self.rounds = [(int(d), int(a)) for d, a in rounds or [] if d > 0]
        assert self.rounds or rate is not None, "need trace rounds or a constant rate"
        self.rate = rate

    def accepted(self, rng: random.Random, x: int) -> int:
        if x == 0:
            return 0
        if self.rounds:
            d, a = self.rounds[rng.randrange(len(self.rounds))]
            return a * x // d
        return min(x, math.floor(self.rate * x + 1e-9))


def load_trace(path: Path, compressor: str, ratio: float, draft_tokens: int) -> tuple[list, dict]:
    """The round trace of the acceptance.json row for (compressor, ratio), draft length nearest X."""
    rows = json.loads(Path(path).read_text())["rows"]
    rows = [r for r in rows
            if r["compressor"] == compressor and r["ratio"] in (ratio, None) and r.get("round_trace")]
    if not rows:
        raise SystemExit(f"{path}: no row with a round_trace for compressor={compressor} ratio={ratio:g}")
    row = min(rows, key=lambda r: (abs(r["draft_tokens"] - draft_tokens), -r["draft_tokens"]))
    meta = {k: row[k] for k in ("compressor", "ratio", "draft_tokens", "accept_rate", "accept_length")}
    return row["round_trace"], meta


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

    def add(self, t: StepTime) -> None:
        self.seconds += t.total_s
        self.hbm_s += t.hbm_s
        self.compute_s += t.compute_s
        self.link_s += t.link_s
        self.forwards += 1

    def summary(self) -> dict:
        s = max(self.seconds, 1e-30)
        return {"tokens_per_s": self.tokens / s, "seconds": self.seconds, "tokens": self.tokens,
                "link_util": self.link_s / s, "hbm_util": self.hbm_s / s, "compute_util": self.compute_s / s,
                "forwards": self.forwards, "rounds": self.rounds,
                "tokens_per_round": (self.accepted + self.rounds) / self.rounds if self.rounds else None}


class Simulator:
    def __init__(self, cm: CostModel, prompt: int, output: int, max_draft: int, staging_tokens: int,
                 acceptance: Acceptance, seed: int = 0, progress: bool = False):
        assert staging_tokens >= prompt + output, "the staging area must hold one request's exact KV"
        self.cm, self.prompt, self.output = cm, prompt, output
        self.max_draft, self.staging_tokens = max_draft, staging_tokens
        self.acceptance, self.seed, self.progress = acceptance, seed, progress

    def requests(self, n: int) -> list[SimReq]:
        # One RNG per request: request k samples the same rounds in every mode.
        rng = lambda i: random.Random(self.seed * 1_000_003 + i)  # noqa: E731
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

    # -- full KV in HBM: one token per request per step
    def run_full(self, batch: int, n: int) -> Stats:
        st, waiting, running = Stats(), self.requests(n), []
        with self._bar(n, "full") as bar:
            while waiting or running:
                while waiting and len(running) < batch:
                    running.append(waiting.pop(0))
                w = Work()
                for r in running:
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

    # -- VeriCache staggered: speculative/stagger.py's step(), with the cost model's iteration time
    def run_staggered(self, batch: int, n: int) -> Stats:
        cm, X = self.cm, self.max_draft
        bw = cm.gpu.link_bw
        iter_time = INITIAL_ITER_TIME_S
        rings = VerifyReservations(2 * X + 2, bw * iter_time, self.staging_tokens)
        st, waiting, running = Stats(), self.requests(n), []

        def book(r: SimReq, min_offset: int) -> int:
            nbytes = r.committed * cm.kv
            at = rings.reserve(min_offset, nbytes, r.committed)
            r.booking = (at, nbytes, r.committed)
            return at

        with self._bar(n, "staggered") as bar:
            while waiting or running:
                while waiting and len(running) < batch:
                    running.append(waiting.pop(0))
                for r in running:
                    if r.booking is None:  # StaggeredVeriCache.book
                        x = max(0, min(X, r.left - 1))
                        at = book(r, x)
                        r.drafts, r.target = 0, max(0, min(at - rings.iteration, X, r.left - 1))
                verifiers = [r for r in running if r.booking[0] <= rings.iteration]
                if verifiers:  # over-budget bookings (past the horizon) wait one more iteration
                    groups = self.split(verifiers)
                    verifiers = groups[0]
                    for r in (r for g in groups[1:] for r in g):
                        rings.cancel(*r.booking)
                        book(r, 1)
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
                iter_time = (1 - ITER_TIME_EMA) * iter_time + ITER_TIME_EMA * t.total_s
                # stagger.py calls set_link_budget every step; with an infinite link that gives
                # inf - inf = NaN slots (reported bug), so only a changed budget is applied.
                if bw * iter_time != rings.link_bytes_per_iter:
                    rings.set_link_budget(bw * iter_time)
                rings.advance()
        return st


# ---------------------------------------------------------------- one configuration


def project(shape: ModelShape, gpu: GPU, context: int, output: int, ratio: float, max_draft: int,
            acceptance: Acceptance, staging_bytes: float = 2e9, waves: int = 4, seed: int = 0,
            progress: bool = False) -> dict:
    cm = CostModel(shape, gpu, ratio)
    max_len = context + output
    # Staging rows S: what staging_bytes holds (2 layers per row), at least one whole request.
    staging = max(max_len, math.floor(staging_bytes / cm.staging_bytes(1)))
    sim = Simulator(cm, context, output, max_draft, staging, acceptance, seed, progress)
    b_full = cm.full_max_batch(max_len)
    b_vc = cm.vc_max_batch(max_len, max_draft, staging)
    row = {"shape": shape.name, "tp": shape.tp, "context": context, "output": output, "ratio": ratio,
           "draft_tokens": max_draft, "link_gbps": gpu.link_bw / 1e9, "staging_tokens": staging,
           "max_batch_full": b_full, "max_batch_vc": b_vc}
    runs = {}
    if b_full > 0:
        runs["full"] = sim.run_full(b_full, waves * b_full).summary()
    if b_vc > 0:
        runs["lockstep"] = sim.run_lockstep(b_vc, waves * b_vc).summary()
        runs["staggered"] = sim.run_staggered(b_vc, waves * b_vc).summary()
    row["modes"] = runs
    full = runs.get("full", {}).get("tokens_per_s")
    for mode in ("lockstep", "staggered"):
        tps = runs.get(mode, {}).get("tokens_per_s")
        row[f"speedup_{mode}"] = tps / full if full and tps else None
    # Whatever the schedule: each round moves the whole committed exact KV over the link once.
    per_round = runs.get("staggered", {}).get("tokens_per_round")
    mean_kv = (context + output / 2) * cm.kv
    row["link_ceiling_tps"] = per_round * gpu.link_bw / mean_kv if per_round else None
    return row


# ---------------------------------------------------------------- report


def fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def summary(rows: list[dict]) -> list[str]:
    """One line per (shape, link): the projected staggered speedup range beside the paper's."""
    out = []
    for key in dict.fromkeys((r["shape"], r["tp"], r["link_gbps"]) for r in rows):
        sel = [r for r in rows if (r["shape"], r["tp"], r["link_gbps"]) == key and r["speedup_staggered"]]
        if not sel:
            continue
        sp = [r["speedup_staggered"] for r in sel]
        util = [r["modes"]["staggered"]["link_util"] for r in sel]
        ctx = "/".join(f"{r['context'] // 1024}K" for r in sel)
        busy = f"link busy {min(util):.0%}-{max(util):.0%}"
        out.append(f"- {key[0]} (TP={key[1]}), {key[2]:g} GB/s {link_name(key[2])}: staggered VeriCache "
                   f"{min(sp):.2f}-{max(sp):.2f}x full KV at {ctx} ({busy}); "
                   f"paper, Llama-70B: {PAPER_SPEEDUP[0]}-{PAPER_SPEEDUP[1]}x. PROJECTION.")
    return out


def markdown(rows: list[dict], meta: dict) -> str:
    lo, hi = PAPER_SPEEDUP
    lines = [
        f"# VeriCache on an H200: {LABEL}",
        "",
        f"Acceptance: {meta['acceptance_source']}. Paper (measured, Llama-70B, long context): "
        f"{lo}-{hi}x over full KV. Decode throughput only (prefill excluded); per TP group.",
        f"Hardware: HBM {meta['gpu']['hbm_bw'] / 1e12:g} TB/s, {meta['gpu']['hbm_bytes'] / 1e9:g} GB "
        f"(x{meta['gpu']['mem_fraction']:g} usable), bf16 {meta['gpu']['flops'] / 1e12:g} TFLOP/s, "
        f"host memory {meta['gpu']['host_bytes'] / 1e9:g} GB per GPU; host link per row, GB/s per GPU: "
        "55 = PCIe Gen5 effective (the H200 projection), 450 = a Grace-Hopper-class NVLink-C2C link "
        "(sensitivity, not an H200 with PCIe).",
        "",
        *summary(rows),
        "",
        "| shape (TP) | context | R | X | link GB/s | batch full | batch VC | full tok/s | lock-step tok/s | "
        "staggered tok/s | lock-step x | staggered x | tok/round | link util (stag) | HBM util (stag) | "
        "link ceiling tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        m = r["modes"]
        tps = {k: m.get(k, {}).get("tokens_per_s") for k in ("full", "lockstep", "staggered")}
        stg = m.get("staggered", {})
        lines.append(
            f"| {r['shape']} ({r['tp']}) | {r['context'] // 1024}K | {r['ratio']:g} | {r['draft_tokens']} | "
            f"{r['link_gbps']:g} | {r['max_batch_full']} | {r['max_batch_vc']} | {fmt(tps['full'], '.0f')} | "
            f"{fmt(tps['lockstep'], '.0f')} | {fmt(tps['staggered'], '.0f')} | "
            f"{fmt(r['speedup_lockstep'])} | {fmt(r['speedup_staggered'])} | "
            f"{fmt(stg.get('tokens_per_round'))} | {fmt(stg.get('link_util'), '.0%')} | "
            f"{fmt(stg.get('hbm_util'), '.0%')} | {fmt(r['link_ceiling_tps'], '.0f')} |")
    lines += ["", "x = projected tokens/s over full KV. link ceiling = tokens per round x link bandwidth / "
              "mean exact KV bytes of a request: no schedule that moves a request's exact KV once per "
              "round beats it.", "", f"All numbers above are a {LABEL}."]
    return "\n".join(lines)


def link_name(gbps: float) -> str:
    return {55.0: "PCIe Gen5", 450.0: "C2C-class, sensitivity"}.get(gbps, "link")


def plot(rows: list[dict], path: Path, subtitle: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    keys = list(dict.fromkeys((r["ratio"], r["draft_tokens"], r["link_gbps"]) for r in rows))
    colors = {k: f"C{i}" for i, k in enumerate(keys)}
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.5 * len(shapes), 4.8), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        pts = [r for r in rows if r["shape"] == name]
        for key in keys:
            sel = sorted((r for r in pts if (r["ratio"], r["draft_tokens"], r["link_gbps"]) == key),
                         key=lambda r: r["context"])
            xs = [r["context"] // 1024 for r in sel]
            lab = f"R={key[0]:g} X={key[1]}, {key[2]:g} GB/s {link_name(key[2])}"
            ax.plot(xs, [r["speedup_staggered"] or 0 for r in sel], marker="o", c=colors[key],
                    label=f"staggered, {lab}")
            ax.plot(xs, [r["speedup_lockstep"] or 0 for r in sel], marker="x", ls="--", c=colors[key],
                    label=f"lock-step, {lab}")
        if "70B" in name:
            ax.axhspan(*PAPER_SPEEDUP, color="tab:green", alpha=0.12,
                       label=f"paper: {PAPER_SPEEDUP[0]}-{PAPER_SPEEDUP[1]}x, Llama-70B (measured)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["context"] // 1024 for r in pts})
        ax.set_xticks(ticks, [f"{t}K" for t in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("context (K tokens), ~1K output tokens")
        ax.set_ylabel("projected speedup over full KV")
        ax.set_title(f"PROJECTION: {name} (TP={pts[0]['tp']}) on H200")
        ax.legend(fontsize=7)
    fig.suptitle(f"{LABEL}\n{subtitle}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["llama3-70b", "qwen2.5-32b"]
    p.add_argument("--shapes", nargs="+", default=names, choices=names, help="Model shapes to project.")
    p.add_argument("--llama-tp", type=int, default=4, help="Tensor-parallel degree for Llama-3-70B.")
    p.add_argument("--qwen-tp", type=int, default=1, help="Tensor-parallel degree for Qwen2.5-32B.")
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072], help="Prompt tokens P.")
    p.add_argument("--output-tokens", type=int, default=1024, help="Output tokens O per request.")
    p.add_argument("--ratios", type=float, nargs="+", default=[4.0], help="KV compression ratios R.")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[30],
                   help="Draft lengths X (fixed, as in the paper).")
    p.add_argument("--link-gbps", type=float, nargs="+", default=[55.0, 450.0],
                   help="Host->GPU link, GB/s per GPU: 55 = PCIe Gen5 effective (the H200 headline); "
                        "450 = a sensitivity row, a Grace-Hopper-class NVLink-C2C host link.")
    p.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth, TB/s.")
    p.add_argument("--hbm-gb", type=float, default=141.0, help="HBM capacity, GB.")
    p.add_argument("--mem-fraction", type=float, default=0.90, help="Share of HBM for weights + KV.")
    p.add_argument("--tflops", type=float, default=790.0, help="bf16 dense TFLOP/s.")
    p.add_argument("--host-gb", type=float, default=256.0, help="Host memory for exact KV, GB per GPU.")
    p.add_argument("--nvlink-gbps", type=float, default=450.0,
                   help="NVLink all-reduce bandwidth, GB/s per direction.")
    p.add_argument("--allreduce-latency-us", type=float, default=0.0,
                   help="Fixed latency per TP all-reduce, microseconds.")
    p.add_argument("--staging-gb", type=float, default=2.0,
                   help="HBM for the double-buffered verify staging area, GB per GPU (rows S = what it holds "
                        "at 2 layers per row, at least one request's P + O).")
    p.add_argument("--waves", type=int, default=4, help="Requests per mode = waves x that mode's max batch.")
    p.add_argument("--acceptance-json", type=Path, default=RESULTS / "acceptance.json",
                   help="bench_acceptance.py output with round_trace rows (fallback rate if missing).")
    p.add_argument("--compressor", default="snapkv",
                   help="Which acceptance.json compressor's trace to use (quantizers' rows have no ratio: "
                        "pass their effective ratio in --ratios).")
    p.add_argument("--fallback-accept-rate", type=float, default=0.8,
                   help="Constant acceptance rate when no trace file exists (labeled in every output).")
    p.add_argument("--seed", type=int, default=0, help="Seed of the trace sampling.")
    p.add_argument("--out", default="project_gpu", help="Output stem: writes STEM.json, STEM.md, STEM.png.")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="Folder for the outputs.")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)

    gpu = GPU(hbm_bytes=args.hbm_gb * 1e9, mem_fraction=args.mem_fraction, hbm_bw=args.hbm_tbps * 1e12,
              flops=args.tflops * 1e12, host_bytes=args.host_gb * 1e9, nvlink_bw=args.nvlink_gbps * 1e9,
              allreduce_latency_s=args.allreduce_latency_us * 1e-6)
    shapes = {"llama3-70b": ModelShape(**{**asdict(LLAMA3_70B), "tp": args.llama_tp}),
              "qwen2.5-32b": ModelShape(**{**asdict(QWEN25_32B), "tp": args.qwen_tp})}
    have_trace = args.acceptance_json.exists()
    if not have_trace:
        print(f"WARNING: {args.acceptance_json} not found; using a CONSTANT acceptance rate of "
              f"{args.fallback_accept_rate:.0%} (fallback, not measured)", file=sys.stderr)
    configs = [(s, c, r, x, l) for s in args.shapes for c in args.contexts for r in args.ratios
               for x in args.draft_tokens for l in args.link_gbps]
    rows = []
    for s, c, r, x, l in tqdm(configs, desc="projections"):
        if have_trace:
            rounds, tmeta = load_trace(args.acceptance_json, args.compressor, r, x)
            acc = Acceptance(rounds=rounds)
        else:
            acc = Acceptance(rate=args.fallback_accept_rate)
            tmeta = {"fallback_rate": args.fallback_accept_rate}
        g = GPU(**{**asdict(gpu), "link_bw": l * 1e9})
        row = project(shapes[s], g, c, args.output_tokens, r, x, acc, args.staging_gb * 1e9, args.waves,
                      args.seed, progress=True)
        row["acceptance"] = tmeta
        rows.append(row)
    source = (f"round traces from {args.acceptance_json} ({args.compressor}), rate mapped onto X"
              if have_trace else
              f"FALLBACK constant acceptance rate {args.fallback_accept_rate:.0%} (no trace file)")
    meta = {"label": LABEL, "acceptance_source": source, "paper_speedup_llama70b": PAPER_SPEEDUP,
            "gpu": asdict(gpu), "args": {k: str(v) for k, v in vars(args).items()},
            "shapes": {k: {**asdict(v), "params": v.params, "weight_bytes_per_gpu": v.weight_bytes,
                           "kv_bytes_per_token_per_gpu": v.kv_bytes_per_token} for k, v in shapes.items()
                       if k in args.shapes}}
    out = args.results_dir / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, meta)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    plot(rows, out.with_suffix(".png"), f"acceptance: {source}")
    print(table)
    print(f"\nwrote {out}.json, .md, .png  -- {LABEL}")


if __name__ == "__main__":
    main()
