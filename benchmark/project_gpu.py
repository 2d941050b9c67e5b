"""PROJECTION (not a measurement): VeriCache on an H200, an RTX PRO 6000 and an H100 NVL pair, from a
cost model (gpu_cost_model.py: the formulas, the hardware figures and the adaptive rule; gpu_sim.py: the
simulator; report_gpu.py: the Markdown and plot).

    .venv/bin/python benchmark/project_gpu.py                    # every hardware x model x context
    .venv/bin/python benchmark/project_gpu.py --hardware h200 --models qwen2.5-32b --contexts 32768

Policies, each replayed over simulated requests in discrete iterations whose times come from the
cost model instead of a wall clock:
  full       exact KV in device memory, one token per request per step; batch = what the memory holds
  staggered  today's policy: every request's exact KV on the host, streamed at each verification;
             speculative/stagger.py's step() with the same `VerifyReservations` rings; X fixed
  lockstep   (optional) everyone drafts X, then verify groups that fit the staging area
  adaptive   the controller's policy (gpu_cost_model.Policy): exact KV resident while the device holds
             it, the overflow on the host tier only while it adds throughput; per request and round,
             decode or a round of x in {4, 8, 16, 30}, whichever raises the batch's predicted
             tokens/s; the simulator runs the rule round by round (it does not assume its result)
Acceptance per round is sampled (seeded) from round traces measured on the bundled model
(bench_acceptance.py): a trace round (d drafted, a accepted) gives a simulated round of x drafts
floor(a * x / d) accepted (the trace with d nearest x; a fully accepted round stays fully accepted);
a round emits accepted + 1 tokens. Without traces: a stated constant rate, floor(rate * x).
Prefill is excluded (decode throughput only); all requests have P prompt and O output tokens;
N = waves * (the policy's batch) requests, admitted as others finish. Per device of a TP group.
The CPU calibration (benchmark/calibrate_cpu.py -> results/calibration_cpu.json) is reported beside.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_cost_model import (  # noqa: F401  (re-exported for the tests and the calibration)
    DRAFT_LENGTHS,
    GPU,
    H100_NVL,
    H200,
    HARDWARE,
    LLAMA3_70B,
    MISTRAL_SMALL_24B,
    QWEN25_32B,
    RTX_PRO_6000,
    SHAPES,
    Batch,
    CostModel,
    ModelShape,
    Option,
    Policy,
    StepTime,
    Work,
)
from gpu_sim import Acceptance, SimReq, Simulator, Stats, load_trace, load_traces  # noqa: F401
from report_gpu import LABEL, PAPER_HARDWARE, PAPER_MAX, PAPER_SPEEDUP, markdown, plot

RESULTS = Path(__file__).parent / "results"
# Tensor-parallel degree per (hardware, model): what holds the weights with room for KV.
TP = {
    ("h200", "llama3-70b"): 4,
    ("rtx-pro-6000", "llama3-70b"): 2,
    ("h100-nvl", "mistral-24b"): 2,
    ("h100-nvl", "qwen2.5-32b"): 2,
    ("h100-nvl", "llama3-70b"): 2,
}


# ---------------------------------------------------------------- one configuration


def project(
    shape: ModelShape,
    gpu: GPU,
    context: int,
    output: int,
    ratio: float,
    max_draft: int,
    acceptance: Acceptance,
    staging_bytes: float = 2e9,
    waves: int = 4,
    seed: int = 0,
    policies: tuple[str, ...] = ("full", "lockstep", "staggered"),
    progress: bool = False,
    draft_lengths: tuple[int, ...] = DRAFT_LENGTHS,
) -> dict:
    """One (hardware, model, context, link): every policy's run; speedups are tokens/s over full."""
    cm = CostModel(shape, gpu, ratio)
    max_len = context + output
    # Staging rows S: what staging_bytes holds (2 layers per row), at least one whole request.
    staging = max(max_len, math.floor(staging_bytes / cm.staging_bytes(1)))
    sim = Simulator(cm, context, output, max_draft, staging, acceptance, seed, progress)
    b_full = cm.full_max_batch(max_len)
    b_vc = cm.vc_max_batch(max_len, max_draft, staging)
    row = {
        "hardware": gpu.name,
        "shape": shape.name,
        "tp": shape.tp,
        "context": context,
        "output": output,
        "ratio": ratio,
        "draft_tokens": max_draft,
        "link_gbps": gpu.link_bw / 1e9,
        "staging_tokens": staging,
        "max_batch_full": b_full,
        "max_batch_vc": b_vc,
    }
    runs = {}
    if "full" in policies and b_full > 0:
        runs["full"] = sim.run_full(b_full, waves * b_full).summary()
    if "lockstep" in policies and b_vc > 0:
        runs["lockstep"] = sim.run_lockstep(b_vc, waves * b_vc).summary()
    if "staggered" in policies and b_vc > 0:
        runs["staggered"] = sim.run_staggered(b_vc, waves * b_vc).summary()
    if "adaptive" in policies:
        policy = Policy(cm, acceptance.expected, draft_lengths)
        plan = policy.plan(context, output, cm.host_max_batch(max_len), staging)
        row["adaptive_plan"] = plan
        if plan is not None:
            runs["adaptive"] = sim.run_adaptive(
                policy, plan, waves * (plan["residents"] + plan["host"])
            ).summary()
    row["modes"] = runs
    full = runs.get("full", {}).get("tokens_per_s")
    for mode in ("lockstep", "staggered", "adaptive"):
        tps = runs.get(mode, {}).get("tokens_per_s")
        row[f"speedup_{mode}"] = tps / full if full and tps else None
    # Whatever the schedule: each round moves the whole committed exact KV over the link once.
    per_round = runs.get("staggered", {}).get("tokens_per_round")
    mean_kv = (context + output / 2) * cm.kv
    row["link_ceiling_tps"] = per_round * gpu.link_bw / mean_kv if per_round else None
    return row


def policy_rows(row: dict) -> list[dict]:
    """The flat rows of results/project_gpu.json: one per policy of a configuration."""
    out = []
    full = row["modes"].get("full", {}).get("tokens_per_s")
    for policy, m in row["modes"].items():
        r = {
            "hardware": row["hardware"],
            "model": row["shape"],
            "tp": row["tp"],
            "context": row["context"],
            "output": row["output"],
            "link_gbps": row["link_gbps"],
            "compression_ratio": row["ratio"],
            "policy": policy,
            "acceptance": row.get("acceptance_model", "measured traces"),
            "tokens_per_s": m["tokens_per_s"],
            "ratio_to_full": m["tokens_per_s"] / full if full else None,
            "full_fits": row["max_batch_full"] > 0,
            "tokens_per_round": m["tokens_per_round"],
            "link_util": m["link_util"],
            "hbm_util": m["hbm_util"],
        }
        if policy == "full":
            r["batch"] = row["max_batch_full"]
        elif policy in ("staggered", "lockstep"):
            r["batch"], r["draft_tokens"] = row["max_batch_vc"], row["draft_tokens"]
        else:
            plan = row["adaptive_plan"]
            r["batch"] = plan["residents"] + plan["host"]
            r["plan"] = plan
            r["decode_steps"] = m.get("decode_steps", 0)
            r["rounds_by_tier_x"] = m.get("rounds_by_tier_x", {})
            r["chosen_x"] = _chosen_x(m.get("rounds_by_tier_x", {}))
        if row["hardware"] in PAPER_HARDWARE:
            r["paper_speedup"], r["paper_max"] = list(PAPER_SPEEDUP), PAPER_MAX
        out.append(r)
    return out


def _chosen_x(counts: dict) -> str:
    """The most frequent draft length per tier, e.g. 'host 30, resident 8' ('-' if no rounds)."""
    best: dict[str, tuple[int, int]] = {}
    for key, n in counts.items():
        tier, x = key.split(" x=")
        if n > best.get(tier, (0, 0))[0]:
            best[tier] = (n, int(x))
    return ", ".join(f"{t} {x}" for t, (_, x) in sorted(best.items())) or "-"


# ---------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--hardware",
        nargs="+",
        default=list(HARDWARE),
        choices=list(HARDWARE),
        help="Hardware profiles (gpu_cost_model.HARDWARE).",
    )
    p.add_argument(
        "--models",
        "--shapes",
        dest="models",
        nargs="+",
        default=list(SHAPES),
        choices=list(SHAPES),
        help="Model shapes (gpu_cost_model.SHAPES).",
    )
    p.add_argument(
        "--tp",
        nargs="+",
        default=[],
        metavar="HW:MODEL=N",
        help="Override a tensor-parallel degree, e.g. h200:llama3-70b=8 (defaults: project_gpu.TP).",
    )
    p.add_argument(
        "--policies",
        nargs="+",
        default=["full", "staggered", "adaptive"],
        choices=["full", "lockstep", "staggered", "adaptive"],
        help="Policies to replay.",
    )
    p.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072], help="Prompt tokens P.")
    p.add_argument("--output-tokens", type=int, default=1024, help="Output tokens O per request.")
    p.add_argument("--ratio", type=float, default=4.0, help="KV compression ratio R.")
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=30,
        help="Draft length X of the staggered and lock-step policies (fixed, as in the paper).",
    )
    p.add_argument(
        "--draft-lengths",
        type=int,
        nargs="+",
        default=list(DRAFT_LENGTHS),
        help="Draft lengths the adaptive policy chooses from, per request and round.",
    )
    p.add_argument(
        "--link-gbps",
        type=float,
        nargs="+",
        default=[55.0],
        help="Host->device link, GB/s per device: 55 = PCIe Gen5 x16 effective.",
    )
    p.add_argument(
        "--h200-sensitivity-gbps",
        type=float,
        nargs="*",
        default=[450.0],
        help="Extra H200 rows at these link speeds (450 = a Grace-Hopper-class NVLink-C2C link; "
        "a sensitivity, not an H200 with PCIe).",
    )
    p.add_argument("--host-gb", type=float, default=256.0, help="Host memory for exact KV, GB per device.")
    p.add_argument(
        "--staging-gb",
        type=float,
        default=2.0,
        help="Device memory for the double-buffered verify staging area, GB per device (rows S = "
        "what it holds at 2 layers per row, at least one request's P + O).",
    )
    p.add_argument("--waves", type=int, default=4, help="Requests per policy = waves x that policy's batch.")
    p.add_argument(
        "--acceptance-json",
        "--acceptance",
        type=Path,
        default=RESULTS / "acceptance.json",
        help="bench_acceptance.py output with round_trace rows (fallback rate if missing); rows of one draft "
        "length (several contexts or prompt kinds) are pooled.",
    )
    p.add_argument("--compressor", default="snapkv", help="Which acceptance.json compressor's traces to use.")
    p.add_argument(
        "--fallback-accept-rate",
        type=float,
        default=0.8,
        help="Constant acceptance rate when no trace file exists (labeled in every output).",
    )
    p.add_argument(
        "--calibration-json",
        type=Path,
        default=RESULTS / "calibration_cpu.json",
        help="benchmark/calibrate_cpu.py output, reported beside the projection if present.",
    )
    p.add_argument(
        "--sensitivity-accept-rate",
        type=float,
        default=0.9,
        help="Extra rows on the paper's hardware with this constant acceptance rate (0.9: 28 tokens per round "
        "at x=30, inside the paper's reported 25-40); a sensitivity, labelled so. Pass -1 to skip.",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed of the trace sampling.")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="Re-render STEM.md / STEM.png from STEM.json (no simulation).",
    )
    p.add_argument("--out", default="project_gpu", help="Output stem: writes STEM.json, STEM.md, STEM.png.")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help="Folder for the outputs.")
    return p


def configs(args) -> list[tuple[str, str, int, float]]:
    out = []
    for hw in args.hardware:
        links = list(args.link_gbps) + (list(args.h200_sensitivity_gbps) if hw == "h200" else [])
        out += [(hw, m, c, link) for m in args.models for link in links for c in args.contexts]
    return out


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path(__file__).resolve().parents[1]))
    except ValueError:
        return str(path)


def traces_model_of(path: Path) -> str:
    """Which model the acceptance traces come from, in words (the bench_acceptance.py file's model_path)."""
    model = json.loads(Path(path).read_text()).get("model_path")
    if model is None or Path(model).name == "vericache-code-tiny":
        return "the bundled 8-layer model"
    return Path(model).name


def report_only(args) -> None:
    """Re-render STEM.md and STEM.png from STEM.json (and the calibration file), no simulation."""
    out = args.results_dir / args.out
    data = json.loads(out.with_suffix(".json").read_text())
    meta = {k: v for k, v in data.items() if k not in ("rows", "configs")}
    calibration = json.loads(args.calibration_json.read_text()) if args.calibration_json.exists() else None
    out.with_suffix(".md").write_text(markdown(data["configs"], meta, calibration) + "\n")
    plot(data["configs"], out.with_suffix(".png"), f"acceptance: {meta['acceptance_source']}")
    print(f"wrote {out}.md, .png from {out}.json")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.report_only:
        return report_only(args)
    tp = dict(TP)
    for spec in args.tp:
        key, n = spec.split("=")
        tp[tuple(key.split(":"))] = int(n)
    have_trace = args.acceptance_json.exists()
    if have_trace:
        traces, tmeta = load_traces(args.acceptance_json, args.compressor, args.ratio)
        acc = Acceptance(by_x=traces)
        source = (
            f"round traces from {_rel(args.acceptance_json)} ({args.compressor}, draft lengths "
            f"{sorted(traces)}), the nearest length's rate mapped onto x"
        )
        traces_model = traces_model_of(args.acceptance_json)
    else:
        print(
            f"WARNING: {args.acceptance_json} not found; using a CONSTANT acceptance rate of "
            f"{args.fallback_accept_rate:.0%} (fallback, not measured)",
            file=sys.stderr,
        )
        acc, tmeta = Acceptance(rate=args.fallback_accept_rate), {"fallback_rate": args.fallback_accept_rate}
        source = f"FALLBACK constant acceptance rate {args.fallback_accept_rate:.0%} (no trace file)"
        traces_model = None
    runs = [(cfg, acc, "measured traces") for cfg in configs(args)]
    if args.sensitivity_accept_rate >= 0:  # the paper's acceptance on the paper's hardware
        sens = Acceptance(rate=args.sensitivity_accept_rate)
        label = f"constant {args.sensitivity_accept_rate:.0%} (sensitivity)"
        runs += [(cfg, sens, label) for cfg in configs(args) if HARDWARE[cfg[0]].name in PAPER_HARDWARE]
    rows = []
    for (hw, m, c, link), a, label in tqdm(runs, desc="projections"):
        gpu = GPU(**{**asdict(HARDWARE[hw]), "link_bw": link * 1e9, "host_bytes": args.host_gb * 1e9})
        shape = SHAPES[m].with_tp(tp.get((hw, m), 1))
        row = project(
            shape,
            gpu,
            c,
            args.output_tokens,
            args.ratio,
            args.draft_tokens,
            a,
            args.staging_gb * 1e9,
            args.waves,
            args.seed,
            tuple(args.policies),
            progress=True,
            draft_lengths=tuple(args.draft_lengths),
        )
        row["acceptance_model"] = label
        rows.append(row)
    calibration = json.loads(args.calibration_json.read_text()) if args.calibration_json.exists() else None
    meta = {
        "label": LABEL,
        "acceptance_source": source,
        "traces_model": traces_model,
        "acceptance": tmeta,
        "expected_tokens_per_round": {x: 1 + acc.expected(x) for x in args.draft_lengths},
        "paper_speedup": PAPER_SPEEDUP,
        "paper_max": PAPER_MAX,
        "paper_hardware": PAPER_HARDWARE,
        "hardware": {k: asdict(v) for k, v in HARDWARE.items() if k in args.hardware},
        "args": {k: str(v) for k, v in vars(args).items()},
        "shapes": {
            k: {**asdict(v), "params": v.params, "kv_bytes_per_token_tp1": v.with_tp(1).kv_bytes_per_token}
            for k, v in SHAPES.items()
            if k in args.models
        },
    }
    out = args.results_dir / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    flat = [r for row in rows for r in policy_rows(row)]
    table = markdown(rows, meta, calibration)
    root = str(Path(__file__).resolve().parents[1]) + "/"  # a result names no machine's folders
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": flat, "configs": rows}, indent=2).replace(root, ""))
    out.with_suffix(".md").write_text(table.replace(root, "") + "\n")
    plot(rows, out.with_suffix(".png"), f"acceptance: {source}")
    print(table)
    print(f"\nwrote {out}.json, .md, .png  -- {LABEL}")


if __name__ == "__main__":
    main()
