"""What --cpu-half-gemm float32 buys on this CPU: the bundled model's linear shapes at several row
counts (torch's bfloat16 GEMM against float32 products rounded to bfloat16), and full mode's
prefill and decode tokens/s with each, in one run, medians of --repeats (interleaved).

    PYTHONPATH=python:sgl-kernel-ext/python .venv/bin/python benchmark/bench_half_gemm.py   # ~3 min on 2 cores

Results: benchmark/results/half_gemm.{json,md}. On a loaded machine the figures are ratios only.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from common import machine, run_mode, write_results
from sglang_vericache.layers.half_gemm import cpu_has_native
from sglang_vericache.server_args import bundled_model_path

SHAPES = ((512, 256), (256, 256), (1536, 256), (256, 768), (6144, 256))  # (out, in): qkv, o, gate_up, down, lm_head
ROWS = (1, 3, 16, 64, 512)


def time_call(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def gemm_rows(repeats: int) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for m in tqdm(ROWS, desc="GEMM row counts"):
        native, f32 = [], []
        for _ in range(repeats):
            n_s = f_s = 0.0
            for out, inp in SHAPES:
                x = torch.randn(m, inp, generator=g).bfloat16()
                w = torch.randn(out, inp, generator=g).bfloat16()
                w32 = w.float()
                reps = max(3, 4096 // m)
                n_s += time_call(lambda: F.linear(x, w), reps)
                f_s += time_call(lambda: F.linear(x.float(), w32).bfloat16(), reps)
            native.append(n_s)
            f32.append(f_s)
        n, f = statistics.median(native), statistics.median(f32)
        rows.append({"rows": m, "native_us": n * 1e6, "float32_us": f * 1e6, "speedup": n / f})
    return rows


def model_rows(args) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (args.input_len,), generator=g).tolist() for _ in range(args.num_requests)]
    runs = {p: {"prefill": [], "decode": []} for p in ("native", "float32")}
    outs = {}
    for _ in tqdm(range(args.repeats), desc="full mode, native / float32"):
        for policy in runs:
            for phase, new in (("prefill", 1), ("decode", args.output_len)):
                r = run_mode(args.model_path, prompts, new, cpu_half_gemm=policy, dtype="bfloat16",
                             enable_deterministic_inference=True, num_threads=args.threads)
                toks = len(prompts) * args.input_len if phase == "prefill" else sum(len(o) for o in r.outputs)
                runs[policy][phase].append(toks / r.seconds)
                outs[policy] = r.outputs
    rows = []
    for phase in ("prefill", "decode"):
        n, f = (statistics.median(runs[p][phase]) for p in ("native", "float32"))
        rows.append({"phase": phase, "native_tok_s": n, "float32_tok_s": f, "speedup": f / n,
                     "runs": {p: runs[p][phase] for p in runs}})
    return rows, outs["native"] == outs["float32"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--num-requests", type=int, default=4, help="Requests of the end-to-end runs.")
    p.add_argument("--input-len", type=int, default=1024, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=64, help="New tokens per request in the decode runs.")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's).")
    p.add_argument("--repeats", type=int, default=3, help="Runs of each; medians are reported.")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gemm = gemm_rows(args.repeats)
    model, same = model_rows(args)
    native = cpu_has_native(torch.bfloat16)
    lines = [
        "# --cpu-half-gemm: bfloat16 products native or through float32",
        "",
        f"Machine: {machine()}; bfloat16 dot-product instructions: {'yes' if native else 'no'} "
        f"(auto picks {'native' if native else 'float32'}); medians of {args.repeats}.",
        "",
        "Linear layers of the bundled model (qkv, o, gate_up, down, lm_head shapes summed), one call each:",
        "",
        "| rows | native bf16 us | float32 products us | speedup |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['rows']} | {r['native_us']:.0f} | {r['float32_us']:.0f} | {r['speedup']:.2f}x |" for r in gemm]
    lines += [
        "",
        f"Full mode, deterministic, bundled model, {args.num_requests} x {args.input_len} prompt tokens "
        f"(prefill: 1 new token; decode: {args.output_len} new tokens, tok/s of the whole run):",
        "",
        "| phase | native tok/s | float32 products tok/s | speedup |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['phase']} | {r['native_tok_s']:.1f} | {r['float32_tok_s']:.1f} | {r['speedup']:.2f}x |"
              for r in model]
    lines += ["", f"Greedy tokens identical between the two: {'yes' if same else 'no (different rounding order)'}."]
    write_results("half_gemm", {"args": vars(args), "machine": machine(), "native_bf16": native, "gemm": gemm,
                                "model": model, "identical_tokens": same}, "\n".join(lines))


if __name__ == "__main__":
    main()
