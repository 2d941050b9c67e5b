"""Long-context decoding under an accelerator KV budget, every mode in one run.

    .venv/bin/python benchmark/bench_long_context.py             # defaults: 16 x (1600 in, 256 out)
    .venv/bin/python benchmark/bench_long_context.py --sweep     # budgets x links, full / vc-staggered / vc-auto,
                                                                 # 16 x (1600 in, 96 out), medians of 3

N requests with long code prompts and long outputs; an accelerator KV budget that holds only a
few requests' exact KV; a host<->accelerator link of a given bandwidth. Modes:
  full            exact KV in the accelerator pool (the budget caps how many requests run)
  full-offload    exact KV in host memory, streamed over the link at every step (naive offload)
  lossy           compressed KV only, in the accelerator budget (quality baseline)
  vc-lockstep     VeriCache, everyone drafts then everyone verifies (exact KV streamed)
  vc-staggered    VeriCache, verifications booked against the link so they overlap drafting
  vc-auto         VeriCache as served by default (--vericache-schedule adaptive): exact KV resident
                  while the device budget holds it, decode or rounds per request from measured costs
  vc-auto-host    vc-auto with --exact-kv-pool host: the exact pool in host memory, forwards reading it
                  through an accelerator page cache of the device budget's exact KV (on a CPU: the
                  emulation's copies, same memory)
Reports output tokens/s (median of --repeats), the ratio to full, output identity with full,
mean tokens per round, link and compute busy fractions; writes JSON, a Markdown table, and a
timeline plot of link and compute activity for lock-step against staggered.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from tqdm import tqdm

from common import RESULTS, heldout_files, machine, time_forwards, write_results
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.server_args import ServerArgs, bundled_model_path, parse_bytes
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion


OUTPUT_LEN = 256
SWEEP_OUTPUT_LEN = 96
SWEEP_MODES = ("full", "vc-staggered", "vc-auto")


def long_prompts(tok, model_path: str, n: int, length: int) -> list[list[int]]:
    """n disjoint windows of `length` tokens from the concatenated held-out stdlib files."""
    ids: list[int] = []
    for path in heldout_files(model_path):
        ids += tok(path.read_text(errors="replace")).input_ids
        if len(ids) >= n * length:
            break
    if len(ids) < n * length:
        raise SystemExit(f"held-out files give {len(ids)} tokens, fewer than {n} x {length}")
    return [ids[i * length : (i + 1) * length] for i in range(n)]


def modes(args) -> dict[str, dict]:
    vc = dict(kv_compressor=args.compressor, kv_compression_ratio=args.ratio, speculative_algorithm="VERICACHE",
              speculative_num_draft_tokens=str(args.draft_tokens), link_bandwidth=args.link_bandwidth)
    host = dict(host_kv_budget=args.host_kv_budget)
    return {
        "full": {},
        "full-offload": dict(kv_offload=True, link_bandwidth=args.link_bandwidth, **host),
        "lossy": dict(kv_compressor=args.compressor, kv_compression_ratio=args.ratio, **host),
        "vc-lockstep": dict(vericache_schedule="lockstep", **vc, **host),
        "vc-staggered": dict(vericache_schedule="staggered", **vc, **host),
        "vc-auto": dict(vericache_schedule="adaptive", **vc, **host),
        "vc-auto-host": dict(vericache_schedule="adaptive", exact_kv_pool="host", **vc, **host),
    }


def run_mode(args, prompts, server: dict):
    sched = Scheduler(ServerArgs(
        model_path=args.model_path, skip_tokenizer_init=True, page_size=args.page_size,
        device_kv_budget=args.device_kv_budget, max_running_requests=len(prompts),
        verify_staging_tokens=args.staging_tokens, chunked_prefill_size=args.chunked_prefill_size,
        num_threads=args.threads, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
        cpu_half_gemm=args.cpu_half_gemm, enable_deterministic_inference=True, **server))  # the reference output: deterministic full mode
    reqs = [make_request(f"r{i}", p, max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts)]
    sched.timeline = []
    if sched.link is not None:
        sched.link.reset_stats()
    forward_s = time_forwards(sched.model_runner)  # the scheduler's forwards, by mode
    t0 = time.perf_counter()
    res = run_to_completion(sched, reqs)
    wall = time.perf_counter() - t0
    outputs = [res[f"r{i}"].output_ids for i in range(len(prompts))]
    stalls = sched.link.stager.stalls if sched.link is not None else []
    # Compute is busy during forwards, less the time they wait on the link for a layer.
    compute = sum(b - a for a, b, _ in sched.timeline) - sum(b - a for a, b in stalls)
    stalls = list(stalls)
    link = sched.link.engine if sched.link is not None else None
    m = sched.metrics
    timeline = sched.timeline
    if sched.link is not None:
        sched.link.engine.shutdown()
    del sched, res  # free this mode's pools before the next mode builds its own
    gc.collect()
    return {
        "tok_s": sum(len(o) for o in outputs) / wall,
        "wall_s": wall,
        "outputs": outputs,
        "compute_busy": compute / wall,
        "link_busy": (link.busy_seconds / wall) if link else 0.0,
        "link_bytes": link.bytes_total if link else 0,
        "tokens_per_round": (m.spec_accepted_total + m.spec_rounds_total) / m.spec_rounds_total
        if m.spec_rounds_total else None,
        "timeline": [(a - t0, b - t0, tag) for a, b, tag in timeline],
        "link_intervals": [(a - t0, b - t0) for a, b, *_ in (link.busy_intervals if link else [])],
        "stall_intervals": [(a - t0, b - t0) for a, b in stalls],
        "retracted": m.num_retracted_total,
        "draft_forward_s": statistics.mean(forward_s["DRAFT_DECODE"]) if forward_s.get("DRAFT_DECODE") else None,
        "decode_forward_s": statistics.mean(forward_s["DECODE"]) if forward_s.get("DECODE") else None,
    }


def plot_timeline(runs: dict[str, dict], path, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("vc-lockstep", "vc-staggered") if n in runs]
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 1.8 * len(names) + 0.6), sharex=True)
    axes = [axes] if len(names) == 1 else axes
    for ax, name in zip(axes, names):
        r = runs[name]
        t0 = next((a for a, _, tag in r["timeline"] if tag != "prefill"), 0.0)  # decoding starts
        comp = [(a - t0, b - a) for a, b, _ in r["timeline"] if t0 <= a < t0 + seconds]
        link = [(a - t0, b - a) for a, b in r["link_intervals"] if t0 <= a < t0 + seconds]
        stall = [(a - t0, b - a) for a, b in r["stall_intervals"] if t0 <= a < t0 + seconds]
        ax.broken_barh(comp, (10, 8), facecolors="tab:blue")
        ax.broken_barh(stall, (10, 8), facecolors="white")  # forwards waiting on the link
        ax.broken_barh(link, (0, 8), facecolors="tab:orange")
        ax.set_yticks([4, 14], ["link", "compute"])
        ax.set_title(f"{name}: link busy {r['link_busy']:.0%}, compute busy {r['compute_busy']:.0%}", fontsize=9)
    axes[-1].set_xlabel("seconds since decoding began")
    axes[-1].set_xlim(0, seconds)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--num-requests", type=int, default=16, help="Requests, all submitted at once.")
    p.add_argument("--input-len", type=int, default=1600, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"New tokens per request (default {OUTPUT_LEN}; with --sweep {SWEEP_OUTPUT_LEN}, so its "
                        "medians of 3 fit in ~25 minutes on a quiet 2-core machine).")
    p.add_argument("--device-kv-budget", default=None,
                   help="Accelerator KV memory (default: exact KV of --full-fits requests).")
    p.add_argument("--full-fits", type=float, default=3.0,
                   help="How many requests' exact KV the default device budget holds.")
    p.add_argument("--host-kv-budget", default=None,
                   help="Host memory for the exact tier (default: 1.5x the workload's exact KV).")
    p.add_argument("--link-bandwidth", default="1GB", help="Host->accelerator link, bytes/s.")
    p.add_argument("--compressor", default="snapkv", help="KV compressor for lossy and VeriCache.")
    p.add_argument("--ratio", type=float, default=4.0, help="Compression ratio.")
    p.add_argument("--draft-tokens", type=int, default=16, help="VeriCache draft tokens per round.")
    p.add_argument("--staging-tokens", type=int, default=4096, help="Verification staging rows per layer.")
    p.add_argument("--page-size", type=int, default=32, help="KV page = compression chunk, tokens.")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="Prefill chunk, tokens.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="Compute and KV dtype (auto = the checkpoint's). Every mode runs deterministic inference "
                        "(--enable-deterministic-inference, the two-tier modes' default), so VeriCache's output "
                        "equals full mode's bitwise in every dtype; the table checks it.")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="Exact KV storage dtype (auto = --dtype); e.g. float32 compute over bfloat16 KV halves "
                        "the bytes each verification moves over the link.")
    p.add_argument("--cpu-half-gemm", default="auto", choices=("auto", "native", "float32"),
                   help="--cpu-half-gemm of every mode: bfloat16 / float16 products native or through float32.")
    p.add_argument("--repeats", type=int, default=3, help="Runs of every mode; medians are reported.")
    p.add_argument("--modes", nargs="+", default=None,
                   help="Subset of modes to run (default: all but vc-auto-host).")
    p.add_argument("--sweep", action="store_true",
                   help="Device budgets holding 1, 3, 6 and all requests' exact KV x links 200MB and 1GB, modes "
                        "full (once per budget: it does not use the link), vc-staggered and vc-auto, in one run "
                        "-> results/long_context_sweep.{json,md}.")
    args = p.parse_args()
    if args.output_len is None:
        args.output_len = SWEEP_OUTPUT_LEN if args.sweep else OUTPUT_LEN

    tok = get_tokenizer(args.model_path)
    prompts = long_prompts(tok, args.model_path, args.num_requests, args.input_len)
    mc = ModelConfig.from_path(args.model_path)
    dtype = mc.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    if args.kv_cache_dtype != "auto":
        dtype = getattr(torch, args.kv_cache_dtype)  # budgets are in KV bytes
    per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * torch.empty(
        (), dtype=dtype).element_size()
    if args.host_kv_budget is None:
        args.host_kv_budget = str(int(1.5 * args.num_requests * (args.input_len + args.output_len + args.page_size)
                                      * per_token))
    # One request's exact KV in whole pages, plus a page of growth; a budget of k requests is k of these plus
    # the page the pool keeps spare (so k = 1 runs one request to its end).
    ps = args.page_size
    request_bytes = ((args.input_len + args.output_len + ps - 1) // ps + 1) * ps * per_token
    spare_bytes = ps * per_token
    if args.sweep:
        sweep(args, prompts, request_bytes, spare_bytes)
        return
    if args.device_kv_budget is None:
        args.device_kv_budget = str(int(args.full_fits * request_bytes + spare_bytes))
    all_modes = modes(args)
    default = [k for k in all_modes if k != "vc-auto-host"]  # the emulated host pool: on request
    chosen = {k: v for k, v in all_modes.items() if k in (args.modes or default)}
    runs, rows = measure(args, prompts, chosen)
    header = (
        f"Long-context decoding: {args.num_requests} requests x ({args.input_len} prompt + {args.output_len} new "
        f"tokens), {args.model_path}\n"
        f"device KV budget {parse_bytes(args.device_kv_budget) / 1e6:.1f} MB (exact KV of {args.full_fits:g} "
        f"requests), link {args.link_bandwidth}/s, {args.compressor} at {args.ratio:g}x, X={args.draft_tokens}, "
        f"staging {args.staging_tokens} rows, dtype {args.dtype}, KV dtype {args.kv_cache_dtype}; median of {args.repeats}; machine: {machine()}\n"
    )
    lines = [header, "`draft step / full step`: a VeriCache mode's mean DRAFT_DECODE forward (the scheduler's own "
             "forwards, timed) over full mode's mean DECODE forward; median over repeats. Not at the same batch: "
             "a VeriCache mode drafts for every running request (up to all of them) where full mode decodes the "
             "requests its budget holds; at the same batch and context see bench_draft_attention.py "
             "(results/draft_attention*.md).\n",
             "| mode | output tok/s | vs full | output = full | tokens/round | link busy | compute busy "
             "| draft step / full step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_full"]]
        ratio = "-" if r["ratio_to_full"] is None else f"{r['ratio_to_full']:.2f}x"
        step = "-" if r.get("draft_step_vs_full_step") is None else f"{r['draft_step_vs_full_step']:.2f}x"
        lines.append(f"| {r['mode']} | {r['tok_s_median']:.1f} | {ratio} | {same} | {tpr} | "
                     f"{r['link_busy']:.0%} | {r['compute_busy']:.0%} | {step} |")
    report = {"args": vars(args), "machine": machine(), "rows": rows,
              "timelines": {k: {"compute": rs[-1]["timeline"], "link": rs[-1]["link_intervals"]}
                            for k, rs in runs.items() if k.startswith("vc-")}}
    write_results("long_context", report, "\n".join(lines))
    if "vc-lockstep" in runs or "vc-staggered" in runs:
        span = min(r[-1]["wall_s"] for k, r in runs.items() if k.startswith("vc-"))
        plot_timeline({k: rs[-1] for k, rs in runs.items()}, RESULTS / "long_context_timeline.png", min(span, 3.0))
        print(f"wrote {RESULTS / 'long_context_timeline.png'}")


def sweep(args, prompts, request_bytes: float, spare_bytes: float) -> None:
    """Every (budget, link) point: full, vc-staggered, vc-auto; vc-auto against the best of the others.
    Full mode never touches the link: it runs once per budget, interleaved with the first link's runs
    (so this machine's drift between repeats falls on every mode alike), and stands for both links."""
    points, lines = [], []
    t0 = time.perf_counter()
    for fits in (1, 3, 6, args.num_requests):
        args.device_kv_budget, args.full_fits = str(int(fits * request_bytes + spare_bytes)), fits
        full_runs = None
        for link in ("200MB", "1GB"):
            args.link_bandwidth = link
            chosen = {k: v for k, v in modes(args).items() if k in SWEEP_MODES and (k != "full" or full_runs is None)}
            runs, rows = measure(args, prompts, chosen, full_runs=full_runs)
            full_runs = runs["full"]
            by = {r["mode"]: r for r in rows}
            best = max(by["full"]["tok_s_median"], by["vc-staggered"]["tok_s_median"])
            points.append({"full_fits": fits, "link": link, "device_kv_budget": args.device_kv_budget,
                           "rows": rows, "auto_vs_best": by["vc-auto"]["tok_s_median"] / best})
    minutes = (time.perf_counter() - t0) / 60
    lines.append(f"Long-context sweep: {args.num_requests} requests x ({args.input_len} prompt + {args.output_len} new "
                 f"tokens), {args.compressor} at {args.ratio:g}x, X={args.draft_tokens}, dtype {args.dtype}, "
                 f"deterministic inference; median of {args.repeats}; full mode once per budget (it does not use "
                 f"the link), interleaved with the 200MB/s runs; {minutes:.1f} minutes in all; machine: {machine()}\n")
    lines += ["| device budget (requests' exact KV) | link | full tok/s | vc-staggered vs full | vc-auto vs full | "
              "vc-auto vs best | output = full |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for pt in points:
        by = {r["mode"]: r for r in pt["rows"]}
        same = all(r["identical_to_full"] for r in pt["rows"])
        lines.append(f"| {pt['full_fits']} | {pt['link']}/s | {by['full']['tok_s_median']:.1f} | "
                     f"{by['vc-staggered']['ratio_to_full']:.2f}x | {by['vc-auto']['ratio_to_full']:.2f}x | "
                     f"{pt['auto_vs_best']:.2f}x | {'yes' if same else 'NO'} |")
    write_results("long_context_sweep", {"args": vars(args), "machine": machine(), "minutes": minutes,
                                         "points": points}, "\n".join(lines))


def measure(args, prompts, chosen: dict[str, dict], full_runs: list[dict] | None = None) -> tuple[dict, list[dict]]:
    """Runs each chosen mode --repeats times (interleaved) -> (runs, rows with medians and ratios).
    full_runs: full mode's runs measured already (the sweep's, once per budget), reported and compared
    against as if run here."""
    runs: dict[str, list[dict]] = {k: [] for k in chosen}
    for rep in range(args.repeats):
        for name, server in tqdm(chosen.items(), desc=f"repeat {rep + 1}/{args.repeats}"):
            runs[name].append(run_mode(args, prompts, server))
    if full_runs is not None:
        runs = {"full": full_runs, **runs}
    full_out = runs["full"][0]["outputs"] if "full" in runs else None
    med = {name: statistics.median(r["tok_s"] for r in rs) for name, rs in runs.items()}
    full_step = statistics.median(r["decode_forward_s"] for r in runs["full"]) if "full" in runs else None
    rows = []
    for name, rs in runs.items():
        last = rs[-1]
        drafts = [r["draft_forward_s"] for r in rs if r["draft_forward_s"] is not None]
        rows.append({
            "mode": name,
            "tok_s_median": med[name],
            "tok_s_runs": [r["tok_s"] for r in rs],
            "ratio_to_full": med[name] / med["full"] if "full" in med else None,
            "identical_to_full": None if full_out is None else all(r["outputs"] == full_out for r in rs),
            "tokens_per_round": last["tokens_per_round"],
            "link_busy": statistics.median(r["link_busy"] for r in rs),
            "compute_busy": statistics.median(r["compute_busy"] for r in rs),
            "link_bytes": last["link_bytes"],
            "retracted": last["retracted"],
            # a draft forward (every drafting request, one token) over full mode's decode forward, means per run
            "draft_step_vs_full_step": statistics.median(drafts) / full_step if drafts and full_step else None,
        })
    return runs, rows


if __name__ == "__main__":
    main()
