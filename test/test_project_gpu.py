"""The H200 projection (benchmark/project_gpu.py): its cost model, memory limits and policy replay
on a tiny hand-made shape, with every expected number derived by hand in the comments."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
import project_gpu as pg  # noqa: E402

# layers 2, hidden 8, 4 q heads, 2 kv heads, head_dim 4, MLP 16, vocab 10, bf16, TP 1.
# params: attn 8*(16+8+8) + 16*8 = 384; MLP 3*8*16 = 384; norms 16 -> 784 per layer, x2 = 1568;
#         embedding + lm_head 2*10*8 = 160; final norm 8 -> 1736. Weight bytes 3472.
# matmul params 1736 - 80 = 1656. Exact KV per token: 2 (K,V) * 2 layers * 2 heads * 4 * 2 B = 64 B.
TINY = pg.ModelShape("tiny", layers=2, hidden=8, q_heads=4, kv_heads=2, head_dim=4, intermediate=16, vocab=10)
# attention FLOPs per (query, key): 4 * 4 heads * 4 * 2 layers = 128.
SLOW = pg.GPU(hbm_bytes=10_000, mem_fraction=1.0, hbm_bw=1000, flops=2000, link_bw=100, host_bytes=1e9)
MEMBOUND = pg.GPU(hbm_bytes=1e6, mem_fraction=1.0, hbm_bw=1000, flops=1e12, link_bw=100, host_bytes=1e9)


def test_tiny_shape_sizes():
    sizes = (TINY.params, TINY.matmul_params, TINY.weight_bytes, TINY.kv_bytes_per_token)
    assert sizes == (1736, 1656, 3472, 64)


def test_published_shapes_match_their_parameter_counts_and_kv_sizes():
    assert pg.LLAMA3_70B.params == 70_553_706_496  # Llama-3-70B config.json shapes
    assert pg.QWEN25_32B.params == 32_763_876_352  # Qwen2.5-32B (q/k/v bias)
    assert pg.LLAMA3_70B.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2  # TP=4: 2 of 8 kv heads per GPU
    assert pg.LLAMA3_70B.weight_bytes == 70_553_706_496 * 2 / 4
    assert pg.QWEN25_32B.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2


def test_full_decode_step_time_is_the_roofline_of_weights_and_kv():
    cm = pg.CostModel(TINY, SLOW, ratio=4)
    w = pg.Work()
    cm.full_row(w, 10)  # 10 keys * 64 B = 640 B of KV
    t = cm.time(w)
    # HBM (3472 + 640) / 1000 = 4.112 s; FLOPs 2*1656 + 128*10 = 4592 -> 2.296 s; no link, no TP.
    assert (t.hbm_s, t.compute_s, t.comm_s, t.link_s) == pytest.approx((4.112, 2.296, 0.0, 0.0), abs=1e-12)
    assert t.total_s == pytest.approx(4.112, abs=1e-12)


def test_verify_step_overlaps_the_link_with_all_but_one_layer_of_compute():
    cm = pg.CostModel(TINY, SLOW, ratio=4)
    w = pg.Work()
    cm.verify_row(w, committed=100, drafts=3)  # 4 queries over 104 keys; 100 exact tokens cross the link
    t = cm.time(w)
    # HBM (3472 + 104*64 read + 6400 staged) / 1000 = 16.528; FLOPs 2*1656*4 + 128*4*104 = 66496 -> 33.248 s;
    # link 6400 / 100 = 64 s; total = max(33.248, 64) + 33.248 / 2 layers = 80.624 s.
    assert (t.hbm_s, t.compute_s, t.link_s) == pytest.approx((16.528, 33.248, 64.0), abs=1e-12)
    assert t.total_s == pytest.approx(80.624, abs=1e-12)


def test_draft_row_reads_the_compressed_kv_and_its_own_drafts():
    cm = pg.CostModel(TINY, MEMBOUND, ratio=4)
    w = pg.Work()
    cm.draft_row(w, committed=100, drafts=2)  # 100/4 + 2 + 1 = 28 keys
    assert (w.tokens, w.keys, w.qk, w.link_bytes, w.drafts) == (1, 28, 28, 0, 1)
    assert cm.time(w).total_s == pytest.approx((3472 + 1792) / 1000, abs=1e-12)


def test_tensor_parallel_all_reduces_add_to_the_step():
    shape = pg.ModelShape("tiny-tp2", layers=2, hidden=8, q_heads=4, kv_heads=2, head_dim=4, intermediate=16,
                          vocab=10, tp=2)
    gpu = pg.GPU(hbm_bw=1000, flops=1e12, nvlink_bw=16, allreduce_latency_s=0.5)
    cm = pg.CostModel(shape, gpu, ratio=4)
    w = pg.Work()
    cm.full_row(w, 10)  # kv per GPU 32 B/token -> 320 B
    t = cm.time(w)
    # HBM (1736 + 320) / 1000 = 2.056; all-reduce: 2 * 2 layers * (0.5 + 2*(1/2)*1*8*2 B / 16) = 4 * 1.5 = 6.
    assert (t.hbm_s, t.comm_s, t.total_s) == pytest.approx((2.056, 6.0, 8.056), abs=1e-12)


def test_full_max_batch_is_free_hbm_over_one_requests_exact_kv():
    cm = pg.CostModel(TINY, SLOW, ratio=4)
    # free = 10000 - 3472 = 6528 B; a request of 20 tokens holds 20 * 64 = 1280 B -> floor(5.1) = 5.
    assert cm.full_max_batch(20) == 5 == math.floor(6528 / 1280)


def test_vericache_max_batch_counts_compressed_kv_draft_scratch_staging_and_host():
    cm = pg.CostModel(TINY, SLOW, ratio=4)
    # per request (ceil(20/4) + X 3 + 1) * 64 = 576 B; staging 2 layers * 30 rows * 32 B = 1920 B;
    # (6528 - 1920) / 576 = 8; host 1e9 B is no limit.
    assert cm.vc_max_batch(20, max_draft=3, staging_tokens=30) == 8
    small_host = pg.CostModel(TINY, pg.GPU(**{**pg.asdict(SLOW), "host_bytes": 3000}), ratio=4)
    assert small_host.vc_max_batch(20, max_draft=3, staging_tokens=30) == 2  # floor(3000 / 1280)


def test_acceptance_maps_a_trace_rounds_rate_onto_the_simulated_draft_length():
    class FirstThenSecond:
        def __init__(self):
            self.i = -1

        def randrange(self, n):
            self.i += 1
            return self.i % n

    acc = pg.Acceptance(rounds=[(8, 4), (8, 8), (0, 0)])  # (0, 0) rounds carry no rate: dropped
    rng = FirstThenSecond()
    assert [acc.accepted(rng, 30), acc.accepted(rng, 30), acc.accepted(rng, 7)] == [15, 30, 3]
    assert pg.Acceptance(rate=0.8).accepted(rng, 30) == 24


def test_load_trace_picks_the_compressor_ratio_and_nearest_draft_length(tmp_path):
    rows = [dict(compressor="snapkv", ratio=4.0, draft_tokens=x, accept_rate=0.5, accept_length=1.0,
                 round_trace=[[x, x // 2]]) for x in (8, 16, 30)]
    rows.append(dict(compressor="snapkv", ratio=2.0, draft_tokens=30, accept_rate=1, accept_length=1,
                     round_trace=[[1, 1]]))
    path = tmp_path / "acceptance.json"
    path.write_text(json.dumps({"rows": rows}))
    trace, meta = pg.load_trace(path, "snapkv", 4.0, 20)
    assert trace == [[16, 8]] and meta["draft_tokens"] == 16
    assert pg.load_trace(path, "snapkv", 4.0, 64)[0] == [[30, 15]]


def _sim(gpu: pg.GPU, staging: int = 1000) -> pg.Simulator:
    # 2 requests, prompt 100, 6 output tokens, X = 2, every draft accepted: two rounds of 3 tokens.
    return pg.Simulator(pg.CostModel(TINY, gpu, ratio=4), prompt=100, output=6, max_draft=2,
                        staging_tokens=staging, acceptance=pg.Acceptance(rate=1.0))


# HBM-bound step times on MEMBOUND (weights 3472 B, 64 B/key, 1000 B/s), two requests; a verify also
# writes its staged exact KV (committed * 64 B) into HBM:
#   round 1 (committed 100): drafts 2*(25+1) keys -> 6.800, 2*(25+2) -> 6.928;
#                            verify 2*103 keys + 2*100 staged -> (3472 + 13184 + 12800) / 1000 = 29.456
#   round 2 (committed 103): drafts 2*26.75 -> 6.896, 2*27.75 -> 7.024;
#                            verify (3472 + 13568 + 13184) / 1000 = 30.224
IDEAL_S = 6.800 + 6.928 + 29.456 + 6.896 + 7.024 + 30.224  # 87.328 s for 12 tokens


def test_all_accepted_and_an_infinite_link_staggered_equals_lockstep_equals_the_ideal():
    gpu = pg.GPU(**{**pg.asdict(MEMBOUND), "link_bw": math.inf})
    # With room on the link everyone books iteration x: staggering degenerates to lock-step, and both
    # give x + 1 tokens per round at the cost of x draft steps and one verify step.
    lock = _sim(gpu).run_lockstep(batch=2, n=2)
    stag = _sim(gpu).run_staggered(batch=2, n=2)
    for st in (lock, stag):
        assert (st.tokens, st.rounds, st.forwards, st.link_s) == (12, 4, 6, 0.0)
        assert st.seconds == pytest.approx(IDEAL_S, abs=1e-9)
        assert st.summary()["tokens_per_round"] == 3.0


def test_with_a_slow_link_staggered_beats_lockstep_by_overlapping_drafts_with_transfers():
    # Link 100 B/s: a verify of 100 committed tokens moves 6400 B = 64 s, far above an iteration.
    lock = _sim(MEMBOUND).run_lockstep(batch=2, n=2)
    # lock-step: round 1 = 6.8 + 6.928 + (128 + 29.456/2) = 156.456; round 2 = 6.896 + 7.024 +
    # (131.84 + 30.224/2) = 160.872; the link idles during all drafting.
    assert lock.seconds == pytest.approx(317.328, abs=1e-9)
    stag = _sim(MEMBOUND).run_staggered(batch=2, n=2)
    # staggered: each verify is bigger than an iteration's link budget, so each takes an empty slot:
    # r0 books iteration 2, r1 iteration 3. Iterations:
    #  0 both draft 6.8 | 1 both draft 6.928
    #  2 r0 verifies: HBM (3472 + 6592 + 6400) -> 64 + 16.464/2 = 72.232
    #  3 r1 verifies while r0 drafts: (3472 + 1712 + 6592 + 6400) -> 64 + 18.176/2 = 73.088; r0 books 5
    #  4 both draft (3472 + 1776 + 1712) -> 6.96; r1 books 6 (the link budget, 100 B/s x the iteration-time
    #    EMA, stays under a 6592 B verify throughout, so every booking takes the next empty slot)
    #  5 r0 verifies while r1 drafts: (3472 + 6784 + 6592 + 1776) -> 65.92 + 18.624/2 = 75.232
    #  6 r1 verifies: (3472 + 6784 + 6592) -> 65.92 + 16.848/2 = 74.344
    assert stag.seconds == pytest.approx(6.8 + 6.928 + 72.232 + 73.088 + 6.96 + 75.232 + 74.344, abs=1e-9)
    assert stag.seconds == pytest.approx(315.584, abs=1e-9)
    assert (stag.tokens, stag.rounds, stag.forwards) == (12, 4, 7)
    assert stag.tokens / stag.seconds > lock.tokens / lock.seconds


def test_sampled_traces_with_a_slow_link_fixed_seed_numbers():
    # 6 requests of 12 tokens, batch 3, X = 3, rounds sampled (seed 0) from a trace accepting 1, 3 or 4
    # of 4 drafts. The same request draws the same rounds in both modes (35 rounds, 37 accepted), so
    # the schedules differ only in time. These totals are the simulator's own (not derived by hand).
    cm = pg.CostModel(TINY, MEMBOUND, ratio=4)
    acc = pg.Acceptance(rounds=[(4, 1), (4, 3), (4, 4)])
    sim = lambda: pg.Simulator(cm, 100, 12, 3, 1000, acc, seed=0)  # noqa: E731
    lock, stag = sim().run_lockstep(3, 6), sim().run_staggered(3, 6)
    assert (lock.tokens, lock.rounds, lock.accepted, lock.forwards) == (72, 35, 37, 48)
    assert (stag.tokens, stag.rounds, stag.accepted, stag.forwards) == (72, 35, 37, 45)
    assert lock.seconds == pytest.approx(2887.224, abs=1e-6)
    assert stag.seconds == pytest.approx(2791.232, abs=1e-6)
    # The same exact KV crosses the link in both; staggering hides more of it behind drafting.
    assert lock.link_s == pytest.approx(stag.link_s, abs=1e-6)


def test_full_mode_runs_waves_of_its_max_batch():
    sim = _sim(MEMBOUND)
    st = sim.run_full(batch=2, n=4)
    # two waves of 6 steps; step k of a wave reads 2 * (100 + k + 1) keys: sum over k=0..5 is
    # (6*3472 + 64 * 2 * (101+...+106)) / 1000 = (20832 + 128 * 621) / 1000 = 100.32 s per wave.
    assert (st.tokens, st.forwards) == (24, 12)
    assert st.seconds == pytest.approx(2 * 100.32, abs=1e-9)


def test_trace_sampling_is_seeded_and_the_same_request_samples_the_same_rounds_in_every_mode():
    cm = pg.CostModel(TINY, MEMBOUND, ratio=4)
    acc = pg.Acceptance(rounds=[(10, 2), (10, 7), (10, 10)])
    make = lambda seed: pg.Simulator(cm, 100, 40, 4, 1000, acc, seed=seed)  # noqa: E731
    a, b = make(0).run_lockstep(3, 6), make(0).run_lockstep(3, 6)
    assert (a.seconds, a.accepted, a.rounds) == (b.seconds, b.accepted, b.rounds)
    reqs0, reqs1 = make(0).requests(2), make(1).requests(2)
    draws = lambda rs: [acc.accepted(r.rng, 4) for r in rs for _ in range(5)]  # noqa: E731
    assert draws(make(0).requests(2)) == draws(reqs0) != draws(reqs1)


CLI = ["--models", "qwen2.5-32b", "--contexts", "32768", "--output-tokens", "64", "--waves", "1",
       "--link-gbps", "55", "--h200-sensitivity-gbps"]


def test_cli_without_traces_warns_and_labels_every_output_a_projection(tmp_path, capsys):
    pg.main([*CLI, "--hardware", "h200", "h100-nvl", "--acceptance-json", str(tmp_path / "missing.json"),
             "--calibration-json", str(tmp_path / "none.json"), "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "WARNING" in err and "CONSTANT acceptance rate of 80%" in err
    md = (tmp_path / "project_gpu.md").read_text()
    report = json.loads((tmp_path / "project_gpu.json").read_text())
    assert "PROJECTION" in md and "FALLBACK" in md and "1.92-2.73x" in md and "up to 4x" in md
    assert report["label"].startswith("PROJECTION") and report["paper_speedup"] == [1.92, 2.73]
    # One flat row per (hardware, model, context, policy), with the fields.
    # The paper's hardware also gets the sensitivity rows (a constant 90% acceptance), labelled.
    keys = [(r["hardware"], r["model"], r["context"], r["policy"], r["acceptance"]) for r in report["rows"]]
    assert keys == [(hw, "Qwen2.5-32B", 32768, p, acc)
                    for hw, acc in (("H200", "measured traces"), ("H100 NVL", "measured traces"),
                                    ("H100 NVL", "constant 90% (sensitivity)"))
                    for p in ("full", "staggered", "adaptive")]
    assert "### Sensitivity: the paper's acceptance" in md
    h200_full = report["rows"][0]
    assert (h200_full["batch"], h200_full["ratio_to_full"], h200_full["tp"]) == (7, 1.0, 1)
    assert "paper_speedup" not in h200_full  # the paper's figures go beside its own hardware only
    nvl = [r for r in report["rows"] if r["hardware"] == "H100 NVL"]
    assert all(r["paper_speedup"] == [1.92, 2.73] and r["paper_max"] == 4.0 and r["tp"] == 2 for r in nvl)
    assert all(r["ratio_to_full"] >= 1.0 for r in report["rows"] if r["policy"] == "adaptive")
    assert "Adaptive at or above full on every H200 row: **yes**" in md
    assert (tmp_path / "project_gpu.png").stat().st_size > 0


def test_cli_with_traces_samples_them_and_names_the_source(tmp_path):
    trace = tmp_path / "acceptance.json"
    row = dict(compressor="kivi4", ratio=None, draft_tokens=16, accept_rate=0.5, accept_length=9.0,
               round_trace=[[16, 8]])  # every round accepts half: X=30 -> 15 accepted, 16 tokens per round
    trace.write_text(json.dumps({"rows": [row]}))
    pg.main([*CLI, "--hardware", "h200", "--policies", "full", "lockstep", "--compressor", "kivi4",
             "--sensitivity-accept-rate", "-1",
             "--acceptance-json", str(trace), "--results-dir", str(tmp_path)])
    report = json.loads((tmp_path / "project_gpu.json").read_text())
    assert "round traces" in report["acceptance_source"] and "kivi4" in report["acceptance_source"]
    assert list(report["acceptance"]) == ["16"]
    out = report["configs"][0]
    # 64 tokens per request: rounds of 16, 16, 16, then the last 16 tokens (x = 15 -> 7 accepted + 1 = 8,
    # then x = 7 -> 3 + 1 = 4, x = 3 -> 1 + 1, x = 1 -> 0 + 1, x = 0 -> 1): 8 rounds for 64 tokens.
    assert out["modes"]["lockstep"]["tokens_per_round"] == 64 / 8


def test_project_sizes_staging_and_batches_and_reports_speedups_as_ratios():
    row = pg.project(TINY, MEMBOUND, context=100, output=6, ratio=4, max_draft=2,
                     acceptance=pg.Acceptance(rate=1.0), staging_bytes=16_000, waves=1)
    # staging row = 2 layers * 32 B = 64 B -> 250 rows; full: floor((1e6 - 3472) / (106 * 64)) = 146;
    # VeriCache: floor((996528 - 16000) / ((27 + 3) * 64)) = 510 (host 1e9 B is no limit).
    assert (row["staging_tokens"], row["max_batch_full"], row["max_batch_vc"]) == (250, 146, 510)
    m = row["modes"]
    assert row["speedup_staggered"] == m["staggered"]["tokens_per_s"] / m["full"]["tokens_per_s"]
    assert row["speedup_lockstep"] == m["lockstep"]["tokens_per_s"] / m["full"]["tokens_per_s"]
    assert m["full"]["tokens"] == 146 * 6 and m["staggered"]["tokens"] == m["lockstep"]["tokens"] == 510 * 6


def test_every_flag_has_help():
    for action in pg.build_parser()._actions:
        assert action.help, action.dest
