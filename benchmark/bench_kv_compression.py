"""What lossy KV compression costs: bytes per token per tier, and the damage of serving from the
compressed tier alone (lossy mode) against full KV, on the bundled code model.

    .venv/bin/python benchmark/bench_kv_compression.py            # all compressors, ratios 2 4 8

For each compressor and ratio: exact-tier and compressed-tier bytes/token (all layers), the
share of greedy outputs identical to full mode, the mean position of the first divergent token
(over the outputs that diverge), and the share of code completions that ast.parse accepts,
lossy against full. Quantizers imply their own ratio, so they run once.
"""

from __future__ import annotations

import argparse
import statistics

from tqdm import tqdm
from transformers import AutoTokenizer

from common import code_prompts, first_divergence, function_parses, machine, run_mode, write_results
from sglang_vericache.compress.base import CompressorConfig, exact_bytes_per_token
from sglang_vericache.compress.registry import COMPRESSOR_NAMES, get_compressor
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.server_args import default_model_path

QUANTIZERS = ("kivi2", "kivi4", "int8", "fp8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=default_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSOR_NAMES), help="Compressors to run.")
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8], help="Compression ratios.")
    p.add_argument("--num-prompts", type=int, default=16, help="Code prompts (held-out stdlib functions).")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[256, 768], metavar=("MIN", "MAX"),
                   help="Prompt length range in tokens.")
    p.add_argument("--max-new-tokens", type=int, default=160, help="Tokens generated per prompt.")
    p.add_argument("--page-size", type=int, default=32, help="Page = compression chunk size.")
    args = p.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model_path)
    prompts = code_prompts(tok, args.num_prompts, *args.prompt_tokens, model_path=args.model_path)
    ids = [c.ids for c in prompts]
    common = dict(page_size=args.page_size, max_running_requests=len(ids))
    full = run_mode(args.model_path, ids, args.max_new_tokens, **common)
    full_parse = [function_parses(c.header, tok.decode(o)) for c, o in zip(prompts, full.outputs)]
    mc = ModelConfig.from_path(args.model_path)

    rows = []
    configs = [(c, None) if c in QUANTIZERS else (c, r) for c in args.compressors for r in args.ratios]
    configs = list(dict.fromkeys(configs))
    for name, ratio in tqdm(configs, desc="lossy runs"):
        cfg = CompressorConfig.from_model_config(name, ratio or 4.0, args.page_size, mc)
        comp = get_compressor(name, cfg)
        lossy = run_mode(args.model_path, ids, args.max_new_tokens, kv_compressor=name,
                         kv_compression_ratio=ratio or 4.0, **common)
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
        })

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
    report = {"model_path": args.model_path, "machine": machine(), "args": vars(args), "rows": rows}
    write_results("kv_compression", report, "\n".join(lines))


if __name__ == "__main__":
    main()
