"""The cost model's formulas and the adaptive policy's rule (benchmark/gpu_cost_model.py), and the
CPU calibration's capacity accounting (benchmark/calibrate_cpu.py), on tiny hand-made inputs with
every expected number derived by hand in the comments."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import calibrate_cpu as cal
import gpu_cost_model as gcm
import project_gpu as pg

# layers 2, 4 q heads, 2 kv heads, head_dim 4: weights 3472 B, exact KV 64 B per token, matmul params
# 1656 (F_row = 3312 FLOPs), F_qk = 4 * 4 * 4 * 2 = 128 FLOPs per (query, key) (test_project_gpu.py).
TINY = gcm.ModelShape(
    "tiny", layers=2, hidden=8, q_heads=4, kv_heads=2, head_dim=4, intermediate=16, vocab=10
)
MEMBOUND = gcm.GPU(hbm_bytes=1e6, mem_fraction=1.0, hbm_bw=1000, flops=1e12, link_bw=100, host_bytes=1e9)


def test_mistral_small_24b_matches_its_config():
    # per layer: attention 5120 * (4096 + 2 * 1024) + 4096 * 5120 = 52,428,800; MLP 3 * 5120 * 32768 =
    # 503,316,480; norms 10,240 -> 555,755,520 x 40 = 22,230,220,800; embedding + lm_head 2 * 131072 *
    # 5120 = 1,342,177,280; final norm 5120.
    assert gcm.MISTRAL_SMALL_24B.params == 23_572_403_200
    assert gcm.MISTRAL_SMALL_24B.kv_bytes_per_token == 2 * 40 * 8 * 128 * 2 == 163_840
    assert gcm.MISTRAL_SMALL_24B.with_tp(2).kv_bytes_per_token == 81_920


def test_hardware_presets_are_the_published_figures():
    figures = {k: (g.hbm_bytes, g.hbm_bw, g.flops, g.link_bw, g.nvlink_bw) for k, g in gcm.HARDWARE.items()}
    assert figures == {
        "h200": (141e9, 4.8e12, 790e12, 55e9, 450e9),
        "rtx-pro-6000": (96e9, 1.792e12, 500e12, 55e9, 50e9),
        "h100-nvl": (94e9, 3.9e12, 835e12, 55e9, 300e9),
    }


def test_tied_embeddings_count_once_and_are_the_lm_head():
    tied = gcm.ModelShape(
        "t",
        layers=2,
        hidden=8,
        q_heads=4,
        kv_heads=2,
        head_dim=4,
        intermediate=16,
        vocab=10,
        tied_embeddings=True,
        dtype_bytes=4,
        kv_dtype_bytes=2,
    )
    # 1736 - 80 (one vocab x hidden less); every parameter is in a product (the lm_head is the embedding);
    # float32 weights 4 * 1656 B; bfloat16 KV 2 * 2 layers * 2 heads * 4 * 2 B = 64 B per token.
    assert (tied.params, tied.matmul_params, tied.weight_bytes, tied.kv_bytes_per_token) == (
        1656,
        1656,
        6624,
        64,
    )


SERIAL = gcm.GPU(
    hbm_bw=1000,
    flops=2000,
    link_bw=100,
    serial=True,
    kv_bw=500,
    attn_flops=1000,
    per_forward_s=1.0,
    per_request_s=0.5,
    draft_overhead_s=2.0,
)


def test_serial_profile_sums_fixed_memory_and_compute_terms():
    cm = gcm.CostModel(TINY, SERIAL, ratio=4)
    w = gcm.Work()
    cm.draft_row(w, committed=100, drafts=2)  # 1 query over 28 keys
    # fixed 1 + 0.5 + 2 (a drafting forward); weights max(3472/1000, 3312/2000) = 3.472;
    # KV 28*64/500 = 3.584; attention 128*28/1000 = 3.584.
    assert cm.time(w).total_s == pytest.approx(3.5 + 3.472 + 3.584 + 3.584, abs=1e-12)
    w = gcm.Work()
    cm.verify_row(w, committed=100, drafts=3)  # 4 queries over 104 keys, 6400 B staged
    # fixed 1.5; max(3.472, 4*3312/2000 = 6.624); KV 104*64/500 = 13.312; attention 128*416/1000 = 53.248;
    # staged copy 6400/1000 = 6.4 -> forward 81.084; link 64 s, hidden but for one of 2 layers.
    t = cm.time(w)
    assert (t.forward_s, t.link_s) == pytest.approx((81.084, 64.0), abs=1e-12)
    assert t.total_s == pytest.approx(81.084 + 64 / 2, abs=1e-12)


def test_expected_step_moves_each_streamed_verification_within_its_own_iteration():
    cm = gcm.CostModel(TINY, MEMBOUND, ratio=4)
    w = gcm.Work()
    cm.verify_row(w, committed=100, drafts=0, weight=0.5)  # half a verification per iteration
    # forward (3472 + 0.5*101*64 + 0.5*6400) / 1000 = 9.904 s. Averaged, the link would be 32 s per
    # iteration: 32 + 9.904/2 = 36.952. Really half the iterations carry none (9.904) and half one
    # whole verification (64 + 9.904/2 = 68.952): 39.428 s.
    assert cm.time(w).total_s == pytest.approx(36.952, abs=1e-12)
    assert cm.expected_step(w) == pytest.approx(0.5 * 9.904 + 0.5 * 68.952, abs=1e-12)


def policy(accepted=lambda x: float(x), lengths=(2,), gpu=MEMBOUND) -> gcm.Policy:
    return gcm.Policy(gcm.CostModel(TINY, gpu, ratio=4), accepted, lengths)


def test_a_round_option_is_its_rows_averaged_over_x_plus_one_iterations():
    o = policy().round(100, 2, host=True)
    # drafts over 26 and 27 keys, a verify of 3 queries over 103 keys streaming 100 * 64 B; all / 3.
    w = o.work
    assert (o.kind, o.x, o.host, o.tokens) == ("round", 2, True, pytest.approx(1.0))  # (1 + A(2)) / 3, A = 2
    assert (w.tokens, w.keys, w.qk) == pytest.approx((5 / 3, 156 / 3, (26 + 27 + 3 * 103) / 3))
    assert (w.link_bytes, w.requests, w.drafts, w.verifies) == pytest.approx((6400 / 3, 1, 2 / 3, 1 / 3))
    resident = policy(lambda x: 0.0).round(100, 2, host=False)
    assert (resident.host, resident.work.link_bytes, resident.tokens) == (False, 0.0, pytest.approx(1 / 3))


def test_a_host_round_that_lengthens_the_iterations_more_than_it_adds_waits():
    pol = policy()
    b = gcm.Batch()
    b.add(pol.decode(100))  # one resident decoding: (3472 + 101*64) / 1000 = 9.936 s per token
    assert pol.evaluate(b) == (pytest.approx(1 / 9.936), False)
    # With a host round: forward (3472 + (101 + 52) * 64 + 6400/3) / 1000; a third of the iterations also
    # move one verification's 64 s: 2 tokens over (2/3) f + (1/3) (64 + f/2) s. Worse, and the link
    # has free slots (cap 1, v = 1/3), so the request waits.
    f = (3472 + 153 * 64 + 6400 / 3) / 1000
    th, saturated = pol.evaluate(b, pol.round(100, 2, host=True))
    assert (th, saturated) == (pytest.approx(2 / (2 / 3 * f + 1 / 3 * (64 + f / 2)), abs=1e-12), False)
    assert pol.best(b, pol.options(100, resident=False, drafting=True, max_x=2)).kind == "wait"


def test_on_a_saturated_link_a_host_round_books_a_slot_instead_of_waiting():
    pol = policy()
    o = pol.round(100, 2, host=True)
    b = gcm.Batch()
    for _ in range(3):
        b.add(o)  # v = 3 * 1/3 = 1 verification per iteration: the cap of this link (64 s each)
    th3, sat3 = pol.evaluate(b)
    th4, sat4 = pol.evaluate(b, o)  # a 4th: the host tier runs 3/4 of its rounds, the same work
    assert (sat3, sat4) == (False, True) and th4 == pytest.approx(th3, rel=1e-12)
    assert pol.best(b, pol.options(100, resident=False, drafting=True, max_x=2)).kind == "round"


def test_residents_fit_beside_the_host_tier_its_staging_and_compressed_tiers():
    cm = gcm.CostModel(TINY, MEMBOUND, ratio=4)
    # free 1e6 - 3472 = 996528 B; a host-tier request holds (ceil(106/4) + 2 + 1) * 64 = 1920 B; staging
    # 2 layers' rows: 2 * 200 * 64 / 2 = 12800 B; a resident 106 * 64 = 6784 B (+ 1920 B if it drafts).
    assert cm.residents(106, 0, 2, 200, drafting=False) == 146 == cm.full_max_batch(106)
    assert cm.residents(106, 2, 2, 200, drafting=False) == (996528 - 2 * 1920 - 12800) // 6784 == 144
    assert cm.residents(106, 2, 2, 200, drafting=True) == (996528 - 2 * 1920 - 12800) // 8704 == 112
    assert cm.residents(106, 600, 2, 200, drafting=False) == -1  # 600 compressed tiers do not fit


def test_plan_is_full_mode_when_rounds_do_not_pay():
    pol = policy(lambda x: 0.0)  # nothing accepted: a round emits 1 token per 3 iterations
    plan = pol.plan(context=100, output=6, max_host=10, staging_tokens=200)
    # full: floor((1e6 - 3472) / (106 * 64)) = 146 residents decoding at context 103:
    # 146 / ((3472 + 146 * 104 * 64) / 1000) tokens/s.
    assert {k: plan[k] for k in ("drafting", "residents", "host", "resident_option")} == {
        "drafting": False,
        "residents": 146,
        "host": 0,
        "resident_option": "decode",
    }
    assert plan["theta"] == pytest.approx(146 / ((3472 + 146 * 104 * 64) / 1000), rel=1e-12)


def test_plan_drafts_on_residents_when_every_draft_is_accepted_and_kv_dominates():
    plan = policy().plan(context=100, output=6, max_host=0, staging_tokens=200)
    # A resident that drafts also holds (ceil(106/4) + 2 + 1) * 64 = 1920 B: floor(996528 / 8704) = 114.
    # Rounds of 2 read (26.75 + 27.75 + 106) / 3 keys per iteration at context 103 and emit 1 token.
    assert {k: plan[k] for k in ("drafting", "residents", "resident_option", "resident_x")} == {
        "drafting": True,
        "residents": 114,
        "resident_option": "round",
        "resident_x": 2,
    }
    assert plan["theta"] == pytest.approx(
        114 / ((3472 + 114 * (26.75 + 27.75 + 106) / 3 * 64) / 1000), rel=1e-12
    )


def _sim(gpu: gcm.GPU, acc: pg.Acceptance, x: int = 2) -> pg.Simulator:
    return pg.Simulator(
        gcm.CostModel(TINY, gpu, ratio=4),
        prompt=100,
        output=6,
        max_draft=x,
        staging_tokens=1000,
        acceptance=acc,
    )


def test_adaptive_on_the_full_mode_plan_replays_full_mode_exactly():
    acc = pg.Acceptance(rate=0.0)
    pol = gcm.Policy(gcm.CostModel(TINY, MEMBOUND, ratio=4), acc.expected, (2,))
    plan = pol.plan(100, 6, max_host=10, staging_tokens=1000)
    assert (plan["residents"], plan["host"], plan["drafting"]) == (146, 0, False)
    full, adaptive = _sim(MEMBOUND, acc).run_full(146, 292), _sim(MEMBOUND, acc).run_adaptive(pol, plan, 292)
    assert (adaptive.tokens, adaptive.forwards, adaptive.decodes, adaptive.rounds) == (
        full.tokens,
        full.forwards,
        292 * 6,
        0,
    )
    assert adaptive.seconds == pytest.approx(full.seconds, rel=1e-12)


def test_adaptive_with_every_request_on_the_host_replays_the_staggered_schedule():
    acc = pg.Acceptance(rate=1.0)
    pol = gcm.Policy(gcm.CostModel(TINY, MEMBOUND, ratio=4), acc.expected, (2,))
    plan = {"drafting": False, "residents": 0, "host": 2}
    stag, adaptive = _sim(MEMBOUND, acc).run_staggered(2, 4), _sim(MEMBOUND, acc).run_adaptive(pol, plan, 4)
    assert (adaptive.tokens, adaptive.rounds, adaptive.forwards) == (stag.tokens, stag.rounds, stag.forwards)
    assert adaptive.seconds == pytest.approx(stag.seconds, rel=1e-12)
    assert adaptive.choices == {("host", 2): stag.rounds}


def test_acceptance_expectation_is_the_mean_of_what_it_samples():
    acc = pg.Acceptance(by_x={8: [(8, 4), (8, 8)], 30: [(30, 9)]})
    # x = 4 and 16 use the 8-draft trace: (2 + 4) / 2 = 3 and (8 + 16) / 2 = 12; x = 30 its own: 9;
    # x = 20 is nearer 30 (ties go to the longer trace).
    assert [acc.expected(x) for x in (4, 16, 30, 20)] == [3.0, 12.0, 9.0, 6.0]


def test_calibration_capacity_follows_the_runtimes_accounting():
    case = {
        "args": {
            "device_kv_budget": "46399488",
            "page_size": 32,
            "input_len": 1600,
            "output_len": 256,
            "ratio": 4.0,
            "num_requests": 16,
            "staging_tokens": 4096,
        }
    }
    shape = cal.tiny_shape(
        str(Path(pg.__file__).parents[1] / "python/sglang_vericache/assets/vericache-code-tiny")
    )
    assert (shape.layers, shape.kv_bytes_per_token, shape.tied_embeddings) == (8, 8192, True)
    # 58 pages per request. full: 46399488 // 8192 = 5664 tokens = 177 pages -> 3. A compressed chunk:
    # 8 kept tokens x (8192 B + 8 layers x 2 heads x 2 B of index) = 65792 B -> lossy 705 chunks -> 12;
    # VeriCache less (1 + 24 * 17) * 8192 B of draft scratch and 2 * 4096 * 1024 B of staging: 526 -> 9.
    assert cal.batches(case, shape, X=16) == {"full": 3, "lossy": 12, "lockstep": 9, "staggered": 9}


def test_calibration_results_report_every_case_with_errors():
    path = Path(pg.__file__).parent / "results" / "calibration_cpu.json"
    if not path.exists():
        pytest.skip("no results/calibration_cpu.json")
    report = json.loads(path.read_text())
    assert report["profile"]["serial"] is True
    for c in report["cases"]:
        assert [m["mode"] for m in c["modes"]] == ["full", "lossy", "vc-lockstep", "vc-staggered"]
        for m in c["modes"]:
            assert m["tok_s_rel_err"] == pytest.approx(m["predicted_tok_s"] / m["measured_tok_s"] - 1)
