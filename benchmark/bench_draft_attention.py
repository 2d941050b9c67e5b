"""DRAFT_DECODE (compressed chunks + exact tail + drafts) vs exact DECODE on the same contexts.

    .venv/bin/python benchmark/bench_draft_attention.py --batch 16 --context 1000 --threads 1

A random llama (hidden 512, 8 query / 2 KV heads of 64, 4 layers) on the torch backend. Every
request has `--context` tokens of exact KV; the drafting copy of each compresses all its whole
pages. Steps are timed interleaved (DECODE, then each compressor), `--steps` in a row (the
draft depth grows 1..steps), `--repeats` times; medians. Two clocks: the whole forward
(model + attention) and the attention backend alone (metadata + every layer's attention).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from sglang_vericache.model_executor.forward_batch import ForwardMode
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.server_args import ServerArgs
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
    q = torch.randn(bs, cfg.num_attention_heads * hd)
    k, v = torch.randn(bs, cfg.num_key_value_heads * hd), torch.randn(bs, cfg.num_key_value_heads * hd)
    with torch.inference_mode():
        t0 = time.perf_counter()
        backend.init_forward_metadata(fb)
        for layer in runner.model.model.layers:
            backend.forward(q, k, v, layer.self_attn.attn, fb)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1000)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--ratio", type=float, default=4)
    p.add_argument("--compressors", nargs="+", default=["streamingllm", "kivi4", "int8"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    bs, ctx, ps = args.batch, args.context, args.page_size
    path = make_random_checkpoint("llama", tempfile.mkdtemp(prefix="bench-draft-"), **MODEL)
    total = (bs * 2 * (ctx + args.steps * args.repeats + ps) // ps + 4) * ps
    runner = ModelRunner(ServerArgs(model_path=path, dtype=args.dtype, page_size=ps, max_total_tokens=total,
                                    max_running_requests=2 * bs, num_threads=args.threads))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (ctx,), generator=g).tolist() for _ in range(bs)]
    # exact requests (DECODE) and their drafting twins (same KV, first pages compressed)
    exact_reqs, twin_reqs = [new_req(runner) for _ in prompts], [new_req(runner) for _ in prompts]
    for reqs in (exact_reqs, twin_reqs):
        for i in range(0, bs, 4):
            runner.forward(prepare_forward_batch(runner, reqs[i : i + 4], prompts[i : i + 4]))
    pages = ctx // ps
    setups = {}
    for name in args.compressors:
        cpool = make_compressed_pool(runner, name, args.ratio, num_chunks=bs * pages, group_size=min(32, ps))
        setups[name] = (cpool, [compress_prefix(runner, cpool, r, pages) for r in twin_reqs])
        kib = cpool.bytes_per_chunk() / ps / 1024
        print(f"{name}: layout {cpool.layouts[0].kind}, rows/chunk {cpool.layouts[0].rows}, "
              f"{kib:.2f} KiB/token vs exact {runner.token_to_kv_pool.bytes_per_token() / 1024:.2f}")
    step_s: dict[str, list[float]] = {k: [] for k in ["DECODE", *args.compressors]}
    attn_s: dict[str, list[float]] = {k: [] for k in step_s}
    for rep in range(args.repeats):
        draft = DraftPool(runner, num_slots=len(setups) * bs * args.steps + 1)  # fresh drafts each repeat
        for d in (d for _, ds in setups.values() for d in ds):
            d.draft_slots = []
        for step in range(args.steps):
            ids = [int(t) for t in torch.randint(3, 400, (bs,), generator=g)]
            fb = prepare_forward_batch(runner, exact_reqs, [[t] for t in ids], ForwardMode.DECODE)
            t0 = time.perf_counter()
            runner.forward(fb)
            step_s["DECODE"].append(time.perf_counter() - t0)
            attn_s["DECODE"].append(attention_only(runner, fb))
            for name, (cpool, dreqs) in setups.items():
                fb = prepare_draft_batch(runner, cpool, dreqs, ids, draft)
                t0 = time.perf_counter()
                runner.forward(fb)
                step_s[name].append(time.perf_counter() - t0)
                attn_s[name].append(attention_only(runner, fb))
    base = statistics.median(step_s["DECODE"])
    base_attn = statistics.median(attn_s["DECODE"])
    print(f"batch {bs}, context {ctx} (+{args.steps} steps), page {ps}, ratio {args.ratio}, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s); medians over {args.steps * args.repeats} steps")
    print(f"{'mode':>26} {'step ms':>9} {'vs DECODE':>10} {'attn ms':>9} {'vs DECODE':>10}")
    for name in step_s:
        s, a = statistics.median(step_s[name]), statistics.median(attn_s[name])
        label = "DECODE (exact)" if name == "DECODE" else f"DRAFT_DECODE {name}"
        print(f"{label:>26} {1e3 * s:9.2f} {s / base:10.2f} {1e3 * a:9.2f} {a / base_attn:10.2f}")


if __name__ == "__main__":
    main()
