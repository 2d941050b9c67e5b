"""Calibrate the cost model (gpu_cost_model.py) on this CPU against bench_long_context.py's measurements.

    .venv/bin/python benchmark/calibrate_cpu.py                  # measure, fit, replay (~15 s)
    .venv/bin/python benchmark/calibrate_cpu.py --microbench     # also the timed-forward profile (~1 min)
    .venv/bin/python benchmark/calibrate_cpu.py --replay-only    # reuse results/calibration_cpu.json's profile

1. Measure DRAM read bandwidth and matmul throughput with torch (1 thread, like the runs).
2. Fit a serial profile's unknowns (per forward, per request row, per drafting forward, attention's
   effective KV bandwidth and FLOP/s) by non-negative least squares on relative errors, to what each
   benchmark/results/long_context*.json run measured without the link or the schedule coming in: the
   full and lossy runs' wall time, the lock-step draft step median and the prefill total. A serial
   forward is linear in the unknowns, so each quantity's model value is known + sum c_k * unit_k.
3. Replay every setting (16 x (1600 + 256), its device budget, link, X, staging) through
   gpu_sim.Simulator with that profile, plus the prefill its tokens/s include, and compare tokens/s,
   ratios to full and step times: the VeriCache modes (lock-step, staggered) are predictions. Acceptance:
   the acceptance.json round traces (snapkv, the nearest draft length), as in the GPU projection.
--microbench: a second, independent profile fitted only to timed forwards of the bundled model
(cpu_microbench.py, thread CPU time), reported beside; it is sensitive to the shared machine's load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import project_gpu as pg
from cpu_microbench import fit_profile, measure_machine, time_forwards, tiny_shape
from gpu_cost_model import GPU, CostModel, ModelShape, Work

RESULTS = Path(__file__).parent / "results"
CASES = ("long_context", "long_context_link1GB", "long_context_200MB_bf16kv", "long_context_1GB_bf16kv")
MODE_FOR = {"full": "full", "lossy": "lossy", "vc-lockstep": "lockstep", "vc-staggered": "staggered"}


# ---------------------------------------------------------------- fit to and replay bench_long_context settings


def _bytes(text: str) -> float:
    from sglang_vericache.server_args import parse_bytes

    return float(parse_bytes(text))


def batches(case: dict, shape: ModelShape, X: int) -> dict[str, int]:
    """The runtime's capacity per mode (model_runner / two_tier accounting), at the requests' final length."""
    a = case["args"]
    per_token, ps, layers = shape.kv_bytes_per_token, a["page_size"], shape.layers
    budget = _bytes(a["device_kv_budget"])
    pages_per_req = math.ceil((a["input_len"] + a["output_len"]) / ps)
    # A token-dropping chunk keeps page / R tokens per layer and KV head, with an int16 index each.
    chunk = ps / a["ratio"] * (per_token + 2 * layers * shape.kv_heads)
    full = int(budget // per_token) // ps // pages_per_req
    lossy = int(budget // chunk) // pages_per_req
    overhead = (1 + (a["num_requests"] + 8) * (X + 1)) * per_token + 2 * a[
        "staging_tokens"
    ] * per_token // layers
    vc = int((budget - overhead) // chunk) // pages_per_req
    return {"full": full, "lossy": lossy, "lockstep": vc, "staggered": vc}


UNIT_FIELDS = ("per_forward_s", "per_request_s", "draft_overhead_s", "kv_bw", "attn_flops")


def _profiles(machine: dict) -> tuple[GPU, list[GPU]]:
    """The known part (weights and matmuls at the measured bandwidth and FLOP/s) and one profile per
    unknown with only that coefficient at 1: a serial forward's time is linear in the unknowns, so a
    quantity's model value is known + sum_k c_k * (its value under unit profile k)."""
    inf = math.inf
    off = {"serial": True, "kv_bw": inf, "attn_flops": inf}
    known = GPU(name="known", hbm_bw=machine["hbm_bw"], flops=machine["flops"], **off)
    units = []
    for f in UNIT_FIELDS:
        # kv_bw = 1 B/s and attn_flops = 1 FLOP/s make their coefficients seconds per byte / per FLOP.
        units.append(GPU(name=f, hbm_bw=inf, flops=inf, **{**off, f: 1.0}))
    return known, units


def _coef_to_profile(coef, machine: dict) -> GPU:
    c = dict(zip(UNIT_FIELDS, coef))
    return GPU(
        name="CPU (this machine)",
        hbm_bytes=0.0,
        mem_fraction=1.0,
        hbm_bw=machine["hbm_bw"],
        flops=machine["flops"],
        serial=True,
        per_forward_s=c["per_forward_s"],
        per_request_s=c["per_request_s"],
        draft_overhead_s=c["draft_overhead_s"],
        kv_bw=1 / c["kv_bw"] if c["kv_bw"] > 0 else math.inf,
        attn_flops=1 / c["attn_flops"] if c["attn_flops"] > 0 else math.inf,
    )


def _nonneg_lstsq(a, y):
    """Least squares with coefficients >= 0: drop the most negative one and refit until none is."""
    import numpy as np

    free = list(range(a.shape[1]))
    while True:
        sol = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
        if (sol >= 0).all() or not free:
            coef = np.zeros(a.shape[1])
            coef[free] = sol
            return coef
        free.pop(int(np.argmin(sol)))


def bench_quantities(case: dict, shape: ModelShape, acc: pg.Acceptance):
    """What calibration fits to, from one bench_long_context run: (name, measured seconds, value(profile))
    for the full and lossy runs' wall time (decode + prefill), the lock-step draft step median and the
    whole prefill. The VeriCache modes' tokens/s and their verify steps are left out (predicted)."""
    a = case["args"]
    X, P, O, N = a["draft_tokens"], a["input_len"], a["output_len"], a["num_requests"]
    b = batches(case, shape, X)
    rows = {r["mode"]: r for r in case["rows"]}
    L = P + O // 2
    pre = Work(tokens=P, keys=P, qk=P * (P + 1) / 2, requests=1)
    redo = Work(tokens=L, keys=L, qk=L * L / 2, requests=1)

    def run(mode: str):
        def value(prof: GPU) -> float:
            cm = CostModel(shape, replace(prof, link_bw=_bytes(a["link_bandwidth"])), a["ratio"])
            sim = pg.Simulator(cm, P, O, X, a["staging_tokens"], acc)
            st = sim.run_full(b[mode], N, compressed=mode == "lossy")
            retracted = rows[mode].get("retracted") or 0
            return st.seconds + N * cm.time(pre).total_s + retracted * cm.time(redo).total_s

        return value

    def draft(prof: GPU) -> float:
        cm = CostModel(shape, prof, a["ratio"])
        w = Work()
        for _ in range(b["lockstep"]):
            cm.draft_row(w, L, X / 2)
        return cm.time(w).total_s

    def prefill(prof: GPU) -> float:
        return N * CostModel(shape, prof, a["ratio"]).time(pre).total_s

    out = [
        (f"{m} run (wall)", N * O / rows[m]["tok_s_median"], run(m)) for m in ("full", "lossy") if m in rows
    ]
    lock = case.get("timelines", {}).get("vc-lockstep", {}).get("compute", [])
    drafts = [e - s for s, e, k in lock if k == "draft"]
    if drafts:
        out.append((f"lock-step draft step (B={b['lockstep']})", statistics.median(drafts), draft))
    pre_t = [e - s for s, e, k in lock if k == "prefill"]
    if pre_t:
        out.append(("prefill, all requests", sum(pre_t), prefill))
    return out


def fit_on_bench(names: list[str], machine: dict, acc: pg.Acceptance, model_path: str) -> tuple[GPU, dict]:
    """The serial profile's unknowns by least squares (relative errors) on bench_quantities of every case."""
    import numpy as np

    known, units = _profiles(machine)
    rows, ys, meta = [], [], []
    for name in names:
        case = json.loads((RESULTS / f"{name}.json").read_text())
        shape = tiny_shape(model_path, 4, 2 if case["args"].get("kv_cache_dtype") == "bfloat16" else 4)
        for q, measured, value in bench_quantities(case, shape, acc):
            rows.append([value(u) / measured for u in units])
            ys.append((measured - value(known)) / measured)
            meta.append((name, q, measured, value))
    coef = _nonneg_lstsq(np.array(rows), np.array(ys))
    prof = _coef_to_profile(coef, machine)
    points = []
    for name, q, measured, value in meta:
        pred = value(prof)
        points.append(
            {
                "case": name,
                "quantity": q,
                "measured_s": measured,
                "predicted_s": pred,
                "rel_err": pred / measured - 1,
            }
        )
    errs = [abs(p["rel_err"]) for p in points]
    return prof, {
        "method": "fit to bench_long_context: full and lossy wall time, lock-step draft step "
        "medians, prefill totals",
        "points": len(points),
        "unknowns": list(UNIT_FIELDS),
        "samples": points,
        "mean_abs_rel_err": statistics.mean(errs),
        "max_abs_rel_err": max(errs),
    }


def replay(case_name: str, prof: GPU, acc: pg.Acceptance, model_path: str) -> dict:
    case = json.loads((RESULTS / f"{case_name}.json").read_text())
    a = case["args"]
    kv_bytes = 2 if a.get("kv_cache_dtype") == "bfloat16" else 4
    shape = tiny_shape(model_path, 4, kv_bytes)
    X, P, O, N = a["draft_tokens"], a["input_len"], a["output_len"], a["num_requests"]
    cm = CostModel(shape, replace(prof, link_bw=_bytes(a["link_bandwidth"])), a["ratio"])
    sim = pg.Simulator(cm, P, O, X, a["staging_tokens"], acc)
    b = batches(case, shape, X)
    prefill = cm.time(Work(tokens=P, keys=P, qk=P * (P + 1) / 2, requests=1)).total_s
    redo = cm.time(Work(tokens=P + O // 2, keys=P + O // 2, qk=(P + O // 2) ** 2 / 2, requests=1)).total_s
    runs = {
        "full": lambda: sim.run_full(b["full"], N),
        "lossy": lambda: sim.run_full(b["lossy"], N, compressed=True),
        "lockstep": lambda: sim.run_lockstep(b["lockstep"], N),
        "staggered": lambda: sim.run_staggered(b["staggered"], N),
    }
    measured = {r["mode"]: r for r in case["rows"]}
    modes, pred_tps = [], {}
    for mode, row in measured.items():
        st = runs[MODE_FOR[mode]]().summary()
        wall = st["seconds"] + N * prefill + (row.get("retracted") or 0) * redo
        pred_tps[mode] = N * O / wall
        modes.append(
            {
                "mode": mode,
                "batch": b[MODE_FOR[mode]],
                "measured_tok_s": row["tok_s_median"],
                "measured_spread": (max(row["tok_s_runs"]) - min(row["tok_s_runs"])) / row["tok_s_median"],
                "predicted_tok_s": pred_tps[mode],
                "decode_s": st["seconds"],
                "prefill_s": wall - st["seconds"],
                "measured_tokens_per_round": row.get("tokens_per_round"),
                "predicted_tokens_per_round": st["tokens_per_round"],
            }
        )
    full_m, full_p = measured["full"]["tok_s_median"], pred_tps["full"]
    for m in modes:
        m["tok_s_rel_err"] = m["predicted_tok_s"] / m["measured_tok_s"] - 1
        m["measured_ratio"] = m["measured_tok_s"] / full_m
        m["predicted_ratio"] = m["predicted_tok_s"] / full_p
        m["ratio_rel_err"] = None if m["mode"] == "full" else m["predicted_ratio"] / m["measured_ratio"] - 1
    return {
        "name": case_name,
        "setting": f"link {a['link_bandwidth']}/s, X={X}, KV {'bf16' if kv_bytes == 2 else 'fp32'}, "
        f"budget {_bytes(a['device_kv_budget']) / 1e6:.1f} MB",
        "full_setting": (a["device_kv_budget"], kv_bytes),
        "modes": modes,
        "steps": step_times(case, cm, b, X, P, O),
    }


def step_times(case: dict, cm: CostModel, b: dict, X: int, P: int, O: int) -> list[dict]:
    """Timeline medians against the model at the same batch and mean length (P + O / 2)."""
    L = P + O // 2
    groups = max(1, case["args"]["staging_tokens"] // (L + X + 1))  # requests per verify group
    out = []

    def add(name: str, measured: list[float], w: Work) -> None:
        if measured:
            m, p = statistics.median(measured), cm.time(w).total_s
            row = {"step": name, "measured_ms": m * 1e3, "predicted_ms": p * 1e3, "rel_err": p / m - 1}
            if name.startswith("lock-step draft"):  # one of fit_on_bench's quantities
                row["fitted"] = True
            out.append(row)

    tl = case.get("timelines", {})
    lock = tl.get("vc-lockstep", {}).get("compute", [])
    stag = tl.get("vc-staggered", {}).get("compute", [])
    w = Work()
    for _ in range(b["lockstep"]):
        cm.draft_row(w, L, X / 2)
    add(f"lock-step draft (B={b['lockstep']})", [e - s for s, e, k in lock if k == "draft"], w)
    w = Work()
    for _ in range(min(groups, b["lockstep"])):
        cm.verify_row(w, L, X)
    add(
        f"lock-step verify ({min(groups, b['lockstep'])} requests, streamed)",
        [e - s for s, e, k in lock if k == "verify"],
        w,
    )
    w = Work()
    for _ in range(b["staggered"] - 1):
        cm.draft_row(w, L, X / 2)
    cm.verify_row(w, L, X)
    add(
        f"staggered mixed ({b['staggered'] - 1} draft + 1 verify)",
        [e - s for s, e, k in stag if k == "mixed"],
        w,
    )
    pre = [e - s for s, e, k in lock if k == "prefill"]
    if pre:  # the whole prefill (chunks of 2048 across requests): compare totals
        n = case["args"]["num_requests"]
        p = n * cm.time(Work(tokens=P, keys=P, qk=P * (P + 1) / 2, requests=1)).total_s
        out.append(
            {
                "step": f"lock-step prefill, total of {n} requests",
                "measured_ms": sum(pre) * 1e3,
                "predicted_ms": p * 1e3,
                "rel_err": p / sum(pre) - 1,
                "fitted": True,
            }
        )
    return out


def noise(cases: list[dict]) -> dict:
    """How much the bench's own full-mode numbers move: within a file's runs, and between files whose
    full mode is the same setting (same device budget and KV dtype; the link does not matter to it)."""
    by_setting: dict[tuple, list[float]] = {}
    spreads = []
    for c in cases:
        full = next(m for m in c["modes"] if m["mode"] == "full")
        by_setting.setdefault(c["full_setting"], []).append(full["measured_tok_s"])
        spreads += [m["measured_spread"] for m in c["modes"]]
    between = [max(v) / min(v) - 1 for v in by_setting.values() if len(v) > 1]
    return {"full_between_files": max(between) if between else None, "max_spread_within_file": max(spreads)}


def summarize(cases: list[dict]) -> dict:
    ratio = [abs(m["ratio_rel_err"]) for c in cases for m in c["modes"] if m["ratio_rel_err"] is not None]
    tps = [abs(m["tok_s_rel_err"]) for c in cases for m in c["modes"]]
    steps = [abs(s["rel_err"]) for c in cases for s in c["steps"]]
    vc = [m for c in cases for m in c["modes"] if m["mode"].startswith("vc-")]  # predicted, never fitted
    vc_steps = [abs(s["rel_err"]) for c in cases for s in c["steps"] if "fitted" not in s]
    return {
        **noise(cases),
        "vc_points": len(vc),
        "vc_ratio_mean_abs_rel_err": statistics.mean(abs(m["ratio_rel_err"]) for m in vc) if vc else None,
        "vc_ratio_max_abs_rel_err": max(abs(m["ratio_rel_err"]) for m in vc) if vc else None,
        "vc_tok_s_mean_abs_rel_err": statistics.mean(abs(m["tok_s_rel_err"]) for m in vc) if vc else None,
        "vc_tok_s_max_abs_rel_err": max(abs(m["tok_s_rel_err"]) for m in vc) if vc else None,
        "vc_step_mean_abs_rel_err": statistics.mean(vc_steps) if vc_steps else None,
        "vc_step_max_abs_rel_err": max(vc_steps) if vc_steps else None,
        "ratio_points": len(ratio),
        "ratio_mean_abs_rel_err": statistics.mean(ratio),
        "ratio_max_abs_rel_err": max(ratio),
        "tok_s_mean_abs_rel_err": statistics.mean(tps),
        "step_mean_abs_rel_err": statistics.mean(steps) if steps else 0.0,
        "step_max_abs_rel_err": max(steps) if steps else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    from common import machine
    from sglang_vericache.server_args import bundled_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-path", default=bundled_model_path(), help="The bundled model (bench_long_context's)."
    )
    p.add_argument(
        "--replay-only", action="store_true", help="Reuse the profile in --out; skip measuring and fitting."
    )
    p.add_argument(
        "--microbench",
        action="store_true",
        help="Also fit a profile to timed forwards of the bundled model (independent of the bench; "
        "sensitive to the machine's load) and report its errors.",
    )
    p.add_argument("--cases", nargs="+", default=list(CASES), help="results/<name>.json files to replay.")
    p.add_argument("--acceptance-json", type=Path, default=RESULTS / "acceptance.json", help="Round traces.")
    p.add_argument("--out", type=Path, default=RESULTS / "calibration_cpu.json", help="Output JSON.")
    args = p.parse_args(argv)

    traces, _ = pg.load_traces(args.acceptance_json, "snapkv", 4.0)
    acc = pg.Acceptance(by_x=traces)
    names = [c for c in args.cases if (RESULTS / f"{c}.json").exists()]
    if args.replay_only:
        old = json.loads(args.out.read_text())
        prof = GPU(**old["profile"])
        report = {
            k: old[k] for k in ("machine", "measured_at", "load_average", "measured", "fit") if k in old
        }
        if "microbench" in old:
            report["microbench"] = old["microbench"]
    else:
        load = os.getloadavg()
        meas = measure_machine()
        prof, fit = fit_on_bench(names, meas, acc, args.model_path)
        report = {
            "machine": machine(threads=False) + ", 1 thread",
            "measured_at": time.strftime("%Y-%m-%d %H:%M"),
            "load_average": f"{load[0]:.1f}",
            "measured": meas,
            "fit": fit,
        }
        if args.microbench:
            samples = [s for kv in ("float32", "bfloat16") for s in time_forwards(args.model_path, kv)]
            micro, mfit = fit_profile(samples, meas, args.model_path)
            mcases = [replay(c, micro, acc, args.model_path) for c in names]
            report["microbench"] = {
                "load_average": f"{os.getloadavg()[0]:.1f}",
                "profile": asdict(micro),
                "fit": mfit,
                "summary": summarize(mcases),
            }
    cases = [replay(c, prof, acc, args.model_path) for c in names]
    report.update({"profile": asdict(prof), "cases": cases, "summary": summarize(cases), "notes": NOTES})
    args.out.write_text(json.dumps(report, indent=2))
    for c in cases:
        for m in c["modes"]:
            print(
                f"{c['name']:28s} {m['mode']:13s} meas {m['measured_tok_s']:6.1f} pred {m['predicted_tok_s']:6.1f} "
                f"ratio meas {m['measured_ratio']:.2f} pred {m['predicted_ratio']:.2f}"
            )
        for st in c["steps"]:
            print(
                f"{'':28s} {st['step']:45s} meas {st['measured_ms']:8.1f} ms pred {st['predicted_ms']:8.1f} ms"
            )
    print(json.dumps(report["summary"], indent=1))
    if "microbench" in report:
        print("microbench profile:", json.dumps(report["microbench"]["summary"]))
    print(f"wrote {args.out}")


NOTES = [
    "Fitted: full and lossy runs' wall time, the lock-step draft step median and the prefill total of each "
    "setting (16 quantities, 5 unknowns). Predicted, not fitted: the VeriCache modes (lock-step, staggered) "
    "and their verify / mixed steps, where the link and the schedule come in.",
    "Prefill is modeled as one extend per request (plus a re-prefill of P + O/2 tokens per retraction the "
    "run reports); the compressors' scoring at prefill is not modeled.",
    "bench_long_context's tokens/s include prefill, so the predictions do too.",
    "Per request row and per drafting forward fit to 0: each mode's batch is nearly fixed in these runs, so "
    "those costs are not separable from the per-forward one here (the microbenchmark profile separates them).",
    "Acceptance comes from acceptance.json's traces (other prompts), not from the runs: their tokens per round "
    "(last column) are 4-6% below the runs', which lowers the predicted VeriCache rates by about as much.",
]


if __name__ == "__main__":
    main()
