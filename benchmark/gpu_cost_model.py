"""The cost model behind benchmark/project_gpu.py, and the adaptive policy's decision rule.

Pure Python (no torch, no sglang imports), so the product's controller can take these formulas as
its prior. Everything is per device of a tensor-parallel group: each holds 1/TP of the weights and
KV heads and has its own host link.

Sizes (ModelShape):
  W   = params * 2 / TP                                  weight bytes (bf16)
  k   = 2 * layers * (kv_heads / TP) * head_dim * 2      exact KV bytes per token
  F_row = 2 * matmul_params / TP                         matmul FLOPs of one query row
  F_qk  = 4 * (q_heads / TP) * head_dim * layers         attention FLOPs of one (query, key) pair

One forward (CostModel.time, the simulator's clock) over rows with q query tokens in all, reading
K keys' KV, Q = sum over queries of the keys each sees, and S staged bytes (exact KV the link brings):
  mem     = (W + K * k + S) / hbm_bw                       (the copy engine writes S; attention reads it)
  compute = (F_row * q + F_qk * Q) / flops
  comm    = 2 * layers * (latency + 2 (TP-1)/TP * q * hidden * 2 / nvlink_bw)    (TP > 1)
  forward = max(mem, compute) + comm                       accelerators: memory and compute overlap
          = per_forward + per_request * requests + [drafts] * draft_overhead
            + max(W / hbm_bw, F_row q / flops) + K k / kv_bw + F_qk Q / attn_flops + S / hbm_bw + comm
                                                           serial profiles (one CPU thread): summed
  link    = S / link_bw
  step    = max(forward, link) + min(forward, link) / layers   (layer-by-layer double buffering)

Rows: decode (1 query, L keys), draft (1 query, L/R + j + 1 keys for the j-th draft), verify
(x + 1 queries, L + x + 1 keys; staged S = L k when the exact KV is on the host, 0 when resident).

The adaptive policy (Policy: what the product's controller does; project_gpu.py runs it round by round).

Options. Per request, when it starts a round, with L its committed length:
  decode          (resident only)   e = 1                      rows: one decode row
  round of x      (x in DRAFT_LENGTHS, x <= tokens left - 1, and x = tokens left - 1 below the longest)
                                    e = (1 + A(x)) / (x + 1)   rows: x draft rows + one verify row, / (x + 1)
                  A(x) = expected accepted drafts of a round of x (the acceptance model's mean)
                  host tier: the verify row streams S = L k bytes (v = 1 / (x + 1) streamed verifications)
                  resident:  the verify row reads the exact KV from device memory (S = 0)
  wait            (host tier only)  e = 0                      rows: none
e and the rows are per-iteration averages over the x + 1 iterations the round takes.

Theta (Policy.evaluate), the batch's predicted tokens/s with option o added to the others' current ones:
  R, E_r = the resident options' rows and tokens; H, E_h = the host-tier ones'; v = H's verifications
  t_v    = (H.S / v) / link_bw                       one streamed verification's link seconds
  cap    = max(1, floor(step(R + H / v) / t_v))      verifications an iteration carries (its link budget is
                                                     its own duration x bandwidth; a bigger one takes a slot)
  s      = min(1, cap / v)                           share of host rounds that run (s < 1: link saturated)
  Theta  = (E_r + s E_h) / expected_step(R + s H)
  expected_step: the forward is the step formula on the averaged rows, but a verification's transfer
  happens inside its own iteration (it is not spread over iterations): with v' = s v per iteration,
  (1 - frac) * overlap(forward, floor(v') t_v) + frac * overlap(forward, (floor(v') + 1) t_v),
  frac = v' - floor(v'), overlap(f, l) = max(f, l) + min(f, l) / layers.

Decision (Policy.best): o* = argmax Theta over decode and the rounds (ties: decode, then shorter x); a
host-tier request waits instead only if waiting gives a higher Theta while the link is not saturated
(on a saturated link it books a slot; the reservations order the verifications). Maximizing Theta is
minimizing the batch's expected seconds per emitted token, 1 / Theta; with a linear step time
t = c0 + sum d_o it is the Dinkelbach rule e_o - Theta * d_o.

Placement (Policy.plan, then admission). Device memory: residents hold their exact KV, plus a compressed
tier and draft scratch (ceil((P + O) / R) + X + 1) k only if residents may run rounds; host-tier requests
hold compressed tier + scratch; the staging area once any request is on the host. For drafting residents
yes / no and every host-tier count n_h, the residents that still fit, every request at P + O / 2 taking
the best option of its tier: the plan is the highest Theta (ties: fewer drafting, more on the host, which
on a saturated link is the queue). Full mode is a plan (residents only decode, none on the host), so
the plan's Theta is never below full's. Admission: a waiting request becomes resident while the plan's
residents fit, else host tier while the plan's n_h allows and Policy.best would not make it wait; a
host-tier request whose round ends when a resident place is free (nobody waiting) stays resident.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

DRAFT_LENGTHS = (4, 8, 16, 30)

# ---------------------------------------------------------------- shapes


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
    tied_embeddings: bool = False
    dtype_bytes: int = 2
    kv_dtype_bytes: int | None = None  # exact KV element bytes (None: dtype_bytes)

    def __post_init__(self):
        assert self.kv_heads % self.tp == 0 and self.q_heads % self.tp == 0, "TP must divide the heads"

    @property
    def params(self) -> int:
        """Dense LLaMA-style: q/k/v/o, gated MLP, two norms per layer, embedding + lm_head (one if tied)."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = self.hidden * (q + 2 * kv) + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = (1 if self.tied_embeddings else 2) * self.vocab * self.hidden
        return self.layers * layer + embeddings + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters in matrix products per row (the input embedding is a lookup; tied, the lm_head is it)."""
        return self.params - (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes / self.tp

    @property
    def kv_bytes_per_token(self) -> int:
        return (
            2
            * self.layers
            * (self.kv_heads // self.tp)
            * self.head_dim
            * (self.kv_dtype_bytes or self.dtype_bytes)
        )

    @property
    def row_flops(self) -> float:
        return 2 * self.matmul_params / self.tp

    @property
    def qk_flops(self) -> float:
        return 4 * (self.q_heads // self.tp) * self.head_dim * self.layers

    def with_tp(self, tp: int) -> ModelShape:
        return replace(self, tp=tp)


# Published configs (config.json of each checkpoint).
MISTRAL_SMALL_24B = ModelShape(
    "Mistral-Small-24B",
    layers=40,
    hidden=5120,
    q_heads=32,
    kv_heads=8,
    head_dim=128,
    intermediate=32768,
    vocab=131072,
)
QWEN25_32B = ModelShape(
    "Qwen2.5-32B",
    layers=64,
    hidden=5120,
    q_heads=40,
    kv_heads=8,
    head_dim=128,
    intermediate=27648,
    vocab=152064,
    qkv_bias=True,
)
LLAMA3_70B = ModelShape(
    "Llama-3-70B",
    layers=80,
    hidden=8192,
    q_heads=64,
    kv_heads=8,
    head_dim=128,
    intermediate=28672,
    vocab=128256,
    tp=4,
)
SHAPES = {"mistral-24b": MISTRAL_SMALL_24B, "qwen2.5-32b": QWEN25_32B, "llama3-70b": LLAMA3_70B}


# ---------------------------------------------------------------- hardware


@dataclass(frozen=True)
class GPU:
    """One device's figures. Defaults: an H200 (SXM) with a PCIe Gen5 host link."""

    name: str = "H200"
    hbm_bytes: float = 141e9
    mem_fraction: float = 0.90  # usable for weights + KV; the rest: activations, graphs, allocator
    hbm_bw: float = 4.8e12
    flops: float = 790e12  # bf16 dense
    link_bw: float = 55e9  # host -> device, effective, per device
    host_bytes: float = 256e9  # host memory for exact KV, per device
    nvlink_bw: float = 450e9  # TP all-reduce bandwidth, per direction
    allreduce_latency_s: float = 0.0
    # Serial profiles (a CPU): forward = fixed costs + the sum of memory and compute terms.
    serial: bool = False
    kv_bw: float | None = None  # attention's effective KV bandwidth (None: hbm_bw)
    attn_flops: float | None = None  # attention's effective FLOP/s (None: flops)
    per_forward_s: float = 0.0
    per_request_s: float = 0.0
    draft_overhead_s: float = 0.0  # extra per forward with draft rows (compressed-tier reads)

    def with_link(self, link_bw: float) -> GPU:
        return replace(self, link_bw=link_bw)


# Published figures; bf16 dense tensor throughput without sparsity. Sources: NVIDIA H200 datasheet
# (141 GB HBM3e, 4.8 TB/s; the 790 TFLOP/s is kept from the first projection, below the SXM sheet's
# ~989 dense: decode is memory-bound, so it matters little); RTX PRO 6000 Blackwell datasheet (96 GB
# GDDR7, 1792 GB/s, PCIe Gen5 x16; ~500 TFLOP/s bf16 dense is an assumption, an eighth of the ~4 PFLOPS
# sparse FP4 NVIDIA quotes: dense halves it, each wider format halves it again; never measured); H100
# NVL datasheet (94 GB HBM3, 3.9 TB/s, 1671 TFLOP/s bf16 with sparsity -> ~835 dense, NVLink bridge
# 600 GB/s between a pair = 300 GB/s per direction). PCIe Gen5 x16: 64 GB/s raw per direction, ~55 GB/s
# effective for large copies. RTX PRO 6000 has no NVLink: a TP=2 pair all-reduces over PCIe (~50 GB/s
# peer-to-peer, assumed). Host memory: 256 GB per device (assumed).
H200 = GPU()
RTX_PRO_6000 = GPU("RTX PRO 6000", hbm_bytes=96e9, hbm_bw=1.792e12, flops=500e12, nvlink_bw=50e9)
H100_NVL = GPU("H100 NVL", hbm_bytes=94e9, hbm_bw=3.9e12, flops=835e12, nvlink_bw=300e9)
HARDWARE = {"h200": H200, "rtx-pro-6000": RTX_PRO_6000, "h100-nvl": H100_NVL}


# ---------------------------------------------------------------- one forward


@dataclass
class Work:
    """What one forward does: query tokens, keys read, sum over queries of keys, staged bytes."""

    tokens: float = 0
    keys: float = 0.0
    qk: float = 0.0
    link_bytes: float = 0.0
    requests: float = 0
    drafts: float = 0
    verifies: float = 0  # verifications whose exact KV streams over the link

    def add(self, queries: float, keys: float, weight: float = 1.0) -> None:
        self.tokens += weight * queries
        self.keys += weight * keys
        self.qk += weight * queries * keys
        self.requests += weight

    def merge(self, other: Work, sign: float = 1.0) -> None:
        for f in FIELDS:
            setattr(self, f, getattr(self, f) + sign * getattr(other, f))

    def scaled(self, k: float) -> Work:
        return Work(**{f: getattr(self, f) * k for f in FIELDS})


FIELDS = ("tokens", "keys", "qk", "link_bytes", "requests", "drafts", "verifies")


@dataclass
class StepTime:
    hbm_s: float
    compute_s: float
    comm_s: float
    link_s: float
    total_s: float
    forward_s: float = 0.0


class CostModel:
    def __init__(self, shape: ModelShape, gpu: GPU, ratio: float):
        self.shape, self.gpu, self.ratio = shape, gpu, ratio
        self.kv = shape.kv_bytes_per_token

    # rows
    def full_row(self, w: Work, seq_len: float, weight: float = 1.0) -> None:
        w.add(1, seq_len, weight)

    def draft_row(self, w: Work, committed: float, drafts: float, weight: float = 1.0) -> None:
        w.add(1, committed / self.ratio + drafts + 1, weight)
        w.drafts += weight

    def verify_row(
        self, w: Work, committed: float, drafts: float, staged: bool = True, weight: float = 1.0
    ) -> None:
        w.add(drafts + 1, committed + drafts + 1, weight)
        if staged:
            w.link_bytes += weight * committed * self.kv
            w.verifies += weight

    # time
    def time(self, w: Work) -> StepTime:
        s, g = self.shape, self.gpu
        comm = 0.0
        if s.tp > 1:
            ar_bytes = 2 * (s.tp - 1) / s.tp * w.tokens * s.hidden * s.dtype_bytes
            comm = 2 * s.layers * (g.allreduce_latency_s + ar_bytes / g.nvlink_bw)
        matmul = s.row_flops * w.tokens / g.flops
        attention = s.qk_flops * w.qk / (g.attn_flops or g.flops)
        if g.serial:
            kv_bw = g.kv_bw or g.hbm_bw
            hbm = s.weight_bytes / g.hbm_bw + w.keys * self.kv / kv_bw + w.link_bytes / g.hbm_bw
            fixed = g.per_forward_s + g.per_request_s * w.requests + (g.draft_overhead_s if w.drafts else 0.0)
            fwd = (
                fixed
                + max(s.weight_bytes / g.hbm_bw, matmul)
                + w.keys * self.kv / kv_bw
                + attention
                + w.link_bytes / g.hbm_bw
                + comm
            )
        else:
            # The staged exact KV is written to HBM by the copy engine and read back by attention.
            hbm = (s.weight_bytes + w.keys * self.kv + w.link_bytes) / g.hbm_bw
            fwd = max(hbm, matmul + attention) + comm
        link = w.link_bytes / g.link_bw if w.link_bytes else 0.0
        return StepTime(hbm, matmul + attention, comm, link, self.overlap(fwd, link), fwd)

    def overlap(self, forward_s: float, link_s: float) -> float:
        """A forward whose staged exact KV arrives layer by layer: only one layer's load (or the last
        layer's compute) is not hidden behind the other."""
        return max(forward_s, link_s) + min(forward_s, link_s) / self.shape.layers

    def expected_step(self, w: Work) -> float:
        """Seconds of an iteration with these expected rows. A streamed verification moves its whole
        exact KV during its own forward, so the link is not averaged over iterations: with v =
        w.verifies verifications per iteration (spread evenly by the reservations), an iteration
        carries floor(v) or floor(v) + 1 of them, each moving w.link_bytes / v."""
        t = self.time(w)
        if not w.verifies:
            return t.total_s
        per_verify = w.link_bytes / w.verifies / self.gpu.link_bw
        m = math.floor(w.verifies)
        frac = w.verifies - m
        return (1 - frac) * self.overlap(t.forward_s, m * per_verify) + frac * self.overlap(
            t.forward_s, (m + 1) * per_verify
        )

    # memory
    def free_hbm(self) -> float:
        return self.gpu.hbm_bytes * self.gpu.mem_fraction - self.shape.weight_bytes

    def staging_bytes(self, staging_tokens: int) -> float:
        return 2 * staging_tokens * self.kv / self.shape.layers

    def compressed_bytes(self, max_len: int, max_draft: int) -> float:
        """A drafting request's device bytes: its compressed tier and its drafts' scratch KV."""
        return (math.ceil(max_len / self.ratio) + max_draft + 1) * self.kv

    def full_max_batch(self, max_len: int) -> int:
        return max(0, math.floor(self.free_hbm() / (max_len * self.kv)))

    def host_max_batch(self, max_len: int) -> int:
        return math.floor(self.gpu.host_bytes / (max_len * self.kv))

    def vc_max_batch(self, max_len: int, max_draft: int, staging_tokens: int) -> int:
        per_req = self.compressed_bytes(max_len, max_draft)
        hbm = math.floor((self.free_hbm() - self.staging_bytes(staging_tokens)) / per_req)
        return max(0, min(hbm, self.host_max_batch(max_len)))

    def residents(
        self, max_len: int, n_host: int, max_draft: int, staging_tokens: int, drafting: bool
    ) -> int:
        """Requests whose exact KV fits on the device beside n_host host-tier requests: each resident
        holds its exact KV (plus a compressed tier and scratch if residents draft); host-tier ones
        hold their compressed tier and scratch; the staging area once any is on the host."""
        free = self.free_hbm() - n_host * self.compressed_bytes(max_len, max_draft)
        if n_host:
            free -= self.staging_bytes(staging_tokens)
        per_req = max_len * self.kv + (self.compressed_bytes(max_len, max_draft) if drafting else 0.0)
        return max(-1, math.floor(free / per_req)) if free >= 0 else -1


# ---------------------------------------------------------------- the adaptive decision rule


@dataclass(frozen=True)
class Option:
    """One request's choice for its next round, as per-iteration averages (see the module docstring)."""

    kind: str  # "decode", "round" or "wait"
    x: int
    tokens: float  # e_o
    work: Work  # rows per iteration
    host: bool = False  # a round whose verification streams the exact KV over the link


class Batch:
    """The running requests' current options, summed per tier (resident, host)."""

    def __init__(self):
        self.res, self.host = Work(), Work()
        self.res_tokens = self.host_tokens = 0.0

    def add(self, o: Option, sign: float = 1.0) -> None:
        if o.host:
            self.host.merge(o.work, sign)
            self.host_tokens += sign * o.tokens
        else:
            self.res.merge(o.work, sign)
            self.res_tokens += sign * o.tokens

    def remove(self, o: Option) -> None:
        self.add(o, -1.0)


class Policy:
    """The adaptive controller's rule on a cost model: options, Theta, and the argmax."""

    def __init__(self, cm: CostModel, expected_accepted, draft_lengths: tuple[int, ...] = DRAFT_LENGTHS):
        self.cm = cm
        self.expected_accepted = expected_accepted  # x -> A(x)
        self.draft_lengths = tuple(sorted(draft_lengths))

    def decode(self, committed: float) -> Option:
        w = Work()
        self.cm.full_row(w, committed + 1)
        return Option("decode", 0, 1.0, w)

    def round(self, committed: float, x: int, host: bool) -> Option:
        w = Work()
        p = 1.0 / (x + 1)
        for j in range(x):
            self.cm.draft_row(w, committed, j, weight=p)
        self.cm.verify_row(w, committed, x, staged=host, weight=p)
        return Option("round", x, (1 + self.expected_accepted(x)) * p, w, host)

    def options(self, committed: float, resident: bool, drafting: bool, max_x: int) -> list[Option]:
        """Decode first (resident), then rounds by x (those in draft_lengths up to max_x, and max_x itself
        below the longest), then waiting (host tier): ties go to the earlier."""
        out = [self.decode(committed)] if resident else []
        if drafting or not resident:
            # Near its end a request may also draft exactly what it has left (max_x = tokens left - 1).
            xs = [x for x in self.draft_lengths if x <= max_x]
            if max_x < self.draft_lengths[-1] and max_x not in xs and (xs or not resident):
                xs.append(max_x)
            out += [self.round(committed, x, host=not resident) for x in xs]
        if not resident:
            out.append(Option("wait", 0, 0.0, Work(), True))
        return out

    def theta(self, b: Batch, extra: Option | None = None, n_extra: float = 1.0) -> float:
        """Predicted tokens/s of the batch (plus n_extra requests taking option extra)."""
        return self.evaluate(b, extra, n_extra)[0]

    def evaluate(self, b: Batch, extra: Option | None = None, n_extra: float = 1.0) -> tuple[float, bool]:
        """-> (Theta, whether the link is saturated).

        Host-tier rounds run at most as often as the reservations let them: an iteration's link
        budget is its own duration times the bandwidth, and a verification bigger than that takes a
        slot of its own, so an iteration carries cap = max(1, floor(step(1) / t_v)) verifications
        (t_v = one verification's link seconds, step(1) = an iteration with one). With v requested
        per iteration, the host tier runs the fraction s = min(1, cap / v) of its rounds (the rest
        wait for a slot: the link is saturated)."""
        res, host = Work(), Work()
        res.merge(b.res)
        host.merge(b.host)
        res_tok, host_tok = b.res_tokens, b.host_tokens
        if extra is not None:
            (host if extra.host else res).merge(extra.work.scaled(n_extra))
            if extra.host:
                host_tok += n_extra * extra.tokens
            else:
                res_tok += n_extra * extra.tokens
        scale = 1.0
        if host.verifies > 1e-12:
            per_verify = host.link_bytes / host.verifies / self.cm.gpu.link_bw
            one = Work()
            one.merge(res)
            one.merge(host.scaled(1.0 / host.verifies))
            step1 = self.cm.overlap(self.cm.time(one).forward_s, per_verify)
            cap = max(1, math.floor(step1 / per_verify + 1e-9)) if per_verify > 0 else math.inf
            scale = min(1.0, cap / host.verifies)
        tokens = res_tok + scale * host_tok
        if tokens <= 1e-12:
            return 0.0, False
        w = res
        w.merge(host.scaled(scale))
        return tokens / self.cm.expected_step(w), scale < 1.0

    def best(self, b: Batch, options: list[Option]) -> Option:
        """argmax over options of Theta(the batch + the option); ties keep the earlier one. A
        host-tier request waits only if that is better while the link has free slots: on a saturated
        link its round books a slot like the others' (the reservations order them)."""
        best, best_theta, best_sat, wait_theta = None, -1.0, False, None
        for o in options:
            th, sat = self.evaluate(b, o)
            if o.kind == "wait":
                wait_theta = th
                continue
            if th > best_theta * (1 + 1e-9):
                best, best_theta, best_sat = o, th, sat
        if wait_theta is not None and (
            best is None or (not best_sat and wait_theta > best_theta * (1 + 1e-9))
        ):
            return next(o for o in options if o.kind == "wait")
        return best

    def plan(self, context: int, output: int, max_host: int, staging_tokens: int) -> dict | None:
        """Steady-state placement: for residents that draft or only decode, and each number on the
        host tier, the option every resident / host-tier request takes (all alike at context
        P + O / 2) and its Theta; the best plan (None if not even one request fits)."""
        max_len, mean = context + output, context + output / 2
        xmax = max(self.draft_lengths)
        best = None
        for drafting in (False, True):
            fits = [
                n
                for n in range(max_host + 1)
                if self.cm.residents(max_len, n, xmax, staging_tokens, drafting) >= 0
            ]
            for n_host in reversed(fits):  # on a tie the larger host tier (a saturated link's queue)
                n_res = self.cm.residents(max_len, n_host, xmax, staging_tokens, drafting)
                if n_res + n_host == 0:
                    continue
                res_opts = self.options(mean, True, drafting, xmax) if n_res else [None]
                host_opts = self.options(mean, False, True, xmax)[:-1] if n_host else [None]
                for ro in res_opts:
                    b = Batch()
                    if ro is not None:
                        b.add(Option(ro.kind, ro.x, ro.tokens * n_res, ro.work.scaled(n_res), ro.host))
                    for ho in host_opts:
                        th = self.theta(b, ho, n_host) if ho is not None else self.theta(b)
                        if best is None or th > best["theta"] * (1 + 1e-9):
                            best = {
                                "theta": th,
                                "drafting": drafting,
                                "residents": n_res,
                                "host": n_host,
                                "resident_option": ro.kind if ro else None,
                                "resident_x": ro.x if ro else None,
                                "host_x": ho.x if ho else None,
                            }
        return best
