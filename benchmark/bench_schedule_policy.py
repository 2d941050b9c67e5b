"""--schedule-policy fcfs vs lpm on requests that share prefixes, in one run.

    .venv/bin/python benchmark/bench_schedule_policy.py

G groups of K requests; a group's requests share a long prefix and differ in a short suffix.
They arrive interleaved (group 0, 1, ..., G-1, 0, 1, ...), all at once, into a KV pool that holds
only a few prefixes next to the running requests. First come, first served then admits requests
of every group together and evicts each prefix before the rest of its group comes; longest
prefix match admits the rest of a group while its prefix is cached. Reported per policy (median
of --repeats runs, each on a fresh scheduler): output tokens/s, its ratio to fcfs, prompt tokens
served from the radix cache, prompt tokens prefilled, and whether every output equals fcfs's.
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm import tqdm

from common import machine, write_results
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request, random_prompts, run_to_completion

POLICIES = ("fcfs", "lpm")


def workload(groups: int, per_group: int, prefix_len: int, suffix_len: int, seed: int = 0) -> list[list[int]]:
    """Prompts in arrival order: round-robin over the groups."""
    prefixes = random_prompts([prefix_len] * groups, seed=seed)
    suffixes = random_prompts([suffix_len] * (groups * per_group), seed=seed + 1)
    return [prefixes[g] + suffixes[k * groups + g] for k in range(per_group) for g in range(groups)]


def run_policy(args, policy: str, prompts: list[list[int]]) -> dict:
    sched = Scheduler(ServerArgs(
        model_path=args.model_path, dtype=args.dtype, skip_tokenizer_init=True, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
        schedule_policy=policy))
    reqs = [make_request(f"r{i}", ids, max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(prompts)]
    t0 = time.perf_counter()
    res = run_to_completion(sched, reqs)
    seconds = time.perf_counter() - t0
    outputs = [res[f"r{i}"].output_ids for i in range(len(prompts))]
    cached = sum(res[f"r{i}"].cached_tokens for i in range(len(prompts)))
    return {"seconds": seconds, "outputs": outputs, "cached_tokens": cached,
            "output_tokens": sum(len(o) for o in outputs)}


def run(args) -> dict:
    prompts = workload(args.groups, args.per_group, args.prefix_len, args.suffix_len)
    prompt_tokens = sum(len(p) for p in prompts)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for policy in POLICIES:  # interleaved, so both policies see the same machine state
            runs[policy].append(run_policy(args, policy, prompts))
    rows = []
    for policy in POLICIES:
        tok_s = [r["output_tokens"] / r["seconds"] for r in runs[policy]]
        first = runs[policy][0]
        rows.append({
            "policy": policy,
            "median_tok_s": statistics.median(tok_s),
            "runs_tok_s": tok_s,
            "cached_tokens": first["cached_tokens"],
            "prefilled_tokens": prompt_tokens - first["cached_tokens"],
            "outputs_equal_fcfs": all(r["outputs"] == runs["fcfs"][0]["outputs"] for r in runs[policy]),
        })
    base = rows[0]["median_tok_s"]
    for row in rows:
        row["vs_fcfs"] = row["median_tok_s"] / base
    return {"settings": {k: v for k, v in vars(args).items()}, "prompt_tokens": prompt_tokens,
            "machine": machine(), "rows": rows}


def table(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"Schedule policy: {s['groups']} groups x {s['per_group']} requests ({s['prefix_len']}-token shared "
        f"prefix + {s['suffix_len']}-token suffix, {s['new_tokens']} new tokens), interleaved arrival; KV pool "
        f"{s['max_total_tokens']} tokens, at most {s['max_running_requests']} running; {s['model_path']}",
        f"median of {s['repeats']}; machine: {report['machine']}",
        "",
        "| policy | output tok/s | vs fcfs | prompt tokens cached | prompt tokens prefilled | output = fcfs |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        lines.append(f"| {r['policy']} | {r['median_tok_s']:.1f} | {r['vs_fcfs']:.2f}x | {r['cached_tokens']} | "
                     f"{r['prefilled_tokens']} | {'yes' if r['outputs_equal_fcfs'] else 'NO'} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--dtype", default="float32", help="Model dtype.")
    p.add_argument("--groups", type=int, default=8, help="Groups of requests that share a prefix.")
    p.add_argument("--per-group", type=int, default=6, help="Requests per group.")
    p.add_argument("--prefix-len", type=int, default=768, help="Tokens of each group's shared prefix.")
    p.add_argument("--suffix-len", type=int, default=32, help="Tokens of each request's own suffix.")
    p.add_argument("--new-tokens", type=int, default=16, help="New tokens per request.")
    p.add_argument("--page-size", type=int, default=16, help="KV page size.")
    p.add_argument("--max-total-tokens", type=int, default=4096, help="KV pool size in tokens.")
    p.add_argument("--max-running-requests", type=int, default=4, help="Requests running at once.")
    p.add_argument("--repeats", type=int, default=3, help="Runs per policy (the median is reported).")
    p.add_argument("--name", default="schedule_policy", help="Results file name under benchmark/results/.")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    report = run(args)
    for row in report["rows"]:
        row.pop("outputs", None)
    write_results(args.name, report, table(report))


if __name__ == "__main__":
    main()
