"""How often outputs differ where they must not: issue 14's checks, with and without
--enable-deterministic-inference, in float32 and bfloat16 (greedy, 96 new tokens, 24 code prompts
of mixed length from the bundled model's held-out files, all at once).

    .venv/bin/python benchmark/bench_exactness.py        # ~15 min on 2 cores

Rows: VeriCache (snapkv 4x, int8) == full mode: tokens, and tokens + logprobs; full mode under load
(the 24 prompts with 8 more requests, 4 of them aborted after 5 steps) == each prompt asked alone.
Results: benchmark/results/exactness.{json,md}.
"""

from __future__ import annotations

import argparse

from tqdm import tqdm
from transformers import AutoTokenizer

from common import code_prompts, machine, write_results
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

MODES = {
    "full": {},
    "vericache snapkv": {"kv_compressor": "snapkv", "speculative_algorithm": "VERICACHE"},
    "vericache int8": {"kv_compressor": "int8", "speculative_algorithm": "VERICACHE"},
}


def outputs(server: dict, prompts, new: int, crowd=(), abort_at=None, alone=False):
    """(tokens, logprobs) per prompt: all at once (with the crowd), or one after another (alone)."""
    sched = Scheduler(ServerArgs(skip_tokenizer_init=True, **server))
    reqs = [make_request(f"t{i}", ids, return_logprob=True, max_new_tokens=new, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(prompts)]
    extra = [make_request(f"c{i}", ids, max_new_tokens=2 * new, temperature=0.0, ignore_eos=True)
             for i, ids in enumerate(crowd)]
    if alone:
        res = {}
        for r in reqs:
            res.update(run_to_completion(sched, [r]))
    else:
        res = run_to_completion(sched, [*reqs, *extra], abort_at=abort_at)
    return [(res[r.rid].output_ids, res[r.rid].output_token_logprobs) for r in reqs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="Prompts compared.")
    p.add_argument("--new-tokens", type=int, default=96, help="Greedy output tokens per prompt.")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], help="Model dtypes.")
    a = p.parse_args()
    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    # up to 3 functions per held-out file: one per file gives only 14 prompts
    pool = [c.ids for c in code_prompts(tok, a.prompts + 8, 24, 400, per_file=3)]
    prompts, crowd = pool[: len(pool) - 8], pool[len(pool) - 8 :]  # the held-out files may give fewer
    rows, report = [], {"machine": machine(), "prompts": len(prompts), "new_tokens": a.new_tokens, "results": []}
    cells = [(d, det) for d in a.dtypes for det in (False, True)]
    with tqdm(total=len(cells) * (len(MODES) + 2), desc="runs") as bar:
        for dtype, det in cells:
            base = {"dtype": dtype, "enable_deterministic_inference": det}
            got = {}
            for mode, flags in MODES.items():
                got[mode] = outputs({**base, **flags}, prompts, a.new_tokens)
                bar.update()
            alone = outputs(base, prompts, a.new_tokens, alone=True)
            bar.update()
            loaded = outputs(base, prompts, a.new_tokens, crowd, abort_at={5: [f"c{i}" for i in range(4)]})
            bar.update()
            checks = {f"{m} == full": got[m] for m in MODES if m != "full"}
            checks["full under load (8 more, 4 aborted) == alone"] = loaded
            for name, other in checks.items():
                ref = alone if name.startswith("full under load") else got["full"]
                tokens = sum(x[0] == y[0] for x, y in zip(ref, other))
                both = sum(x == y for x, y in zip(ref, other))
                report["results"].append({"dtype": dtype, "deterministic": det, "check": name,
                                          "tokens_equal": tokens, "tokens_and_logprobs_equal": both,
                                          "of": len(prompts)})
                rows.append(f"| {name} | {dtype} | {'on' if det else 'off'} | {tokens}/{len(prompts)} | "
                            f"{both}/{len(prompts)} |")
            table = "\n".join([  # written after every (dtype, flag) cell
                f"# Exactness: {len(prompts)} code prompts, greedy, {a.new_tokens} new tokens, bundled model", "",
                f"Machine: {report['machine']}", "",
                "| check | dtype | deterministic inference | tokens equal | tokens and logprobs equal |",
                "| --- | --- | --- | --- | --- |", *rows])
            write_results("exactness", report, table)


if __name__ == "__main__":
    main()
