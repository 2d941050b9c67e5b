"""StepCostModel: the adaptive controller's costs (speculative/controller.py), one forward's seconds
as a linear function of what it computes,

    t = c0 + c_row * rows + c_exact * exact_keys + c_comp * comp_keys + c_qk * key_rows

(c0: the weights, read once per forward; c_row: a row's matrix products; c_exact / c_comp: one
exact / compressed key's KV read, once per request and forward however many of its rows attend
to it; c_qk: one query row against one key, all layers), fitted by least squares to the
forwards measured so far, pulled towards a prior made from the model's sizes until there are
enough of them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

PRIOR_WEIGHT = 4.0  # the prior counts as this many forwards of evidence
MIN_FRACTION = 1e-3  # a fitted coefficient stays at least this fraction of its prior
FIT_WINDOW = 256  # forwards kept for the fit
ANCHOR_WINDOW = 16  # prefill forwards kept for the fit besides them (anchors, see StepCostModel)
REBUILD_EVERY = FIT_WINDOW  # the fit's running sums are recomputed from the window this often
# Forwards of decode-time batches (not anchors) after which the fit is "measured": before that, the
# coefficients of KV reads come from the prior alone and decide nothing full mode would not do.
MIN_MEASURED = 8
EXACT, COMP, DRAFT = 2, 3, 5  # indices of c_exact, c_comp and c_draft in the fit's coefficients
DRAFT_PRIOR_FRACTION = 0.25  # c_draft's prior, as a fraction of c0's


@dataclass
class ForwardSample:
    rows: int
    exact_keys: int  # exact keys read: per request of the forward, the exact keys its rows see
    comp_keys: int  # compressed keys read, likewise
    key_rows: int  # query-key products: sum over rows of the keys (exact or compressed) each sees
    seconds: float
    drafting: bool = False  # the forward has draft rows (DRAFT_DECODE, or MIXED with drafts)

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.rows), float(self.exact_keys), float(self.comp_keys), float(self.key_rows),
                float(self.drafting))


class StepCostModel:
    """Forward seconds as c0 + c_row*rows + c_exact*exact_keys + c_comp*comp_keys + c_qk*key_rows:
    a ridge fit to the last FIT_WINDOW forwards and the last ANCHOR_WINDOW anchors (prefill forwards),
    centred on the prior (in units of the prior), each forward weighted by 1 / seconds^2 (relative
    errors: a 2 s prefill and a 20 ms decode count alike).

    Anchors: in decode forwards a row's exact keys are its context, so rows and exact keys rise
    together and c_row cannot be told from c_exact; a fit to decodes alone then charges a draft row
    (no exact keys) for attention it does not do (measured: a 16-row draft forward predicted 59 ms,
    28 ms measured). Prefill forwards (thousands of rows, keys per row from 1 to the context) separate
    them, and are rare, so they are kept apart from the window's decodes.

    Until compressed keys are read (no draft forward measured), c_comp follows c_exact scaled by
    bytes (the prior's ratio): the ridge pulls c_comp / prior_comp towards c_exact / prior_exact,
    not towards 1, so a machine whose exact reads cost 5x the prior is not thought to draft for free.

    A forward with draft rows also costs c_draft once (`draft_overhead`: its metadata, the
    compressed-tier kernel's calls, sampling drafts; measured on an AVX-512 EPYC, a one-row draft
    forward took 1.6x a one-row decode), fitted as a sixth coefficient on an indicator feature, its
    prior DRAFT_PRIOR_FRACTION of c0's; `coef` is the five above."""

    def __init__(self, prior: tuple[float, ...]):
        if any(p <= 0 for p in prior):
            raise ValueError(f"cost prior must be positive, got {prior}")
        self.prior = tuple(float(p) for p in prior)
        self._prior = self.prior + (DRAFT_PRIOR_FRACTION * self.prior[0],)  # the fit's: c_draft's last
        self.samples: deque[ForwardSample] = deque(maxlen=FIT_WINDOW)
        self.anchors: deque[ForwardSample] = deque(maxlen=ANCHOR_WINDOW)
        self.pinned = False
        self.draft_forwards = 0  # forwards observed that read compressed keys
        self._rebuild()
        self._coef, self._dirty = self._prior, False

    @classmethod
    def from_sizes(cls, weight_bytes: float, matmul_flops_per_row: float, kv_bytes_per_token: float,
                   comp_bytes_per_token: float, qk_flops_per_key: float, mem_bandwidth: float,
                   flops: float) -> StepCostModel:
        """The prior: weights and KV read at `mem_bandwidth`, products at `flops`."""
        return cls((weight_bytes / mem_bandwidth, matmul_flops_per_row / flops, kv_bytes_per_token / mem_bandwidth,
                    comp_bytes_per_token / mem_bandwidth, qk_flops_per_key / flops))

    @property
    def coef(self) -> tuple[float, ...]:
        """The fitted coefficients, refitted when read after new forwards (decisions read them every
        few iterations; forwards are observed at every one)."""
        return self._coefficients()[:DRAFT]

    @coef.setter
    def coef(self, value: tuple[float, ...]) -> None:
        """Five coefficients (c_draft 0) or six."""
        value = tuple(float(v) for v in value)
        self._coef, self._dirty = value + (0.0,) * (DRAFT + 1 - len(value)), False

    @property
    def draft_overhead(self) -> float:
        """c_draft: seconds a forward with draft rows costs once, besides its rows and keys."""
        return self._coefficients()[DRAFT]

    def _coefficients(self) -> tuple[float, ...]:
        if self._dirty:
            self._coef, self._dirty = self._fit(), False
        return self._coef

    def pin(self, coef: tuple[float, ...]) -> None:
        """Fixes the coefficients: forwards observed from now on change nothing (tests, benchmarks)."""
        self.coef, self.pinned = tuple(coef), True

    @property
    def measured(self) -> bool:
        """Whether the coefficients rest on MIN_MEASURED decode-time forwards (or are pinned)."""
        return self.pinned or len(self.samples) >= MIN_MEASURED

    @property
    def drafts_measured(self) -> bool:
        """Whether MIN_MEASURED forwards with draft rows (compressed keys) were measured (or pinned):
        until then a draft row's price rests on decode forwards and the prior's byte ratio, and a
        draft forward's own costs (its metadata, the compressed-tier kernel, sampling drafts) on none."""
        return self.pinned or self.draft_forwards >= MIN_MEASURED

    def observe_anchor(self, sample: ForwardSample) -> None:
        """A prefill forward (see the class docstring)."""
        if sample.seconds > 0 and sample.rows > 0 and not self.pinned:
            self.anchors.append(sample)
            self._dirty = True

    def observe(self, sample: ForwardSample) -> None:
        if sample.seconds > 0 and sample.rows > 0 and not self.pinned:
            if len(self.samples) == FIT_WINDOW:
                self._add(self.samples[0], -1.0)  # leaves the window
            self.samples.append(sample)
            self.draft_forwards += sample.comp_keys > 0
            self._add(sample, 1.0)
            self._since_rebuild += 1
            if self._since_rebuild >= REBUILD_EVERY:  # running sums drift: rebuild them exactly
                self._rebuild()
            self._dirty = True

    def _add(self, s: ForwardSample, sign: float) -> None:
        """Adds (sign 1) or removes (sign -1) one sample's terms of the normal equations."""
        _accumulate(self._a, self._b, s, self._prior, sign)

    def _rebuild(self) -> None:
        n = len(self._prior)
        self._a = [[0.0] * n for _ in range(n)]
        self._b = [0.0] * n
        self._since_rebuild = 0
        for s in self.samples:
            self._add(s, 1.0)

    def _fit(self) -> tuple[float, ...]:
        # Work in units of the prior: x_i = c_i / prior_i. The normal equations' sums over the window
        # (self._a, self._b) are kept as samples come and go.
        n = len(self._prior)
        a = [row[:] for row in self._a]
        b = self._b[:]
        for s in self.anchors:
            _accumulate(a, b, s, self._prior, 1.0)
        # Ridge towards x = 1: each coefficient's prior weighs as much as k forwards of that
        # coefficient's typical feature size, k = PRIOR_WEIGHT at first and fading as forwards
        # are measured (a feature never seen keeps its prior; c_comp: see the class docstring).
        seen = len(self.samples) + len(self.anchors)
        count = max(seen, 1)
        k = PRIOR_WEIGHT * PRIOR_WEIGHT / (PRIOR_WEIGHT + seen)
        for i in range(n):
            if i == COMP:
                continue
            lam = k * max(a[i][i] / count, 1e-30)
            a[i][i] += lam
            b[i] += lam
        # c_comp's ridge: towards c_exact in units of the prior (the class docstring).
        lam = k * max(a[COMP][COMP] / count, a[EXACT][EXACT] / count, 1e-30)
        for i, j, v in ((COMP, COMP, lam), (EXACT, EXACT, lam), (COMP, EXACT, -lam), (EXACT, COMP, -lam)):
            a[i][j] += v
        x = _solve(a, b)
        # No coefficient falls below MIN_FRACTION of its prior: a cost never fits to zero (or to
        # NaN from a degenerate window), so every plan keeps a positive, comparable price.
        return tuple((xi if math.isfinite(xi) and xi > MIN_FRACTION else MIN_FRACTION) * pi
                     for xi, pi in zip(x, self._prior))

    def seconds(self, rows: float, exact_keys: float, comp_keys: float, key_rows: float,
                drafting: bool = False) -> float:
        c0, c_row, c_exact, c_comp, c_qk, c_draft = self._coefficients()
        return (c0 + c_row * rows + c_exact * exact_keys + c_comp * comp_keys + c_qk * key_rows
                + c_draft * drafting)


def _accumulate(a: list[list[float]], b: list[float], s: ForwardSample, prior: tuple[float, ...],
                sign: float) -> None:
    """Adds (sign 1) or removes (sign -1) one forward's terms of the normal equations, features in
    units of the prior, weighted by 1 / seconds^2 (relative errors)."""
    w = sign / (s.seconds * s.seconds)
    f = [fi * pi for fi, pi in zip(s.features(), prior)]
    for i, fi in enumerate(f):
        b[i] += w * fi * s.seconds
        row = a[i]
        for j, fj in enumerate(f):
            row[j] += w * fi * fj


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the small normal equations)."""
    n = len(b)
    m = [row[:] + [bi] for row, bi in zip(a, b)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[piv] = m[piv], m[col]
        if abs(m[col][col]) < 1e-300:
            continue
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] if abs(m[i][i]) >= 1e-300 else 1.0 for i in range(n)]
