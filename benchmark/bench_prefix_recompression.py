"""What a partial prefix hit costs the compressed tier: time to first token and the seconds spent folding
(compressing) a request whose prompt shares most of a cached one, full mode beside VeriCache with the token
dropper ranking pages alone (page scope) and whole prompts (segment scope).

    .venv/bin/python benchmark/bench_prefix_recompression.py --model-path ~/.cache/sglang_vericache/models/SmolLM2-135M-Instruct.Q4_1.gguf

One in-process scheduler per mode. A held-out code prompt of --context-tokens is served once (it fills the
radix cache); then --repeats requests each share its first --hit-tokens and end in a tail of their own
(another held-out file's tokens), one at a time, one output token each. Page scope reuses the cached
prefix's compressed chunks and folds only the tail's pages; segment scope reuses the exact prefix but ranks
the whole prompt again (a kept set depends on every token of the segment and on the prompt's last queries),
so it folds every page. `fold s`: TwoTierKV's folding seconds for the request (the compressor over the
exact KV; kvzip's replay included). Medians over the repeats.

Writes benchmark/results/<out>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import code_prompts, machine, write_results
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path, default_model_path
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion
from sglang_vericache.utils.hf_tokenizer import get_tokenizer

MODES = {
    "full": {},
    "vericache page": {"kv_compress_scope": "page"},
    "vericache segment": {"kv_compress_scope": "segment"},
}


def serve(sched: Scheduler, rid: str, ids: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one request with one output token."""
    t0 = time.perf_counter()
    res = run_to_completion(sched, [make_request(rid, ids, max_new_tokens=1, temperature=0.0)])[rid]
    return time.perf_counter() - t0, res.cached_tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="Checkpoint (default: the served default model).")
    p.add_argument("--dtype", default="bfloat16", help="Model and KV dtype (default: bfloat16).")
    p.add_argument("--context-tokens", type=int, default=4096, help="Prompt length (default: 4096).")
    p.add_argument("--hit-tokens", type=int, default=3584, help="Tokens each later prompt shares (default: 3584).")
    p.add_argument("--compressor", default="snapkv", help="Token dropper (default: snapkv).")
    p.add_argument("--ratio", type=float, default=4, help="Its ratio (default: 4).")
    p.add_argument("--page-size", type=int, default=16, help="Page size (default: 16).")
    p.add_argument("--repeats", type=int, default=3, help="Requests with a partial hit per mode (default: 3).")
    p.add_argument("--out", default="prefix_recompression", help="Results name under benchmark/results.")
    args = p.parse_args()
    model = args.model_path or default_model_path()
    if not 0 < args.hit_tokens < args.context_tokens:
        raise SystemExit("--hit-tokens must be between 0 and --context-tokens")
    tail = args.context_tokens - args.hit_tokens
    tok = get_tokenizer(model)
    files = code_prompts(tok, 1 + args.repeats, args.context_tokens, args.context_tokens,
                         model_path=bundled_model_path())
    base = files[0].ids
    prompts = [base[: args.hit_tokens] + f.ids[-tail:] for f in files[1:]]
    rows = []
    for name, extra in MODES.items():
        server = {}
        if name != "full":
            server = {"kv_compressor": args.compressor, "kv_compression_ratio": args.ratio,
                      "speculative_algorithm": "VERICACHE", "vericache_schedule": "lockstep", **extra}
        sched = Scheduler(ServerArgs(model_path=model, dtype=args.dtype, skip_tokenizer_init=True,
                                     page_size=args.page_size, **server))
        tt = sched.two_tier
        cold, _ = serve(sched, "cold", base)
        ttft, fold, cached = [], [], []
        for i, ids in enumerate(prompts):
            before = tt.fold_seconds if tt else 0.0
            pages = tt.fold_pages if tt else 0
            seconds, hit = serve(sched, f"hit{i}", ids)
            ttft.append(seconds)
            fold.append((tt.fold_seconds - before) if tt else 0.0)
            cached.append(hit)
            folded = (tt.fold_pages - pages) if tt else 0
        rows.append({"mode": name, "cold_ttft_s": cold, "ttft_s": ttft, "ttft_median_s": statistics.median(ttft),
                     "fold_s": fold, "fold_median_s": statistics.median(fold), "cached_tokens": cached,
                     "folded_pages_last": folded})
        print(f"{name}: cold {cold:.2f} s, hit TTFT {statistics.median(ttft):.2f} s, "
              f"fold {statistics.median(fold):.2f} s, cached {cached}", flush=True)
        del sched
    full = rows[0]["ttft_median_s"]
    report = {"model_path": model, "machine": machine(), "args": vars(args), "rows": rows}
    lines = [
        f"Partial prefix hits: {model}, {args.dtype}, prompts of {args.context_tokens} tokens sharing their "
        f"first {args.hit_tokens} with a cached one; {args.compressor} {args.ratio:g}x, page {args.page_size}, "
        f"lock-step; medians of {args.repeats} requests; machine: {machine()}",
        "",
        "| mode | cold TTFT s | hit TTFT s | hit TTFT / full | fold s (median) | pages folded | cached tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['cold_ttft_s']:.2f} | {r['ttft_median_s']:.2f} | "
                     f"{r['ttft_median_s'] / full:.2f}x | {r['fold_median_s']:.2f} | {r['folded_pages_last']} | "
                     f"{r['cached_tokens'][0]} |")
    write_results(args.out, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
