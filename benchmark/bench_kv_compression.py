"""What lossy KV compression costs: bytes per token per tier, and the damage of serving from the
compressed tier alone (lossy mode) against full KV, on the bundled code model.

    .venv/bin/python benchmark/bench_kv_compression.py            # all compressors, ratios 2 4 8
    .venv/bin/python benchmark/bench_kv_compression.py --compressors kvzip snapkv+kivi4 --ratios 4 --merge

For each compressor and ratio: exact-tier and compressed-tier bytes/token (all layers), the
share of greedy outputs identical to full mode, the mean position of the first divergent token
(over the outputs that diverge), and the share of code completions that ast.parse accepts,
lossy against full. Quantizers imply their own ratio, so they run once; DROP+QUANT names compose
a dropper (at each ratio) and a quantizer. A second table gives what compression itself cost in
each lossy run (time in compress_pages, every layer of every folded page), the prefill's forwards,
and apart from them kvzip's reconstruction passes (a forward per folded page, see
compress/kvzip_reconstruction.py; kvzip_proxy scores without one, kvzap with its surrogate).
--merge keeps the stored rows this run does not redo (same prompts, tokens and page).
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

from common import (
    code_prompts,
    first_divergence,
    function_parses,
    machine,
    merge_rows,
    run_mode,
    write_results,
)
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.compress.base import CompressorConfig, exact_bytes_per_token
from sglang_vericache.compress.registry import COMPRESSOR_NAMES, get_compressor
from sglang_vericache.mem_cache import two_tier
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.server_args import QUANTIZING_COMPRESSORS as QUANTIZERS
from sglang_vericache.server_args import bundled_model_path


def time_compression() -> dict:
    """Times every compress_pages call of the two-tier code from now on: -> {"seconds", "chunks"}."""
    spent = {"seconds": 0.0, "chunks": 0}
    compress = two_tier.compress_pages

    def timed(compressor, kv_pool, pool, slots, ids, *args, **kwargs):
        t0 = time.perf_counter()
        compress(compressor, kv_pool, pool, slots, ids, *args, **kwargs)
        spent["seconds"] += time.perf_counter() - t0
        spent["chunks"] += len(ids)

    two_tier.compress_pages = timed
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSOR_NAMES), help="Compressors to run.")
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8], help="Compression ratios.")
    p.add_argument("--num-prompts", type=int, default=16, help="Code prompts (held-out stdlib functions).")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[256, 768], metavar=("MIN", "MAX"),
                   help="Prompt length range in tokens.")
    p.add_argument("--max-new-tokens", type=int, default=160, help="Tokens generated per prompt.")
    p.add_argument("--page-size", type=int, default=32, help="Page = compression chunk size.")
    p.add_argument("--merge", action="store_true",
                   help="Keep the rows of results/<out>.json that this run does not redo.")
    p.add_argument("--out", default="kv_compression",
                   help="Results name under benchmark/results (a subset run: give it another name).")
    args = p.parse_args()

    tok = get_tokenizer(args.model_path)
    prompts = code_prompts(tok, args.num_prompts, *args.prompt_tokens, model_path=args.model_path)
    ids = [c.ids for c in prompts]
    common = dict(page_size=args.page_size, max_running_requests=len(ids))
    full = run_mode(args.model_path, ids, args.max_new_tokens, **common)
    full_parse = [function_parses(c.header, tok.decode(o)) for c, o in zip(prompts, full.outputs)]
    mc = ModelConfig.from_path(args.model_path)

    compress_pages = two_tier.compress_pages
    rows = []
    configs = [(c, None) if c in QUANTIZERS else (c, r) for c in args.compressors for r in args.ratios]
    configs = list(dict.fromkeys(configs))
    for name, ratio in tqdm(configs, desc="lossy runs"):
        cfg = CompressorConfig.from_model_config(name, ratio or 4.0, args.page_size, mc)
        comp = get_compressor(name, cfg)
        spent = time_compression()
        lossy = run_mode(args.model_path, ids, args.max_new_tokens, kv_compressor=name,
                         kv_compression_ratio=ratio or 4.0, **common)
        two_tier.compress_pages = compress_pages
        div = [first_divergence(f, o) for f, o in zip(full.outputs, lossy.outputs)]
        diverged = [d for d in div if d is not None]
        parse = [function_parses(c.header, tok.decode(o)) for c, o in zip(prompts, lossy.outputs)]
        rows.append({
            "compressor": name,
            "ratio": ratio,
            "effective_ratio": comp.effective_ratio(),
            "exact_bytes_per_token": exact_bytes_per_token(cfg) * mc.num_hidden_layers,
            "compressed_bytes_per_token": comp.bytes_per_token(),
            "identical_share": div.count(None) / len(div),
            "mean_first_divergence": statistics.mean(diverged) if diverged else None,
            "parse_share_lossy": sum(parse) / len(parse),
            "parse_share_full": sum(full_parse) / len(full_parse),
            "seconds": lossy.seconds,
            "compress_seconds": spent["seconds"],
            "chunks_compressed": spent["chunks"],
            "prompt_tokens": sum(len(x) for x in ids),
            # the prefill's EXTEND forwards, and kvzip's reconstruction passes apart from them
            "prefill_seconds": sum(lossy.metrics["forward_seconds"].get("EXTEND", [])),
            "reconstruction_seconds": sum(lossy.metrics["forward_seconds"].get("RECONSTRUCT", [])),
            "reconstruction_forwards": lossy.metrics.get("reconstruction", {}).get("forwards"),
            "reconstruction_tokens": lossy.metrics.get("reconstruction", {}).get("tokens"),
        })

    report = {"model_path": args.model_path, "machine": machine(), "args": vars(args), "rows": rows}
    if args.merge:
        report = merge_rows(args.out, report, lambda r: (r["compressor"], r["ratio"]),
                            ("num_prompts", "prompt_tokens", "max_new_tokens", "page_size", "model_path"))
    rows = report["rows"]
    lines = [
        f"KV compression damage, lossy mode vs full KV: {args.model_path}",
        f"{len(ids)} held-out code prompts ({args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens), "
        f"{args.max_new_tokens} greedy tokens, page {args.page_size}; machine: {machine()}",
        "",
        "| compressor | ratio | bytes/token exact | bytes/token compressed | identical to full | "
        "mean first divergence | ast.parse lossy | ast.parse full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = f"{r['ratio']:g}" if r["ratio"] else f"({r['effective_ratio']:.2f})"
        mfd = f"{r['mean_first_divergence']:.1f}" if r["mean_first_divergence"] is not None else "-"
        lines.append(
            f"| {r['compressor']} | {ratio} | {r['exact_bytes_per_token']} | {r['compressed_bytes_per_token']:.0f} | "
            f"{r['identical_share']:.0%} | {mfd} | {r['parse_share_lossy']:.0%} | {r['parse_share_full']:.0%} |"
        )
    timed = [r for r in rows if "compress_seconds" in r]
    if timed:
        lines += [
            "",
            "What compression cost in each lossy run (compress_pages: every layer of every page folded, "
            "prefill and decode), beside the run's wall time:",
            "",
            "`prefill s`: the run's EXTEND forwards without kvzip's reconstruction passes; `pass s`: those "
            "passes' forwards (- where a row predates the column).",
            "",
            "| compressor | ratio | pages folded | compress s | ms per page | prefill s | pass s | lossy run s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        sec = lambda r, key: "-" if r.get(key) is None else f"{r[key]:.2f}"  # noqa: E731
        for r in timed:
            ratio = f"{r['ratio']:g}" if r["ratio"] else "-"
            per = 1e3 * r["compress_seconds"] / max(r["chunks_compressed"], 1)
            lines.append(f"| {r['compressor']} | {ratio} | {r['chunks_compressed']} | "
                         f"{r['compress_seconds']:.2f} | {per:.2f} | {sec(r, 'prefill_seconds')} | "
                         f"{sec(r, 'reconstruction_seconds') if r.get('reconstruction_forwards') else '-'} | "
                         f"{r['seconds']:.1f} |")
        for r in timed:
            if r.get("reconstruction_forwards"):
                extra, prompt = r["reconstruction_tokens"], r["prompt_tokens"]
                lines.append(
                    f"\n{r['compressor']} at ratio {r['ratio']:g}: {r['reconstruction_forwards']} reconstruction "
                    f"passes forwarded {extra} tokens over the context ({extra / prompt:.2f}x the {prompt} prompt "
                    "tokens prefilled), in the `pass s` column apart from the prefill.")
    write_results(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
