"""Full-mode decode throughput of the scheduler, in-process, at several batch sizes, against the
memory-traffic bound and Hugging Face transformers on the same model and dtype.

    .venv/bin/python benchmark/bench_decode_throughput.py --batch-sizes 1 16
    .venv/bin/python benchmark/bench_decode_throughput.py --model-path /tmp/models/smollm2-hf --dtype bfloat16 \
        --batch-sizes 1 32 --transformers

The bound of a row: one decode step reads every weight once in its stored dtype (the linear layers,
the LM head and the norms; an untied embedding table only one row per token) and each request's KV
(its context, input_len + output_len / 2 on average, in the KV dtype), at best at this machine's read
bandwidth, measured here as a torch sum over a 1 GiB tensor (median of 3): bound tokens/s = batch x
bandwidth / bytes per step. Each row reports the fraction of it reached.

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


def read_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """Bytes/s of a torch sum over a large float32 tensor (torch's threads): this machine's read bandwidth."""
    x = torch.ones(int(gib * 2**30) // 4)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of the weights one decode step reads, in their stored dtype: every parameter once, except an
    embedding table that is not also the LM head (one row per token)."""
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    seen, total = set(), 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen or ("embed_tokens" in name and p is not head):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def kv_bytes_per_step(mc, kv_dtype: torch.dtype, batch: int, context: float) -> float:
    esize = torch.tensor([], dtype=kv_dtype).element_size()
    return batch * context * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2 * esize


def transformers_decode_tok_s(model_path: str, dtype: str, batch: int, input_len: int, output_len: int,
                              vocab: int, seed: int) -> float:
    """Hugging Face transformers' greedy decode tokens/s (generate's time minus its one-token prefill's)."""
    from transformers import AutoModelForCausalLM

    model = _hf_models.get((model_path, dtype))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype) if dtype != "auto"
                                                     else "auto").eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        _hf_models[(model_path, dtype)] = model
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, input_len), generator=g)
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, **kw)
        t2 = time.perf_counter()
    return batch * (output_len - 1) / max((t2 - t1) - (t1 - t0), 1e-9)


_hf_models: dict = {}


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
    p.add_argument("--transformers", action="store_true",
                   help="Also measure Hugging Face transformers' decode on the same model and dtype (interleaved).")
    p.add_argument("--transformers-max-batch", type=int, default=1,
                   help="Largest batch size transformers is measured at (its CPU prefill is slow in half precision).")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's).")
    p.add_argument("--out", default="benchmark/results/decode_throughput.json", help="Where to write JSON (and "
                   "the table beside it as .md).")
    args = p.parse_args()
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    sched = Scheduler(ServerArgs(model_path=args.model_path, dtype=args.dtype, skip_tokenizer_init=True,
                                 max_running_requests=max(args.batch_sizes),
                                 max_total_tokens=max(args.batch_sizes) * (args.input_len + args.output_len + 64)))
    decode_tokens_per_s(sched, 1, 16, 4, seed=-1 % 1000)  # warm-up
    backend = sched.model_runner.attn_backend
    mc = sched.model_runner.model_config
    weights = weight_bytes_per_step(sched.model_runner.model)
    bandwidth = read_bandwidth()
    rows = []
    for bs in args.batch_sizes:
        runs = {path: [] for path in args.decode_attention}
        with_hf = args.transformers and bs <= args.transformers_max_batch
        if with_hf:
            runs["transformers"] = []
        for seed in tqdm(range(args.repeats), desc=f"batch {bs}"):
            for path in args.decode_attention:
                backend.kernel_decode = None if path == "kernel" else False  # None: decided at the next DECODE
                runs[path].append(decode_tokens_per_s(sched, bs, args.input_len, args.output_len, seed))
            if with_hf:
                runs["transformers"].append(transformers_decode_tok_s(
                    args.model_path, args.dtype, bs, args.input_len, args.output_len, sched.vocab_size, seed))
        step_bytes = weights + kv_bytes_per_step(mc, sched.model_runner.kv_dtype, bs,
                                                 args.input_len + args.output_len / 2)
        bound = bs * bandwidth / step_bytes
        for path, tok_s in runs.items():
            med = statistics.median(tok_s)
            rows.append({"batch_size": bs, "decode_attention": path, "median_tok_s": med, "runs_tok_s": tok_s,
                         "bytes_per_step": step_bytes, "bound_tok_s": bound, "fraction_of_bound": med / bound})
    report = {
        "model_path": args.model_path,
        "shape": {"layers": mc.num_hidden_layers, "hidden": mc.hidden_size, "heads": mc.num_attention_heads,
                  "kv_heads": mc.num_key_value_heads, "head_dim": mc.head_dim, "vocab": mc.vocab_size},
        "dtype": str(mc.dtype),
        "input_len": args.input_len,
        "output_len": args.output_len,
        "machine": machine(),
        "deterministic_inference": bool(sched.server_args.enable_deterministic_inference),
        "read_bandwidth_bytes_s": bandwidth,
        "weight_bytes_per_step": weights,
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    lines = [f"# Decode throughput vs the memory-traffic bound (median of {args.repeats})", "",
             f"Machine: {report['machine']}; read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum over 1 GiB)", "",
             f"Model: {args.model_path} {report['shape']} {report['dtype']}; weights read per step "
             f"{weights / 1e6:.1f} MB; deterministic inference {'on' if report['deterministic_inference'] else 'off'}; "
             f"{args.input_len} prompt + {args.output_len} new tokens per request", "",
             "| batch | engine | decode tokens/s (median) | bound tokens/s | fraction of bound | vs the first | runs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    first = {}
    for r in rows:
        base = first.setdefault(r["batch_size"], r["median_tok_s"])
        name = r["decode_attention"] if r["decode_attention"] == "transformers" else f"ours ({r['decode_attention']})"
        lines.append(f"| {r['batch_size']} | {name} | {r['median_tok_s']:.1f} | {r['bound_tok_s']:.1f} | "
                     f"{r['fraction_of_bound']:.0%} | {r['median_tok_s'] / base:.2f}x | "
                     f"{', '.join(f'{x:.1f}' for x in r['runs_tok_s'])} |")
    table = "\n".join(lines)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
