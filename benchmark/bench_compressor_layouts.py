"""Bytes per token of every compressor layout for one model shape, as a Markdown table.

    python benchmark/bench_compressor_layouts.py --model-path /path/to/hf_checkpoint
    python benchmark/bench_compressor_layouts.py --num-layers 24 --num-kv-heads 2 --num-q-heads 14 \
        --head-dim 64 --chunk-size 64 --dtype bfloat16 --ratios 2 4 8

Static numbers from the layouts (no data is compressed): bytes per token summed over layers,
scales and indices included, and the ratio against the exact tier. Quantizers ignore the ratio.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from sglang_vericache.compress import (
    COMPRESSOR_NAMES,
    CompressorConfig,
    exact_bytes_per_token,
    get_compressor,
)
from sglang_vericache.compress.registry import fp8_supported
from sglang_vericache.server_args import QUANTIZING_COMPRESSORS as QUANTIZERS


def shape_from_hf_config(model_path: str) -> dict:
    with open(os.path.join(model_path, "config.json")) as f:
        hf = json.load(f)
    hf = hf.get("text_config", hf)
    num_q_heads = hf["num_attention_heads"]
    return {
        "num_layers": hf["num_hidden_layers"],
        "num_q_heads": num_q_heads,
        "num_kv_heads": hf.get("num_key_value_heads") or num_q_heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // num_q_heads,
    }


def rows(args: argparse.Namespace, shape: dict) -> list[list[str]]:
    dtype = getattr(torch, args.dtype)
    table = []
    for name in COMPRESSOR_NAMES:
        if name == "fp8" and not fp8_supported():
            continue
        for ratio in args.ratios if name not in QUANTIZERS else [args.ratios[0]]:
            cfg = CompressorConfig(name, ratio=ratio, chunk_size=args.chunk_size, dtype=dtype, **shape)
            comp = get_compressor(name, cfg)
            per_layer = [comp.layout(layer).bytes_per_token() for layer in range(cfg.num_layers)]
            exact = exact_bytes_per_token(cfg) * cfg.num_layers
            table.append(
                [
                    name,
                    "-" if name in QUANTIZERS else f"{ratio:g}",
                    comp.layout(0).kind,
                    f"{sum(per_layer):g}",
                    f"{min(per_layer):g}..{max(per_layer):g}",
                    f"{exact:g}",
                    f"{exact / sum(per_layer):.3f}",
                ]
            )
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="HF checkpoint dir; its config.json gives the shape")
    p.add_argument("--num-layers", type=int, default=24)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--num-q-heads", type=int, default=14)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", help="exact tier dtype")
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8])
    args = p.parse_args()
    if args.model_path:
        shape = shape_from_hf_config(args.model_path)
    else:
        shape = {
            "num_layers": args.num_layers,
            "num_kv_heads": args.num_kv_heads,
            "num_q_heads": args.num_q_heads,
            "head_dim": args.head_dim,
        }
    print(
        f"layers={shape['num_layers']} kv_heads={shape['num_kv_heads']} q_heads={shape['num_q_heads']} "
        f"head_dim={shape['head_dim']} chunk={args.chunk_size} exact dtype={args.dtype}\n"
    )
    header = ["compressor", "R", "kind", "bytes/token", "per layer", "exact bytes/token", "effective ratio"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" --- " for _ in header) + "|")
    for row in rows(args, shape):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
