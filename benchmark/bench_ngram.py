"""N-gram drafting composed with VeriCache (--speculative-ngram) on code: forward passes per emitted
token and tokens/s against plain VeriCache and deterministic full mode, medians of --repeats runs.

    .venv/bin/python benchmark/bench_ngram.py                      # snapkv 4x and kivi4, X = 16
    .venv/bin/python benchmark/bench_ngram.py --dtype float32 --out ngram_fp32

Every mode runs deterministic inference (in the checkpoint's bfloat16 unless --dtype float32), so
VeriCache (with or without n-gram proposals) must give full mode's output bitwise; the table says
whether it did. N-gram
drafting runs exactly plain VeriCache's rounds (the same drafts; only the draft forwards that hold
them differ), so tokens per round are equal by construction and the table shows the forwards.

Forwards per emitted token: decode-phase forward passes (DECODE in full mode; DRAFT_DECODE and
TARGET_VERIFY in VeriCache; prefill not counted) over output tokens. tokens/s: output tokens over the
run's wall time, prefill included. Writes benchmark/results/<out>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics


from common import code_prompts, machine, run_mode, write_results
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.server_args import QUANTIZING_COMPRESSORS as QUANTIZERS
from sglang_vericache.server_args import bundled_model_path

DECODE_MODES = ("DECODE", "DRAFT_DECODE", "TARGET_VERIFY", "MIXED")


def measure(args, ids, repeats: int, **mode) -> dict:
    """repeats runs of one mode -> medians and the first run's outputs and counters."""
    runs = [run_mode(args.model_path, ids, args.max_new_tokens, {"temperature": 0.0, "ignore_eos": True},
                     page_size=args.page_size, dtype=args.dtype, enable_deterministic_inference=True,
                     max_running_requests=len(ids), **mode) for _ in range(repeats)]
    first = runs[0]
    m = first.metrics
    emitted = sum(map(len, first.outputs))
    counts = {k: len(v) for k, v in m["forward_seconds"].items()}
    return {
        "outputs": first.outputs,
        "emitted": emitted,
        "forwards": {k: counts.get(k, 0) for k in DECODE_MODES if counts.get(k)},
        "forwards_per_token": sum(counts.get(k, 0) for k in DECODE_MODES) / emitted,
        "draft_forwards_per_token": counts.get("DRAFT_DECODE", 0) / emitted,
        "draft_rows_per_forward": m.get("draft_rows", 0) / max(counts.get("DRAFT_DECODE", 0), 1),
        "rounds": m["spec_rounds"],
        "accept_length": (m["spec_accepted"] + m["spec_rounds"]) / max(m["spec_rounds"], 1),
        "ngram_proposed": m.get("spec_ngram_proposed", 0),
        "ngram_accepted": m.get("spec_ngram_accepted", 0),
        "tokens_per_s": statistics.median(emitted / r.seconds for r in runs),
        "seconds": [r.seconds for r in runs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--compressors", nargs="+", default=["snapkv", "kivi4"], help="Compressors to draft over.")
    p.add_argument("--ratio", type=float, default=4.0, help="Compression ratio of token-dropping compressors.")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[16], help="Draft lengths X.")
    p.add_argument("--num-prompts", type=int, default=4, help="Code prompts (held-out stdlib files), run at once.")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[128, 512], metavar=("MIN", "MAX"),
                   help="Prompt length range in tokens.")
    p.add_argument("--max-new-tokens", type=int, default=96, help="Greedy tokens generated per prompt.")
    p.add_argument("--page-size", type=int, default=16, help="Page = compression chunk size.")
    p.add_argument("--repeats", type=int, default=3, help="Runs per mode; tokens/s is their median.")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="Compute dtype (bfloat16: the checkpoint's). On an AVX2 CPU a bfloat16 row costs several "
                        "times a float32 one, so the rows n-gram proposals add cost more there.")
    p.add_argument("--branch-length", type=int, default=8, help="--speculative-ngram-branch-length.")
    p.add_argument("--min-window", type=int, default=1, help="--speculative-ngram-min-match-window-size.")
    p.add_argument("--out", default="ngram", help="Results name under benchmark/results.")
    args = p.parse_args()

    tok = get_tokenizer(args.model_path)
    ids = [c.ids for c in code_prompts(tok, args.num_prompts, *args.prompt_tokens, model_path=args.model_path)]
    full = measure(args, ids, args.repeats)
    rows = [{"mode": "full", "compressor": "-", "draft_tokens": None, **full, "identical_to_full": True}]
    ngram = dict(speculative_ngram=True, speculative_ngram_branch_length=args.branch_length,
                 speculative_ngram_min_match_window_size=args.min_window)
    for name in args.compressors:
        # lock-step rounds: the rows compare drafting, not the adaptive schedule's choice to run rounds at all
        comp = dict(kv_compressor=name, kv_compression_ratio=args.ratio, speculative_algorithm="VERICACHE",
                    vericache_schedule="lockstep")
        for x in args.draft_tokens:
            for label, extra in (("vericache", {}), ("vericache+ngram", ngram)):
                r = measure(args, ids, args.repeats, speculative_num_draft_tokens=str(x), **comp, **extra)
                rows.append({"mode": label, "compressor": name if name in QUANTIZERS else f"{name} {args.ratio:g}x",
                             "draft_tokens": x, **r, "identical_to_full": r["outputs"] == full["outputs"]})
    for r in rows:
        del r["outputs"]

    lines = [
        f"N-gram drafting composed with VeriCache: {args.model_path}",
        f"{len(ids)} held-out code prompts ({args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens) at once, "
        f"{args.max_new_tokens} greedy tokens each, page {args.page_size}, {args.dtype}, deterministic inference, "
        "lock-step rounds; "
        f"n-gram windows {args.min_window}-12, branch length {args.branch_length}; machine: {machine()}",
        f"tokens/s: median of {args.repeats} runs on a 2-core machine shared with other jobs (ratios between rows "
        "of this run only). Forwards: decode-phase forward passes per output token (prefill not counted).",
        "",
        "| mode | compressor | X | tokens/round | forwards / token | draft forwards / token | draft rows / "
        "draft forward | proposal tokens taken | tokens/s | output = full |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        x = "-" if r["draft_tokens"] is None else r["draft_tokens"]
        tpr = "-" if r["mode"] == "full" else f"{r['accept_length']:.2f}"
        dpt = "-" if r["mode"] == "full" else f"{r['draft_forwards_per_token']:.3f}"
        rows_per = "-" if r["mode"] == "full" else f"{r['draft_rows_per_forward']:.1f}"
        taken = f"{r['ngram_accepted']} of {r['ngram_proposed']}" if r["ngram_proposed"] else "-"
        lines.append(f"| {r['mode']} | {r['compressor']} | {x} | {tpr} | {r['forwards_per_token']:.3f} | {dpt} | "
                     f"{rows_per} | {taken} | {r['tokens_per_s']:.1f} | {'yes' if r['identical_to_full'] else 'NO'} |")
    report = {"model_path": args.model_path, "machine": machine(), "args": vars(args), "rows": rows}
    write_results(args.out, report, "\n".join(lines))


if __name__ == "__main__":
    main()
