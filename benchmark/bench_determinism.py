"""What --enable-deterministic-inference costs: output tokens/s with and without it, in full mode and
VeriCache, on the bundled model and on a ~300M-parameter Llama shape (--load-format dummy), in one
run, medians of --repeats (runs interleaved, so drift hits every mode alike).

    PYTHONPATH=python:sgl-kernel-ext/python .venv/bin/python benchmark/bench_determinism.py   # ~6 min on 2 cores

(the defaults are the published table's: 8 x (256 + 64) on the bundled model, torch's default
threads). On a loaded machine the figures are ratios between modes of the same run only.

It also checks what the flag promises: with it on, VeriCache's output equals full mode's token for
token; the table says so per model. Results: benchmark/results/determinism.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from common import machine, run_mode, write_results
from sglang_vericache.server_args import bundled_model_path

# A Llama shape of ~0.3B parameters (20 layers, hidden 1024, GQA 16/8), weights drawn at load.
LLAMA_300M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 8,
    "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}

MODES = {  # name -> server flags (deterministic inference set per column)
    "full": {},
    "vericache": {"kv_compressor": "snapkv", "speculative_algorithm": "VERICACHE",
                  "speculative_num_draft_tokens": "8", "vericache_schedule": "lockstep"},  # rounds measured
}


def llama_300m_dir() -> str:
    d = Path(tempfile.mkdtemp(prefix="llama300m-"))
    (d / "config.json").write_text(json.dumps(LLAMA_300M))
    return str(d)


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 4000), (length,), generator=g).tolist() for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="Runs per (model, mode, flag); the median is reported.")
    p.add_argument("--requests", type=int, default=8, help="Concurrent requests per run.")
    p.add_argument("--input-len", type=int, default=256, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=64, help="Output tokens per request.")
    p.add_argument("--skip-300m", action="store_true", help="Only the bundled model.")
    p.add_argument("--only-300m", action="store_true", help="Only the 300M Llama shape (e.g. with more --repeats).")
    p.add_argument("--out", default="determinism", help="Result file stem under benchmark/results.")
    a = p.parse_args()

    # (name, path, dtype, load format, vocab, requests, input len, output len)
    tiny = (bundled_model_path(), a.requests, a.input_len, a.output_len)
    if a.skip_300m and a.only_300m:
        p.error("--skip-300m and --only-300m leave nothing to run")
    models = [] if a.only_300m else [("vericache-code-tiny", tiny[0], "bfloat16", "auto", 4000, *tiny[1:]),
                                     ("vericache-code-tiny", tiny[0], "float32", "auto", 4000, *tiny[1:])]
    if not a.skip_300m:  # a quarter of the tokens: its forwards cost ~40x the bundled model's
        models.append(("llama-300m (dummy)", llama_300m_dir(), "float32", "dummy", 32000,
                       max(1, a.requests // 2), max(16, a.input_len // 4), max(8, a.output_len // 4)))
    cells = [(m, mode, det) for m in models for mode in MODES for det in (False, True)]
    samples: dict[tuple, list[float]] = {}
    outputs: dict[tuple, list[list[int]]] = {}
    with tqdm(total=len(cells) * a.repeats, desc="runs") as bar:
        for rep in range(a.repeats):
            for (name, path, dtype, fmt, vocab, n, input_len, output_len), mode, det in cells:
                batch = prompts(vocab, n, input_len)
                flags = dict(MODES[mode])
                if fmt == "dummy" and "speculative_num_draft_tokens" in flags:
                    flags["speculative_num_draft_tokens"] = "2"  # random weights: drafts are rarely accepted
                r = run_mode(path, batch, output_len, dtype=dtype, load_format=fmt,
                             enable_deterministic_inference=det, **flags)
                key = (name, dtype, mode, det)
                samples.setdefault(key, []).append(n * output_len / r.seconds)
                outputs[key] = r.outputs
                bar.update()

    rows, report = [], {"machine": machine(), "repeats": a.repeats, "requests": a.requests,
                        "input_len": a.input_len, "output_len": a.output_len, "results": []}
    for name, _, dtype, _, _, n, input_len, output_len in models:
        for mode in MODES:
            off = statistics.median(samples[(name, dtype, mode, False)])
            on = statistics.median(samples[(name, dtype, mode, True)])
            same = outputs[(name, dtype, mode, True)] == outputs[(name, dtype, "full", True)]
            report["results"].append({"model": name, "dtype": dtype, "mode": mode, "requests": n,
                                      "input_len": input_len, "output_len": output_len, "tok_s_off": off,
                                      "tok_s_on": on, "ratio_on_to_off": on / off,
                                      "samples_off": samples[(name, dtype, mode, False)],
                                      "samples_on": samples[(name, dtype, mode, True)],
                                      "output_equals_deterministic_full": same})
            rows.append(f"| {name} | {dtype} | {n} x ({input_len} + {output_len}) | {mode} | {off:.1f} | {on:.1f} | {on / off:.2f}x | "
                        f"{'yes' if same else 'NO'} |")
    table = "\n".join([
        f"# Deterministic inference: cost (greedy, all requests at once, output tokens/s, median of {a.repeats})", "",
        f"Machine: {report['machine']}", "",
        f"Command: `PYTHONPATH=python:sgl-kernel-ext/python .venv/bin/python {shlex.join(['benchmark/bench_determinism.py', *sys.argv[1:]])}`", "",
        "| model | dtype | requests x (in + out) | mode | tok/s off | tok/s on | on / off | "
        "output == deterministic full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |", *rows])
    write_results(a.out, report, table)


if __name__ == "__main__":
    main()
