"""VeriCache equals deterministic full mode bitwise on a checkpoint of your choice: every compressor
under every VeriCache schedule, tokens and logprobs, a mixed batch of long and short code prompts.

    .venv/bin/python benchmark/bench_exactness_compressors.py --model-path /path/to/SmolLM2-135M-Instruct \\
        --dtype bfloat16 --prompt-lengths 8000 2000 600 150 --new-tokens 12

Prompts: held-out stdlib source (the bundled model's corpus manifest) up to a function's docstring,
cut to the last N tokens for each --prompt-lengths N (prompts at least that long are taken, then cut),
all in one batch, greedy and seeded, with logprobs. Each compressor x schedule x sampling is a fresh in-process scheduler;
full mode runs once, with --enable-deterministic-inference, as the reference. A row that differs
names the prompt and the first token index where it does.

Writes benchmark/results/<out>.{json,md}.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from tqdm import tqdm

from common import code_prompts, first_divergence, machine, write_results
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

SCHEDULES = ("adaptive", "lockstep", "staggered")
# greedy, and seeded sampling (each request its own seed): the model card's knobs of the default model
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.7, "top_p": 0.9, "top_k": 50}}


def prompts_of(tok, lengths: list[int]) -> list[list[int]]:
    """One held-out code prompt per length: the first prompt at least that long, cut to its last N tokens."""
    out = []
    for n in lengths:
        found = code_prompts(tok, 1, n, n, model_path=bundled_model_path())  # manifest of the bundled model
        if not found:
            raise SystemExit(f"no held-out file gives a code prompt of {n} tokens")
        out.append(found[0].ids)
    return out


def outputs(server: dict, prompts: list[list[int]], new: int, sampling: str) -> tuple[list[tuple], dict, float]:
    """(tokens, logprobs) per prompt, the scheduler's VeriCache counters, seconds."""
    total = sum(len(p) + new for p in prompts) + 64 * len(prompts) + 4096  # + kvzip's replay scratch
    sched = Scheduler(ServerArgs(skip_tokenizer_init=True, max_total_tokens=total,
                                 max_running_requests=len(prompts), **server))
    reqs = [make_request(f"t{i}", ids, return_logprob=True, max_new_tokens=new, ignore_eos=True, seed=1000 + i,
                         **SAMPLINGS[sampling]) for i, ids in enumerate(prompts)]
    t0 = time.perf_counter()
    res = run_to_completion(sched, reqs)
    seconds = time.perf_counter() - t0
    m = sched.metrics
    counters = {"spec_rounds": m.spec_rounds_total, "spec_drafted": m.spec_drafted_total,
                "spec_accepted": m.spec_accepted_total}
    return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in reqs], counters, seconds


def compare(ref: list[tuple], got: list[tuple]) -> dict:
    tokens = [a[0] == b[0] for a, b in zip(ref, got)]
    both = [a == b for a, b in zip(ref, got)]
    first = {i: first_divergence(a[0], b[0]) for i, (a, b) in enumerate(zip(ref, got)) if a[0] != b[0]}
    logprob_first = {i: next(k for k, (x, y) in enumerate(zip(a[1], b[1])) if x != y)
                     for i, (a, b) in enumerate(zip(ref, got)) if a[0] == b[0] and a != b}
    return {"tokens_equal": sum(tokens), "tokens_and_logprobs_equal": sum(both), "of": len(ref),
            "token_divergence": first, "logprob_divergence": logprob_first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Checkpoint (default: the bundled model).")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"),
                   help="Model and KV dtype (default: bfloat16).")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[8000, 2000, 600, 150],
                   help="Prompt lengths in tokens, one prompt each, all in one batch (default: 8000 2000 600 150).")
    p.add_argument("--new-tokens", type=int, default=12, help="Output tokens per prompt (default: 12).")
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSOR_NAMES),
                   help="Compressors (default: every registered one).")
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES,
                   help="VeriCache schedules (default: all three).")
    p.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=SAMPLINGS,
                   help="greedy, and seeded (temperature 0.7, top_p 0.9, top_k 50, a seed per request) "
                        "(default: both).")
    p.add_argument("--ratio", type=float, default=4.0, help="Ratio of the token-dropping compressors (default: 4).")
    p.add_argument("--draft-tokens", default="8", help="Draft tokens per round X (default: 8).")
    p.add_argument("--page-size", type=int, default=32, help="Page = compression chunk size (default: 32).")
    p.add_argument("--kv-compress-scope", default="auto", choices=("auto", "segment", "page"),
                   help="What a token dropper ranks over (default: auto, the server's default).")
    p.add_argument("--out", default="exactness_compressors", help="Results name under benchmark/results.")
    a = p.parse_args()
    tok = get_tokenizer(a.model_path)
    prompts = prompts_of(tok, a.prompt_lengths)
    base = {"model_path": a.model_path, "dtype": a.dtype, "page_size": a.page_size,
            "enable_deterministic_inference": True}
    refs = {s: outputs(base, prompts, a.new_tokens, s) for s in a.samplings}
    report = {"machine": machine(), "command": shlex.join(["python", *sys.argv]), "args": vars(a),
              "prompt_tokens": [len(x) for x in prompts],
              "full_seconds": sum(seconds for _, _, seconds in refs.values()), "rows": []}
    configs = [(c, s, m) for c in a.compressors for s in a.schedules for m in a.samplings]
    for comp, schedule, sampling in tqdm(configs, desc="vericache runs"):
        server = {**base, "kv_compressor": comp, "kv_compression_ratio": a.ratio,
                  "speculative_algorithm": "VERICACHE", "vericache_schedule": schedule,
                  "speculative_num_draft_tokens": a.draft_tokens, "kv_compress_scope": a.kv_compress_scope}
        got, counters, seconds = outputs(server, prompts, a.new_tokens, sampling)
        row = {"compressor": comp, "schedule": schedule, "sampling": sampling, **compare(refs[sampling][0], got),
               **counters, "seconds": seconds}
        report["rows"].append(row)
        if row["tokens_and_logprobs_equal"] != row["of"]:
            tqdm.write(f"{comp} {schedule} {sampling}: DIFFERS {row['token_divergence']} {row['logprob_divergence']}")
        write_results(a.out, report, table(report))  # after every run: a cut-short run keeps its rows


def table(report: dict) -> str:
    a = report["args"]
    rows = report["rows"]
    exact = sum(r["tokens_and_logprobs_equal"] == r["of"] for r in rows)
    lines = [
        f"# VeriCache == deterministic full mode: {Path(a['model_path']).name}, {a['dtype']}", "",
        f"Machine: {report['machine']}. Command: `{report['command']}`", "",
        f"One batch of {len(report['prompt_tokens'])} held-out code prompts of {report['prompt_tokens']} tokens, "
        f"{' and '.join(a.get('samplings', ['greedy']))} ({SAMPLINGS['seeded']} with a seed per request when "
        f"seeded), {a['new_tokens']} new tokens each with logprobs; token dropping at {a['ratio']:g}x, X = "
        f"{a['draft_tokens']}, page {a['page_size']}. Reference: full mode with --enable-deterministic-inference "
        f"({report['full_seconds']:.0f} s).", "",
        f"**{exact} of {len(rows)} runs give full mode's tokens and logprobs bitwise for every prompt.**", "",
        "| compressor | schedule | sampling | tokens equal | tokens and logprobs equal | rounds | tokens/round | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        tpr = "-" if not r["spec_rounds"] else f"{(r['spec_accepted'] + r['spec_rounds']) / r['spec_rounds']:.2f}"
        lines.append(f"| {r['compressor']} | {r['schedule']} | {r.get('sampling', 'greedy')} | {r['tokens_equal']}/{r['of']} | "
                     f"{r['tokens_and_logprobs_equal']}/{r['of']} | {r['spec_rounds']} | {tpr} | {r['seconds']:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
