"""Greedy tokens of our engine vs Hugging Face transformers on the same checkpoint (a GGUF file or an HF
folder): N chat prompts, each continued for --max-new-tokens tokens with EOS ignored, on both sides.

transformers loads a GGUF file itself (`from_pretrained(folder, gguf_file=...)`: its own dequantization
into --dtype), so the check covers our GGUF config, names, dequantization and model code at once.
Writes benchmark/results/hf_parity_<model>.json and .md.

    python benchmark/check_hf_parity.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf --dtype float32 --prompts 12
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch

from common import first_divergence, machine, write_results
from sglang_vericache.engine import Engine
from sglang_vericache.utils.gguf_files import gguf_file_of

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a hash map.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a haiku about autumn leaves.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "What does HTTP status code 404 mean?",
    "Name the planets of the solar system in order.",
    "Write a SQL query that counts the rows of a table named users.",
]


def prompt_ids(tokenizer, n: int) -> list[list[int]]:
    out = []
    for text in (PROMPTS * (n // len(PROMPTS) + 1))[:n]:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(text).input_ids
        out.append(list(ids))
    return out


def hf_greedy(model_path: str, dtype: torch.dtype, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    gguf = gguf_file_of(model_path)
    kwargs = {"gguf_file": os.path.basename(gguf)} if gguf else {}
    folder = os.path.dirname(os.path.abspath(gguf)) if gguf else model_path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **kwargs).eval()
    model.generation_config.eos_token_id = None  # always max_new_tokens tokens, as ignore_eos below
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def our_greedy(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
    return [o["output_ids"] for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="GGUF file or Hugging Face folder")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both sides' dtype")
    ap.add_argument("--prompts", type=int, default=12, help="number of chat prompts (default 12)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per prompt (default 32)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    engine = Engine(model_path=args.model_path, dtype=args.dtype, log_level="warning")
    try:
        prompts = prompt_ids(engine.tokenizer, args.prompts)
        ours = our_greedy(engine, prompts, args.max_new_tokens)
        tokenizer = engine.tokenizer
    finally:
        engine.shutdown()
    t1 = time.perf_counter()
    ref = hf_greedy(args.model_path, getattr(torch, args.dtype), prompts, args.max_new_tokens)
    t2 = time.perf_counter()

    rows = []
    for i, (p, a, b) in enumerate(zip(prompts, ours, ref)):
        div = first_divergence(a, b)
        rows.append({"prompt": PROMPTS[i % len(PROMPTS)], "prompt_tokens": len(p), "equal": a == b,
                     "first_divergence": div, "ours": a, "hf": b, "ours_text": tokenizer.decode(a)})
        print(f"[{i}] {'equal' if a == b else f'DIFFER at token {div}'}: {tokenizer.decode(a)[:70]!r}")
    n_equal = sum(r["equal"] for r in rows)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(os.path.normpath(args.model_path)))
    report = {"args": vars(args), "machine": machine(), "equal": n_equal, "prompts": len(rows),
              "seconds": {"ours": round(t1 - t0, 1), "hf": round(t2 - t1, 1)}, "rows": rows}
    table = "\n".join([
        f"# Greedy tokens: ours vs transformers, {os.path.basename(args.model_path)} ({args.dtype})",
        "",
        f"{n_equal} of {len(rows)} prompts give transformers' greedy tokens ({args.max_new_tokens} tokens each, "
        f"EOS ignored). Machine: {machine()}.",
        "",
        f"Command: `python benchmark/check_hf_parity.py --model-path {args.model_path} --dtype {args.dtype} "
        f"--prompts {args.prompts} --max-new-tokens {args.max_new_tokens}`",
        "",
        "| # | prompt | equal | first divergence | our output (start) |",
        "|---|---|---|---|---|",
        *[f"| {i} | {r['prompt']} | {'yes' if r['equal'] else 'no'} | {r['first_divergence'] if r['first_divergence'] is not None else '-'} "
          f"| {r['ours_text'][:60].replace(chr(10), ' ').replace('|', chr(92) + '|')} |" for i, r in enumerate(rows)],
    ])
    write_results(f"hf_parity_{name}", report, table)


if __name__ == "__main__":
    main()
