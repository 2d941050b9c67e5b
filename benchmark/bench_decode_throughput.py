"""Full-mode decode throughput of the scheduler, in-process, at several batch sizes.

    .venv/bin/python benchmark/bench_decode_throughput.py --batch-sizes 1 16

Prefill is excluded: the clock runs over decode steps only. Each batch size is measured
`--repeats` times and the median is reported, with the machine it ran on. `--decode-attention`
compares the decode step's attention paths in one run, interleaved per repeat: `kernel` (the default:
on a CPU the batch-invariant kernel reading the KV pool in place) and `sdpa` (the KV gathered for
SDPA, the step before; the torch backend's `kernel_decode` off); the second's ratio to the first is
reported per batch size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from tqdm import tqdm

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def decode_tokens_per_s(sched: Scheduler, batch: int, input_len: int, output_len: int, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    reqs = [
        make_request(f"b{batch}-{seed}-{i}", torch.randint(3, sched.vocab_size, (input_len,), generator=g).tolist(),
                     max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
        for i in range(batch)
    ]
    for r in reqs:
        sched.handle_message(r)
    while sched.waiting_queue or sched.chunked_req:  # prefill everything first
        sched.step()
    sched.outbox.clear()
    tokens, t0 = 0, time.perf_counter()
    while sched.running:
        tokens += len(sched.running)
        sched.step()
    elapsed = time.perf_counter() - t0
    sched.outbox.clear()
    return tokens / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--dtype", default="auto", help="Model dtype.")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="Batch sizes to measure.")
    p.add_argument("--input-len", type=int, default=256, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=128, help="New tokens per request.")
    p.add_argument("--repeats", type=int, default=3, help="Runs per batch size (the median is reported).")
    p.add_argument("--decode-attention", nargs="+", choices=["kernel", "sdpa"], default=["kernel"],
                   help="Decode attention paths to compare, interleaved per repeat: kernel (the default path: on "
                        "a CPU the batch-invariant kernel reading the pool in place), sdpa (the KV gathered for "
                        "SDPA).")
    p.add_argument("--out", default="benchmark/results/decode_throughput.json", help="Where to write JSON.")
    args = p.parse_args()

    sched = Scheduler(ServerArgs(model_path=args.model_path, dtype=args.dtype, skip_tokenizer_init=True,
                                 max_running_requests=max(args.batch_sizes)))
    decode_tokens_per_s(sched, 1, 16, 4, seed=-1 % 1000)  # warm-up
    backend = sched.model_runner.attn_backend
    rows = []
    for bs in args.batch_sizes:
        runs = {path: [] for path in args.decode_attention}
        for seed in tqdm(range(args.repeats), desc=f"batch {bs}"):
            for path in args.decode_attention:
                backend.kernel_decode = None if path == "kernel" else False  # None: decided at the next DECODE
                runs[path].append(decode_tokens_per_s(sched, bs, args.input_len, args.output_len, seed))
        for path, tok_s in runs.items():
            rows.append({"batch_size": bs, "decode_attention": path, "median_tok_s": statistics.median(tok_s),
                         "runs_tok_s": tok_s})
    mc = sched.model_runner.model_config
    report = {
        "model_path": args.model_path,
        "shape": {"layers": mc.num_hidden_layers, "hidden": mc.hidden_size, "heads": mc.num_attention_heads,
                  "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size},
        "dtype": str(mc.dtype),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "machine": machine(),
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"\nmachine: {report['machine']}\nmodel: {args.model_path} {report['shape']} {report['dtype']}")
    print("| batch | decode attention | decode tokens/s (median) | vs the first path | runs |\n"
          "| --- | --- | --- | --- | --- |")
    first = {}
    for r in rows:
        base = first.setdefault(r["batch_size"], r["median_tok_s"])
        print(f"| {r['batch_size']} | {r['decode_attention']} | {r['median_tok_s']:.1f} | "
              f"{r['median_tok_s'] / base:.2f}x | {', '.join(f'{x:.1f}' for x in r['runs_tok_s'])} |")


if __name__ == "__main__":
    main()
