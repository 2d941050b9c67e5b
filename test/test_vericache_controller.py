"""The adaptive controller's cost model and decisions (speculative/controller.py): pure arithmetic."""

from __future__ import annotations

import random

import pytest

from sglang_vericache.speculative.controller import (
    FIT_WINDOW,
    MIN_MEASURED,
    REALIZED_EMA,
    Acceptance,
    ForwardSample,
    Plan,
    RealizedThroughput,
    RequestView,
    StepCostModel,
    VeriCacheController,
    expected_accepted,
)


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == 0.5 + 0.25 + 0.125
    assert expected_accepted(1.0, 7) == 7.0
    assert expected_accepted(0.9, 0) == 0.0


def test_acceptance_starts_at_the_prior_and_follows_rounds():
    a = Acceptance()
    assert a.rate() == pytest.approx(0.8, abs=1e-15)
    for _ in range(100):
        a.update(drafted=8, accepted=1)  # one right, then a miss: p = 1/2 in the limit
    assert a.rate() == pytest.approx((100 + 8) / (100 + 8 + 100 + 2), abs=1e-15)


def sample(rng, true) -> ForwardSample:
    s = ForwardSample(rng.randint(1, 64), rng.randint(0, 10**6), rng.randint(0, 10**6), 0, 0.0)
    s.key_rows = rng.randint(s.exact_keys + s.comp_keys, 8 * (s.exact_keys + s.comp_keys) + 1)
    s.seconds = true[0] + sum(t * f for t, f in zip(true[1:], s.features()[1:]))
    return s


def test_fit_with_the_true_prior_returns_it():
    true = (2e-3, 1e-4, 2e-8, 5e-9, 1e-9)
    cm = StepCostModel(true)
    rng = random.Random(0)
    for _ in range(50):
        cm.observe(sample(rng, true))
    for got, want in zip(cm.coef, true):
        assert got == pytest.approx(want, rel=1e-9)


def test_running_sums_give_the_fit_of_the_window_alone():
    # Samples leave the window from the running sums; the fit equals one made from the window alone.
    prior = (1e-2, 1e-5, 1e-7, 1e-7, 1e-8)
    true = (2e-3, 1e-4, 2e-8, 5e-9, 1e-9)
    rng = random.Random(2)
    cm = StepCostModel(prior)
    seen = [sample(rng, tuple(t * (3.0 if i < 200 else 1.0) for t in true)) for i in range(FIT_WINDOW + 150)]
    for s in seen:
        cm.observe(s)
    fresh = StepCostModel(prior)
    for s in seen[-FIT_WINDOW:]:
        fresh.observe(s)
    assert len(cm.samples) == FIT_WINDOW
    for got, want in zip(cm.coef, fresh.coef):
        assert got == pytest.approx(want, rel=1e-9)


def test_prefill_anchors_separate_row_cost_from_exact_key_cost():
    # Decode forwards alone: every row reads ~its context of exact keys, so rows and exact keys are
    # collinear and a draft forward (rows, no exact keys) is mispredicted; prefill anchors fix that.
    true = (20e-3, 0.5e-3, 4e-6, 1e-6, 1e-9)
    # 10x everywhere (one bandwidth, one flop rate: as from_sizes makes it). No forward here reads
    # compressed keys: c_comp follows the fitted c_exact at the prior's ratio.
    prior = (0.2, 5e-3, 4e-5, 1e-5, 1e-8)
    rng = random.Random(3)

    def fwd(rows, exact, comp, key_rows):
        seconds = true[0] + sum(t * f for t, f in zip(true[1:], (rows, exact, comp, key_rows)))
        return ForwardSample(rows, exact, comp, key_rows, seconds)

    decodes = []
    for _ in range(200):
        lens = [rng.randint(1600, 1800) for _ in range(rng.randint(2, 5))]
        decodes.append(fwd(len(lens), sum(lens), 0, sum(lens)))
    draft = (16, 0, 16 * 400, 16 * 400)  # 16 draft rows over 400 compressed keys each
    want = true[0] + sum(t * f for t, f in zip(true[1:], draft))
    alone, anchored = StepCostModel(prior), StepCostModel(prior)
    for s in decodes:
        alone.observe(s)
        anchored.observe(s)
    for prefix in (0, 2048):
        n = 2048
        anchored.observe_anchor(fwd(n, prefix + n, 0, n * prefix + n * (n + 1) // 2))
    assert alone.coef[1] < 0.1 * true[1]  # decodes alone: the row cost went into the exact keys
    assert anchored.coef[1] == pytest.approx(true[1], rel=0.05)
    assert anchored.coef[2] == pytest.approx(true[2], rel=0.05)
    assert anchored.coef[3] == pytest.approx(true[3], rel=0.05)
    assert anchored.seconds(*draft) == pytest.approx(want, rel=0.05)


def test_unmeasured_compressed_reads_follow_the_exact_ones_and_the_fit_is_measured_after_decodes():
    prior = (1e-2, 1e-4, 1e-7, 2.5e-8, 1e-9)  # a compressed key: a quarter of an exact key's bytes
    cm = StepCostModel(prior)
    assert not cm.measured
    for i in range(MIN_MEASURED):
        n = 1600 + 8 * i
        # Exact reads cost 5x the prior, everything else as the prior says.
        cm.observe(ForwardSample(4, 4 * n, 0, 4 * n, 1e-2 + 4e-4 + 4 * n * (5e-7 + 1e-9)))
        assert cm.measured == (i == MIN_MEASURED - 1)
    assert cm.coef[2] > 1.5 * prior[2]  # (8 collinear decodes: c_exact and c_qk share the excess)
    assert cm.coef[3] / cm.coef[2] == pytest.approx(prior[3] / prior[2], rel=1e-6)
    pinned = StepCostModel(prior)
    pinned.pin(prior)
    assert pinned.measured


def test_fit_moves_from_a_wrong_prior_to_the_measurements():
    true = (2e-3, 1e-4, 2e-8, 5e-9, 1e-9)
    cm = StepCostModel((1e-2, 1e-5, 1e-7, 1e-7, 1e-8))
    rng = random.Random(1)
    for _ in range(256):
        cm.observe(sample(rng, true))
    cases = ((1, 1000, 0, 1000), (16, 16 * 1600, 0, 16 * 1600), (16, 0, 16 * 400, 16 * 400), (9, 1600, 0, 9 * 1600))
    pred = [cm.seconds(*c) for c in cases]
    want = [true[0] + sum(t * f for t, f in zip(true[1:], c)) for c in cases]
    for p, w in zip(pred, want):
        assert p == pytest.approx(w, rel=0.05)


def view(committed=1600, resident=True, rate=0.8, comp=400, max_draft=30):
    return RequestView(committed=committed, resident=resident, accept_rate=rate, comp_keys=comp, max_draft=max_draft)


def test_decode_when_rows_are_expensive_and_attention_cheap():
    # Matrix products dominate: a round spends x+1 rows' products per x draft rows + verify rows, for
    # fewer tokens per iteration than decoding.
    cm = StepCostModel((1e-4, 1e-3, 1e-10, 1e-10, 1e-10))
    d = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=None).decide([view()] * 4)
    assert [p.draft_len for p in d.plans] == [0, 0, 0, 0]
    assert all(p.run for p in d.plans)


def test_rounds_when_exact_attention_dominates():
    # Reading KV dominates (memory-bound attention): a verify reads it once for x + 1 rows.
    cm = StepCostModel((1e-4, 1e-6, 1e-6, 1e-7, 1e-9))
    d = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=None).decide([view(rate=0.9)] * 4)
    assert all(p.run and p.draft_len > 0 for p in d.plans)
    # And the chosen plan beats decoding everyone: 4 tokens per c0 + 4 * (row + 1600 keys).
    decode_tps = 4 / (1e-4 + 4 * (1e-6 + (1e-6 + 1e-9) * 1600))
    assert d.throughput > decode_tps


def test_host_requests_wait_when_the_link_cannot_pay():
    # Resident requests decode at ~c0 + 4 rows; a host-tier round moves 1600 * 8 KB over 1 MB/s.
    cm = StepCostModel((5e-3, 1e-4, 1e-9, 1e-9, 1e-10))
    ctl = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=1e6)
    d = ctl.decide([view()] * 4 + [view(resident=False)] * 12)
    assert [p.run for p in d.plans] == [True] * 4 + [False] * 12
    assert [p.draft_len for p in d.plans[:4]] == [0] * 4


def test_host_requests_run_when_nothing_is_resident():
    cm = StepCostModel((5e-3, 1e-4, 1e-9, 1e-9, 1e-10))
    ctl = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=1e6)
    d = ctl.decide([view(resident=False)] * 4)
    assert all(p.run and p.draft_len > 0 for p in d.plans)
    assert d.link_bound


def test_draft_length_respects_the_request_budget():
    cm = StepCostModel((1e-4, 1e-6, 1e-6, 1e-7, 1e-9))
    d = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=None).decide([view(rate=0.99, max_draft=5)])
    assert d.plans[0].draft_len == 5  # listed lengths clipped to the budget: 2, 4, 5


def test_bad_prior_is_refused():
    with pytest.raises(ValueError, match="cost prior must be positive"):
        StepCostModel((1.0, 0.0, 1.0, 1.0, 1.0))


def test_a_degenerate_fit_keeps_every_cost_positive_and_someone_runs():
    cm = StepCostModel((1e-3, 1e-4, 1e-7, 2e-8, 1e-9))
    for _ in range(64):  # identical forwards: only their sum is determined
        cm.observe(ForwardSample(5, 8000, 0, 8000, 1e-9))
    assert all(c > 0 for c in cm.coef)
    ctl = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=2e8)
    d = ctl.decide([view(resident=False)] * 9)
    assert any(p.run for p in d.plans) and d.throughput > 0


def full_mode_floor(ctl: VeriCacheController, views: list[RequestView]) -> float:
    """Predicted tokens/s of what full mode runs at this budget: the resident requests decoding."""
    plans = [Plan(True, 0, 1.0, o[0].seconds_per_iter) if v.resident else Plan(False, 0)
             for v, o in zip(views, (ctl.options(v) for v in views))]
    return ctl._evaluate(plans, ctl.cost.coef[0]).throughput


def test_a_decision_never_predicts_less_than_decoding_the_resident_requests():
    """Over random costs, links, acceptance and placements (the search alone could miss it: a link
    price grid and a ratio objective), the chosen plan is at least the full-mode floor."""
    rng = random.Random(0)
    for _ in range(100):
        coef = tuple(10 ** rng.uniform(lo, hi) for lo, hi in ((-4, -2), (-6, -3), (-10, -6), (-10, -7), (-11, -8)))
        ctl = VeriCacheController(StepCostModel(coef), kv_bytes_per_token=8192,
                                  link_bandwidth=10 ** rng.uniform(6, 10))
        views = [view(committed=rng.randint(100, 4000), resident=rng.random() < 0.4, rate=rng.uniform(0.1, 0.95),
                      comp=rng.randint(30, 1000)) for _ in range(rng.randint(1, 12))]
        d = ctl.decide(views)
        if any(v.resident for v in views):
            assert d.throughput >= full_mode_floor(ctl, views) * (1 - 1e-9)


def test_with_resident_requests_host_rounds_that_stall_the_batch_wait():
    # Decoding the resident request is cheap; a host-tier round moves 1600 * 8 KB over 200 MB/s
    # (65 ms, longer than many decode steps) for a few tokens: the host tier stays idle.
    cm = StepCostModel((2e-3, 1e-4, 1e-9, 1e-9, 1e-10))
    ctl = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=2e8)
    views = [view()] + [view(resident=False, rate=0.3)] * 3
    d = ctl.decide(views)
    assert [p.run for p in d.plans] == [True, False, False, False]
    assert d.throughput >= full_mode_floor(ctl, views)


def test_pinned_costs_ignore_forwards():
    cm = StepCostModel((1e-2, 1e-5, 1e-7, 1e-7, 1e-8))
    cm.pin((2e-3, 1e-4, 2e-8, 5e-9, 1e-9))
    cm.observe(ForwardSample(4, 6400, 0, 6400, 0.5))
    cm.observe_anchor(ForwardSample(2048, 2048, 0, 2048 * 2049 // 2, 3.0))
    assert cm.coef == (2e-3, 1e-4, 2e-8, 5e-9, 1e-9)


def test_realized_throughput_scales_host_tier_predictions_down_never_up():
    rt = RealizedThroughput()
    assert rt.host_factor() == 1.0  # nothing measured
    rt.window(False, tokens=90, seconds=1.0, predicted=100.0)  # base windows realize 0.9 of the prediction
    assert rt.host_factor() == 1.0  # no host-tier window yet
    rt.window(True, tokens=45, seconds=1.0, predicted=100.0)  # host-tier rounds: 0.45
    assert rt.host_factor() == pytest.approx(0.5)
    rt.window(True, tokens=135, seconds=1.0, predicted=100.0)  # 1.35: the ratio moves by REALIZED_EMA
    host = (1 - REALIZED_EMA) * 0.45 + REALIZED_EMA * 1.35
    assert rt.ratio["host"] == pytest.approx(host)
    assert rt.host_factor() == pytest.approx(min(1.0, host / 0.9))
    for _ in range(20):
        rt.window(True, tokens=200, seconds=1.0, predicted=100.0)
    assert rt.host_factor() == 1.0  # better than predicted: never raised
    rt.window(True, tokens=0, seconds=0.0, predicted=100.0)  # an empty window changes nothing
    assert rt.host_factor() == 1.0


def test_folding_cost_is_charged_per_emitted_token_on_every_plan():
    # Costs under which rounds win (exact reads dominate). Folding adds RequestView.fold_s_per_token
    # seconds per emitted token to each plan, decode and rounds alike (its compressed tier folds every
    # committed page whatever it plans); 0 (no compressed tier) leaves the plans as they were.
    cm = StepCostModel((1e-4, 1e-6, 1e-6, 1e-7, 1e-9))
    ctl = VeriCacheController(cm, kv_bytes_per_token=8192, link_bandwidth=None)
    free = ctl.decide([view(rate=0.9)])
    assert free.plans[0].draft_len > 0
    decode_s = 1e-6 + (1e-6 + 1e-9) * 1600  # one decode row, 1600 exact keys
    round_tok_s = free.plans[0].seconds_per_iter / free.plans[0].tokens_per_iter  # < decode_s
    # Folding adds the same seconds to every emitted token, decoded or drafted:
    heavy = RequestView(committed=1600, resident=True, accept_rate=0.9, comp_keys=400, max_draft=30,
                        fold_s_per_token=1.0)
    opts = ctl.options(heavy)
    assert opts[0].draft_len == 0 and opts[0].seconds_per_iter == pytest.approx(decode_s + 1.0)
    for p in opts[1:]:
        assert p.seconds_per_iter == pytest.approx(
            next(q for q in ctl.options(view(rate=0.9)) if q.draft_len == p.draft_len).seconds_per_iter
            + p.tokens_per_iter * 1.0)
    assert round_tok_s < decode_s


def test_draft_forwards_are_counted_apart_from_decodes():
    cm = StepCostModel((1e-2, 1e-4, 1e-7, 2.5e-8, 1e-9))
    for i in range(MIN_MEASURED):
        cm.observe(ForwardSample(4, 4 * 1600, 0, 4 * 1600, 2e-2))
    assert cm.measured and not cm.drafts_measured
    for i in range(MIN_MEASURED):
        assert not cm.drafts_measured
        cm.observe(ForwardSample(4, 0, 4 * 400, 4 * 400, 1e-2))
    assert cm.drafts_measured
    pinned = StepCostModel((1e-2, 1e-4, 1e-7, 2.5e-8, 1e-9))
    pinned.pin(pinned.prior)
    assert pinned.drafts_measured


def test_a_draft_forwards_own_cost_is_fitted_and_can_keep_a_batch_decoding():
    # Forwards cost as `true` says plus 3 ms whenever they have draft rows: the fit finds the 3 ms
    # (draft_overhead) and predicts both kinds; a plan whose rounds only win without that cost decodes.
    true = (2e-3, 1e-4, 2e-8, 5e-9, 1e-9)
    cm = StepCostModel((1e-2, 1e-5, 1e-7, 1e-7, 1e-8))
    rng = random.Random(3)
    for i in range(FIT_WINDOW):
        rows, n = rng.randint(1, 16), rng.randint(500, 2000)
        if i % 2:  # a draft forward: rows read compressed keys
            comp = rows * n // 4
            cm.observe(ForwardSample(rows, 0, comp, comp, true[0] + true[1] * rows + (true[3] + true[4]) * comp + 3e-3,
                                     drafting=True))
        else:
            cm.observe(ForwardSample(rows, rows * n, 0, rows * n, true[0] + true[1] * rows + (true[2] + true[4]) * rows * n))
    assert cm.draft_overhead == pytest.approx(3e-3, rel=0.05)
    assert cm.seconds(8, 0, 8 * 400, 8 * 400, drafting=True) == pytest.approx(
        true[0] + 8 * true[1] + 8 * 400 * (true[3] + true[4]) + 3e-3, rel=0.05)
    assert len(cm.coef) == 5
    # Pinned without a draft cost, a round beats decoding one request; with a 20 ms one it does not.
    costs = (1e-4, 1e-6, 1e-6, 1e-7, 1e-9)
    free, dear = StepCostModel(costs), StepCostModel(costs)
    free.pin(costs)
    dear.pin((*costs, 2e-2))
    assert free.draft_overhead == 0.0 and dear.draft_overhead == 2e-2
    assert VeriCacheController(free, 8192, None).decide([view(rate=0.9)]).plans[0].draft_len > 0
    assert VeriCacheController(dear, 8192, None).decide([view(rate=0.9)]).plans[0].draft_len == 0
