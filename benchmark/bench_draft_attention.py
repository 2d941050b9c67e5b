"""DRAFT_DECODE (compressed chunks + exact tail + drafts) vs exact DECODE on the same contexts.

    .venv/bin/python benchmark/bench_draft_attention.py       # fp32 and bf16, 1 and 2 threads, every compressor
    .venv/bin/python benchmark/bench_draft_attention.py --dtypes float32 --threads 1 --compressors kivi4 --no-write
    # the bundled model at the long-context setting (batch 16, context 1600, page 32):
    .venv/bin/python benchmark/bench_draft_attention.py --model-path bundled --dtypes bfloat16 --threads 2
        --page-size 32 --no-torch-path --out draft_attention_bundled

A random llama (hidden 512, 8 query / 2 KV heads of 64, 4 layers), or --model-path's model (`bundled`:
the bundled code model), on the torch backend. Every request has `--context` tokens of exact KV; its
drafting twin compresses all its whole pages
(query-scored compressors score with random queries: arbitrary rows kept, the real layout). Modes,
timed interleaved, `--steps` in a row (the draft depth grows 1..steps), `--repeats` times:
- DECODE: full mode's decode step: on a CPU the batch-invariant kernel reading the exact KV in place,
  with or without deterministic inference (the torch backend's `kernel_decode`; the two-tier modes'
  verify steps use the same kernel);
- DECODE SDPA: the same step gathering the exact KV for SDPA (full mode's decode step before
  `kernel_decode`, and its path where the kernel does not build);
- DRAFT_DECODE per compressor through the fused CPU kernel (the torch backend's path on a CPU), and
  through the torch path (gathers, dequantized copies, SDPA: the path before the kernel) unless
  --no-torch-path.
Each repeat's median per mode; reported: the median over repeats. Two clocks: the whole forward
(model + attention) and the attention backend alone (metadata + every layer's attention); with
--kernel-replay a third: one layer's kernel call of each mode captured from a step and replayed on the
same inputs, the modes interleaved in one process (what the steps' interleaving and cache state leave out).
Writes benchmark/results/draft_attention.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from common import machine, write_results
from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing import make_random_checkpoint
from sglang_vericache.testing.draft_batches import (
    DraftPool,
    compress_prefix,
    make_compressed_pool,
    prepare_draft_batch,
)
from sglang_vericache.testing.forward_batches import new_req, prepare_forward_batch

MODEL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=4096)


def attention_only(runner: ModelRunner, fb) -> float:
    """Seconds for init_forward_metadata + one attention call per layer (random q/k/v)."""
    cfg, backend = runner.model_config, runner.attn_backend
    fb.req_to_token_pool, fb.token_to_kv_pool = runner.req_to_token_pool, runner.token_to_kv_pool
    fb.attn_backend = backend
    bs, hd = fb.batch_size, cfg.head_dim
    dt = runner.dtype
    q = torch.randn(bs, cfg.num_attention_heads * hd).to(dt)
    k = torch.randn(bs, cfg.num_key_value_heads * hd).to(dt)
    v = torch.randn(bs, cfg.num_key_value_heads * hd).to(dt)
    with torch.inference_mode():
        t0 = time.perf_counter()
        backend.init_forward_metadata(fb)
        for layer in runner.model.model.layers:
            backend.forward(q, k, v, layer.self_attn.attn, fb)
        return time.perf_counter() - t0


def timed(runner: ModelRunner, fb, step_s: list, attn_s: list, **backend_flags) -> None:
    backend = runner.attn_backend
    saved = {name: getattr(backend, name) for name in backend_flags}
    for name, value in backend_flags.items():
        setattr(backend, name, value)
    try:
        t0 = time.perf_counter()
        runner.forward(fb)
        step_s.append(time.perf_counter() - t0)
        attn_s.append(attention_only(runner, fb))
    finally:
        for name, value in saved.items():
            setattr(backend, name, value)


def capture_call(module, name: str, run) -> tuple:
    """Runs run() with module.<name> (a kernel's Python entry, looked up at each call) wrapped -> (the
    function, the args and kwargs of its first call: one layer's)."""
    real, seen = getattr(module, name), []

    def wrapped(*a, **kw):
        if not seen:
            seen.append((a, kw))
        return real(*a, **kw)

    setattr(module, name, wrapped)
    try:
        with torch.inference_mode():
            run()
    finally:
        setattr(module, name, real)
    return real, *seen[0]


def replay(calls: dict, repeats: int, n: int = 30) -> dict:
    """Each captured call n times in a row, the calls interleaved, `repeats` times -> {mode: median ms per
    call}. One kernel on the same inputs in one process: free of the step's other work and cache state."""
    ms = {m: [] for m in calls}
    for _ in range(repeats + 1):  # the first round warms up
        for m, (fn, a, kw) in calls.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn(*a, **kw)
            ms[m].append(1e3 * (time.perf_counter() - t0) / n)
    return {m: statistics.median(v[1:]) for m, v in ms.items()}


def run_setting(args, dtype: str, threads: int) -> dict:
    """Every mode at one (dtype, thread count) -> {mode: {"step_ms", "attn_ms"}} (medians over repeats),
    and "load": the machine's 1-minute load average before and after (other jobs share the cores)."""
    load_before = os.getloadavg()[0]
    torch.set_num_threads(threads)
    bs, ctx, ps = args.batch, args.context, args.page_size
    path = args.model_path or make_random_checkpoint("llama", tempfile.mkdtemp(prefix="bench-draft-"), **MODEL)
    path = bundled_model_path() if path == "bundled" else path
    total = (bs * 2 * (ctx + args.steps * args.repeats + ps) // ps + 4) * ps
    runner = ModelRunner(ServerArgs(model_path=path, dtype=dtype, page_size=ps, max_total_tokens=total,
                                    max_running_requests=2 * bs, num_threads=threads))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (ctx,), generator=g).tolist() for _ in range(bs)]
    # exact requests (DECODE) and their drafting twins (same KV, whole pages compressed)
    exact_reqs, twin_reqs = [new_req(runner) for _ in prompts], [new_req(runner) for _ in prompts]
    for reqs in (exact_reqs, twin_reqs):
        for i in range(0, bs, 4):
            runner.forward(prepare_forward_batch(runner, reqs[i : i + 4], prompts[i : i + 4]))
    pages = ctx // ps
    setups = {}
    for name in args.compressors:
        cpool = make_compressed_pool(runner, name, args.ratio, num_chunks=bs * pages, group_size=min(32, ps))
        setups[name] = (cpool, [compress_prefix(runner, cpool, r, pages, random_queries=g) for r in twin_reqs])
    draft_modes = [(name, path) for name in args.compressors for path in args.paths]
    modes = ["DECODE", "DECODE SDPA", *(f"{n} {p}" for n, p in draft_modes)]
    step_s = {m: [[] for _ in range(args.repeats + 1)] for m in modes}  # [-1]: the warm-up
    attn_s = {m: [[] for _ in range(args.repeats + 1)] for m in modes}
    for rep in [-1, *range(args.repeats)]:  # repeat -1: one untimed warm-up step of every mode
        draft = DraftPool(runner, num_slots=len(draft_modes) * bs * args.steps + 1)  # fresh drafts each repeat
        for d in (d for _, ds in setups.values() for d in ds):
            d.draft_slots = []
        for step in range(1 if rep < 0 else args.steps):
            ids = [int(t) for t in torch.randint(3, 400, (bs,), generator=g)]
            fb = prepare_forward_batch(runner, exact_reqs, [[t] for t in ids], ForwardMode.DECODE)
            timed(runner, fb, step_s["DECODE"][rep], attn_s["DECODE"][rep], deterministic=False)
            timed(runner, fb, step_s["DECODE SDPA"][rep], attn_s["DECODE SDPA"][rep], deterministic=False,
                  kernel_decode=False)
            for name, (cpool, dreqs) in setups.items():
                fb = prepare_draft_batch(runner, cpool, dreqs, ids, draft)
                for p in args.paths:
                    m = f"{name} {p}"
                    timed(runner, fb, step_s[m][rep], attn_s[m][rep], fused_draft=p == "fused", deterministic=False)
    kernel_ms = {}
    if args.kernel_replay:  # one layer's kernel call of each mode, replayed (same contexts as the steps)
        import sgl_kernel_ext.cpu_attention as exact_kernel
        import sgl_kernel_ext.cpu_draft_attention as draft_kernel

        ids = [int(t) for t in torch.randint(3, 400, (bs,), generator=g)]
        fb = prepare_forward_batch(runner, exact_reqs, [[t] for t in ids], ForwardMode.DECODE)
        runner.attn_backend.deterministic = False
        calls = {"DECODE": capture_call(exact_kernel, "fixed_chunk_attention", lambda: runner.forward(fb))}
        draft = DraftPool(runner, num_slots=len(setups) * bs + 1)
        for name, (cpool, dreqs) in setups.items():
            for d in dreqs:
                d.draft_slots = []
            dfb = prepare_draft_batch(runner, cpool, dreqs, ids, draft)
            calls[f"{name} fused"] = capture_call(draft_kernel, "draft_decode_attention", lambda: runner.forward(dfb))
        kernel_ms = replay(calls, args.repeats)

    def med(runs: list[list[float]]) -> float:
        return 1e3 * statistics.median(statistics.median(r) for r in runs[:-1])

    out = {m: {"step_ms": med(step_s[m]), "attn_ms": med(attn_s[m]),
               "step_ms_per_repeat": [round(1e3 * statistics.median(r), 2) for r in step_s[m][:-1]]}
           for m in modes}
    for m, v in kernel_ms.items():
        out[m]["kernel_ms"] = v
    out["load"] = [load_before, os.getloadavg()[0]]
    return out


def table(results: dict, args) -> str:
    lines = [
        f"DRAFT_DECODE vs DECODE: batch {args.batch}, context {args.context} (+{args.steps} draft steps), "
        f"page {args.page_size}, token-drop ratio {args.ratio:g}, "
        + (args.model_path or "random llama (hidden 512, 8 q / 2 KV heads of 64, 4 layers)")
        + f"; median over {args.repeats} repeats of each repeat's median over {args.steps} steps",
        f"machine: {machine(threads=False)}",
        "",
        "`step`: the whole forward (model + attention); `attn`: metadata + every layer's attention. "
        "`draft/full`: a draft step's time over full mode's DECODE step's (on a CPU the batch-invariant "
        "kernel reading the exact KV in place, deterministic inference or not); `vs SDPA`: over the "
        "same DECODE gathering the exact KV for SDPA (full mode's step before it read the pool in place). "
        "`torch path`: the same draft step through the torch path (gathers, dequantized copies, SDPA), "
        "the path before the fused kernel."
        + (" `kernel`: one layer's kernel call alone, replayed on the same inputs, modes interleaved in one "
           "process (--kernel-replay): its ms and its ratio to the DECODE kernel's." if args.kernel_replay else ""),
    ]
    for key, res in results.items():
        base, sdpa = res["DECODE"], res["DECODE SDPA"]
        lines += ["", f"### {key}", "",
                  f"DECODE: step {base['step_ms']:.1f} ms, attn {base['attn_ms']:.1f} ms; DECODE SDPA: "
                  f"step {sdpa['step_ms']:.1f} ms, attn {sdpa['attn_ms']:.1f} ms; machine load average "
                  f"{res['load'][0]:.1f} before, {res['load'][1]:.1f} after", "",
                  "| compressor | step ms | draft/full step | vs SDPA | attn ms | draft/full attn "
                  "| torch path step ms | torch path draft/full |" + (" kernel ms | kernel draft/full |" if args.kernel_replay else ""),
                  "| --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if args.kernel_replay else "")]
        if args.kernel_replay and "kernel_ms" in base:
            lines.insert(-3, f"DECODE kernel alone: {base['kernel_ms']:.3f} ms per layer")
        for name in args.compressors:
            f, t = res.get(f"{name} fused"), res.get(f"{name} torch")
            cells = [name]
            if f:
                cells += [f"{f['step_ms']:.1f}", f"{f['step_ms'] / base['step_ms']:.2f}x",
                          f"{f['step_ms'] / sdpa['step_ms']:.2f}x", f"{f['attn_ms']:.1f}",
                          f"{f['attn_ms'] / base['attn_ms']:.2f}x"]
            else:
                cells += ["-"] * 5
            cells += [f"{t['step_ms']:.1f}", f"{t['step_ms'] / base['step_ms']:.2f}x"] if t else ["-", "-"]
            if args.kernel_replay:
                k = f.get("kernel_ms") if f else None
                cells += [f"{k:.3f}", f"{k / base['kernel_ms']:.2f}x"] if k and "kernel_ms" in base else ["-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None,
                   help="Model folder, or `bundled` (the bundled code model, the long-context benchmark's); "
                        "default: a random llama (hidden 512, 4 layers).")
    p.add_argument("--batch", type=int, default=16, help="Requests per forward (each drafts or decodes one row).")
    p.add_argument("--context", type=int, default=1600, help="Exact KV tokens per request.")
    p.add_argument("--page-size", type=int, default=16, help="KV page = compression chunk, tokens.")
    p.add_argument("--ratio", type=float, default=4, help="Token-drop ratio (quantizers have their own).")
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSOR_NAMES), help="Compressors to time.")
    p.add_argument("--steps", type=int, default=8, help="Timed steps in a row per repeat (draft depth 1..steps).")
    p.add_argument("--repeats", type=int, default=3, help="Repeats; the median over them is reported.")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts to run.")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="Model dtypes to run.")
    p.add_argument("--out", default="draft_attention", help="Results name: benchmark/results/OUT.{json,md}.")
    p.add_argument("--no-torch-path", action="store_true", help="Time drafts through the fused kernel only.")
    p.add_argument("--no-write", action="store_true", help="Print only; do not write benchmark/results.")
    p.add_argument("--kernel-replay", action="store_true",
                   help="Also time one layer's kernel call of each mode alone, replayed on the same inputs with "
                        "the modes interleaved in one process (steadier than the steps on a noisy machine).")
    args = p.parse_args()
    args.paths = ["fused"] if args.no_torch_path else ["fused", "torch"]
    results = {}
    for dtype in args.dtypes:
        for threads in args.threads:
            key = f"{dtype}, {threads} thread{'s' if threads > 1 else ''}"
            results[key] = run_setting(args, dtype, threads)
            print(table({key: results[key]}, args).split("### ", 1)[1], flush=True)
    text = table(results, args)
    if args.no_write:
        print(text)
        return
    report = {"machine": machine(threads=False), "args": {k: v for k, v in vars(args).items()}, "results": results}
    write_results(args.out, report, text)


if __name__ == "__main__":
    main()
