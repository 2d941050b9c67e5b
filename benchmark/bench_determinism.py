"""What deterministic inference (the default) costs: tokens/s with it and with
--disable-deterministic-inference, prefill and decode apart, at several batch sizes, in full mode (and
VeriCache with --modes), on the bundled model and any --model-path, in one run, medians of --repeats
(runs interleaved, so drift hits every cell alike).

    PYTHONPATH=python:sgl-kernel-ext/python .venv/bin/python benchmark/bench_determinism.py \
        --model-path /tmp/models/smollm2-hf --dtype bfloat16 --batch-sizes 1 8 32

Prefill tokens/s: prompt tokens over the seconds of the EXTEND forwards; decode tokens/s: decode steps'
tokens over the seconds of the DECODE forwards (scheduling between forwards excluded from both); total:
output tokens over the run's wall time. On a loaded machine the figures are ratios between cells of
the same run only.

It also checks what deterministic inference promises: its outputs at every batch size equal batch 1's
for the same prompts (and VeriCache's equal full mode's); the table says so per row. Results:
benchmark/results/determinism.{json,md}.
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


def forward_rates(r, n_prompt_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) from a run's forward timings."""
    fs = r.metrics["forward_seconds"]
    decode_tokens = sum(len(o) for o in r.outputs) - len(r.outputs)  # each request's first token: prefill's
    return n_prompt_tokens / sum(fs.get("EXTEND", [0.0]) or [1e-9]), decode_tokens / max(sum(fs.get("DECODE", [])), 1e-9)


def write_report(a, models, samples, outputs, repeats_done: int) -> None:
    """Medians of the runs so far, written after every repeat (a cut-short run keeps what it measured)."""
    rows, report = [], {"machine": machine(), "repeats": repeats_done, "dtype": a.dtype, "input_len": a.input_len,
                        "output_len": a.output_len, "results": []}
    for name, _, _, _ in models:
        for bs in a.batch_sizes:
            for mode in a.modes:
                off = [statistics.median(x[i] for x in samples[(name, bs, mode, False)]) for i in range(3)]
                on = [statistics.median(x[i] for x in samples[(name, bs, mode, True)]) for i in range(3)]
                ref = outputs[(name, a.batch_sizes[0], "full", True)]
                got = outputs[(name, bs, mode, True)]
                same = got == ref[: len(got)] if bs <= len(ref) else got[: len(ref)] == ref
                ratios = [x / y for x, y in zip(on, off)]
                report["results"].append({
                    "model": name, "batch_size": bs, "mode": mode,
                    "prefill_tok_s_off": off[0], "prefill_tok_s_on": on[0], "prefill_ratio": ratios[0],
                    "decode_tok_s_off": off[1], "decode_tok_s_on": on[1], "decode_ratio": ratios[1],
                    "total_tok_s_off": off[2], "total_tok_s_on": on[2], "total_ratio": ratios[2],
                    "samples_off": samples[(name, bs, mode, False)], "samples_on": samples[(name, bs, mode, True)],
                    "outputs_equal_smallest_batch_deterministic_full": same})
                rows.append(f"| {name} | {bs} | {mode} | {off[0]:.1f} | {on[0]:.1f} | {ratios[0]:.2f} | {off[1]:.1f} | "
                            f"{on[1]:.1f} | {ratios[1]:.2f} | {ratios[2]:.2f} | {'yes' if same else 'NO'} |")
    table = "\n".join([
        f"# Deterministic inference: cost (greedy, all requests at once, tokens/s, median of {repeats_done})", "",
        f"Machine: {report['machine']}", "",
        f"Command: `PYTHONPATH=python:sgl-kernel-ext/python .venv/bin/python {shlex.join(['benchmark/bench_determinism.py', *sys.argv[1:]])}`", "",
        f"{a.dtype}; each request {a.input_len} prompt + {a.output_len} output tokens. off: "
        "--disable-deterministic-inference; on: the default. Prefill and decode: tokens over the seconds of "
        "those forwards; total: output tokens over the wall time.", "",
        "| model | batch | mode | prefill off | prefill on | on / off | decode off | decode on | on / off | "
        "total on / off | output == batch-1 deterministic full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows])
    write_results(a.out, report, table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="Runs per cell; the median is reported.")
    p.add_argument("--model-path", action="append", default=None,
                   help="Model folder(s) to measure besides the bundled model (repeatable).")
    p.add_argument("--dtype", default="bfloat16", help="Model dtype of every model (default: bfloat16).")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32], help="Concurrent requests per run.")
    p.add_argument("--input-len", type=int, default=64, help="Prompt tokens per request.")
    p.add_argument("--output-len", type=int, default=16, help="Output tokens per request.")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["full"], help="KV modes to run.")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's).")
    p.add_argument("--with-300m", action="store_true", help="Also the ~300M Llama shape (--load-format dummy).")
    p.add_argument("--no-bundled", action="store_true", help="Skip the bundled model.")
    p.add_argument("--out", default="determinism", help="Result file stem under benchmark/results.")
    a = p.parse_args()
    if a.num_threads:
        torch.set_num_threads(a.num_threads)

    # (name, path, load format, vocab)
    models = [] if a.no_bundled else [("vericache-code-tiny", bundled_model_path(), "auto", 4000)]
    for path in a.model_path or []:
        cfg = json.loads((Path(path) / "config.json").read_text())
        models.append((Path(path).name, path, "auto", cfg["vocab_size"]))
    if a.with_300m:
        models.append(("llama-300m (dummy)", llama_300m_dir(), "dummy", 32000))
    if not models:
        p.error("nothing to run: --no-bundled without --model-path or --with-300m")
    cells = [(m, bs, mode, det) for m in models for bs in a.batch_sizes for mode in a.modes for det in (False, True)]
    samples: dict[tuple, list[tuple[float, float, float]]] = {}
    outputs: dict[tuple, list[list[int]]] = {}
    with tqdm(total=len(cells) * a.repeats, desc="runs") as bar:
        for rep in range(a.repeats):
            for (name, path, fmt, vocab), bs, mode, det in cells:
                batch = prompts(vocab, bs, a.input_len)
                flags = dict(MODES[mode])
                if fmt == "dummy" and "speculative_num_draft_tokens" in flags:
                    flags["speculative_num_draft_tokens"] = "2"  # random weights: drafts are rarely accepted
                r = run_mode(path, batch, a.output_len, dtype=a.dtype, load_format=fmt,
                             enable_deterministic_inference=det, max_running_requests=max(bs, 8),
                             chunked_prefill_size=max(2048, bs * a.input_len), **flags)
                key = (name, bs, mode, det)
                samples.setdefault(key, []).append((*forward_rates(r, bs * a.input_len),
                                                    sum(len(o) for o in r.outputs) / r.seconds))
                outputs[key] = r.outputs
                bar.update()

            write_report(a, models, samples, outputs, rep + 1)



if __name__ == "__main__":
    main()
