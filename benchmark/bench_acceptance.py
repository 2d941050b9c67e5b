"""VeriCache acceptance on code: for each compressor, ratio and draft length, the mean tokens
emitted per round, the acceptance rate, and output identity with full KV, beside lossy mode.

    .venv/bin/python benchmark/bench_acceptance.py                 # ratios 2 4 8, X = 8 16 30
    .venv/bin/python benchmark/bench_acceptance.py --compressors kvquant3 snapkv+kivi4 --ratios 4 --merge
    .venv/bin/python benchmark/bench_acceptance.py --model-path /tmp/models/smollm2-hf --dtype bfloat16 \
        --page-size 16 --prompt-kinds code chat --context-tokens 1024 4096 8000 --no-lossy --out acceptance_smollm2

Prompts (`--prompt-kinds`): `code`, a held-out stdlib file up to one of its function headers (the model
writes the body); `chat`, the same source in the model's chat template followed by a question about
one of its functions. `--context-tokens N`: prompts of about N tokens (the file's tail before the
header), one group of rows per size; without it, `--prompt-tokens MIN MAX`.

DROP+QUANT names compose a dropper and a quantizer (the ratio is the dropper's). --merge keeps the
stored rows this run does not redo (same prompts, tokens, page, dtype and model).

Writes benchmark/results/acceptance.{json,md} and acceptance.png (accepted tokens per round
against draft length, one line per compressor at ratio 4).
"""

from __future__ import annotations

import argparse
import json
import statistics

from tqdm import tqdm

from common import (RESULTS, chat_prompts, code_prompts, first_divergence, machine, merge_rows, run_mode,
                    write_results)
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.compress.registry import COMPRESSOR_NAMES
from sglang_vericache.server_args import QUANTIZING_COMPRESSORS as QUANTIZERS
from sglang_vericache.server_args import bundled_model_path

# The paper's same-model drafter, on its models and compressors (Mistral-24B, Qwen-32B, Llama-70B).
PAPER_TOKENS_PER_ROUND = "25-40"


def plot(rows: list[dict], ratio: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    colors = iter(plt.get_cmap("tab20").colors * 4)  # a colour per line; quantizers (page) dashed
    groups = dict.fromkeys((r.get("prompt_kind", "code"), round(statistics.mean(r.get("prompt_tokens") or [0]), -2))
                           for r in rows)
    for kind, size in groups:
        mine = [r for r in rows if (r.get("prompt_kind", "code"),
                                    round(statistics.mean(r.get("prompt_tokens") or [0]), -2)) == (kind, size)]
        for name in dict.fromkeys(r["compressor"] for r in mine):
            pts = [r for r in mine if r["compressor"] == name and r["ratio"] in (ratio, None)]
            pts_by = {}
            for r in pts:
                pts_by.setdefault(scope_label(r), []).append(r)
            for scope, sp in pts_by.items():
                label = f"{name} ({scope})" if len(groups) == 1 else f"{name} ({scope}; {kind}, ~{size:.0f} tokens)"
                ax.plot([r["draft_tokens"] for r in sp], [r["accept_length"] for r in sp], marker="o", label=label,
                        color=next(colors), ls="--" if scope == "page" else "-")
    xs = sorted({r["draft_tokens"] for r in rows})
    ax.plot(xs, [x + 1 for x in xs], ls=":", c="grey", label="all accepted (X + 1)")
    ax.set_xlabel("draft tokens per round (X)")
    ax.set_ylabel("tokens emitted per round")
    ax.set_title(f"VeriCache acceptance: token dropping at {ratio:g}x, quantizers at their own ratio")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def scope_label(row: dict) -> str:
    """A row's scope column: what was ranked at once, and how (rows from before a field existed: its default)."""
    budget = row.get("head_budget", "uniform")
    label = row.get("scope", "page") + ("" if budget == "uniform" else f", {budget}")
    if row.get("layer_budget") == "per segment" and budget != "global":  # PyramidKV's kvpress budgets
        label += ", layer budgets per segment"
    return label + (f", last {row['keep_recent']} kept" if row.get("keep_recent") else "")


def step_ratio(vc_metrics: dict, full_metrics: dict) -> float | None:
    """Mean DRAFT_DECODE forward seconds over the full run's mean DECODE forward seconds (None if either ran none)."""
    draft = vc_metrics["forward_seconds"].get("DRAFT_DECODE")
    full = full_metrics["forward_seconds"].get("DECODE")
    if not draft or not full:
        return None
    return statistics.mean(draft) / statistics.mean(full)


def run_group(args, kind: str, ids: list[list[int]], lo: int, hi: int, save=None) -> list[dict]:
    """Full KV once, then every (compressor, ratio, scope, X) of args on these prompts; save(rows)
    after each run (a long sweep keeps what it measured)."""
    common = dict(page_size=args.page_size, max_running_requests=len(ids), dtype=args.dtype)
    sampling = {"temperature": 0.0, "ignore_eos": True}
    full = None if args.no_full else run_mode(args.model_path, ids, args.max_new_tokens, sampling, **common)
    rows = []
    pairs = [(c, None, "page") if c in QUANTIZERS else (c, r, sc)
             for c in args.compressors for r in args.ratios for sc in args.kv_compress_scopes]
    budget = {} if args.kv_head_budget == "auto" else {"kv_head_budget": args.kv_head_budget}
    if args.kv_keep_recent is not None:
        budget["kv_keep_recent"] = args.kv_keep_recent
    configs = [(c, r, sc, x) for c, r, sc in dict.fromkeys(pairs) for x in args.draft_tokens]
    lossy_identical = {}
    for name, ratio, scope, x in tqdm(configs, desc=f"vericache runs ({kind}, {lo}-{hi} tokens)"):
        comp = dict(kv_compressor=name, kv_compression_ratio=ratio or 4.0, kv_compress_scope=scope,
                    **(budget if name not in QUANTIZERS else {}), **common)
        if not args.no_lossy and full is not None and (name, ratio, scope) not in lossy_identical:
            lossy = run_mode(args.model_path, ids, args.max_new_tokens, sampling, **comp)
            lossy_identical[(name, ratio, scope)] = sum(a == b for a, b in zip(lossy.outputs, full.outputs)) / len(ids)
        vc = run_mode(args.model_path, ids, args.max_new_tokens, sampling, speculative_algorithm="VERICACHE",
                      speculative_num_draft_tokens=str(x), vericache_schedule="lockstep", **comp)  # rounds measured
        m = vc.metrics
        diverged = [] if full is None else [i for i, (a, b) in enumerate(zip(vc.outputs, full.outputs)) if a != b]
        rows.append({
            "prompt_kind": kind, "prompt_tokens": [len(i) for i in ids],
            "compressor": name, "ratio": ratio, "scope": m["scope"], "draft_tokens": x,
            "head_budget": m["head_budget"],
            "layer_budget": m["layer_budget"],
            "keep_recent": m["keep_recent"],
            "rounds": m["spec_rounds"], "drafted": m["spec_drafted"], "accepted": m["spec_accepted"],
            "accept_length": (m["spec_accepted"] + m["spec_rounds"]) / max(m["spec_rounds"], 1),
            "accept_rate": m["spec_accepted"] / max(m["spec_drafted"], 1),
            "identical_to_full": None if full is None else not diverged,
            "first_divergence": [first_divergence(vc.outputs[i], full.outputs[i]) for i in diverged],
            "lossy_identical_share": lossy_identical.get((name, ratio, scope)),
            "seconds": vc.seconds,
            "draft_step_vs_full_step": None if full is None else step_ratio(vc.metrics, full.metrics),
            "round_trace": vc.metrics["round_trace"],  # (drafted, accepted) per round, for project_gpu.py
        })
        if save is not None:
            save(rows)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--compressors", nargs="+", default=list(COMPRESSOR_NAMES), help="Compressors to run.")
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8], help="Compression ratios.")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[8, 16, 30], help="Draft lengths X.")
    p.add_argument("--num-prompts", type=int, default=8, help="Code prompts (held-out stdlib files).")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[256, 1024], metavar=("MIN", "MAX"),
                   help="Prompt length range in tokens.")
    p.add_argument("--prompt-kinds", nargs="+", default=["code"], choices=("code", "chat"),
                   help="Prompt kinds: code (a file up to a function header) or chat (the file and a question "
                        "in the chat template).")
    p.add_argument("--context-tokens", type=int, nargs="+", default=None,
                   help="Prompt sizes in tokens (about; e.g. 1024 4096 8000), one group of rows each "
                        "(default: --prompt-tokens' range).")
    p.add_argument("--no-full", action="store_true",
                   help="Skip the full-KV run (no output = full check: the column reads '-').")
    p.add_argument("--no-lossy", action="store_true", help="Skip the lossy-mode runs (the lossy = full column).")
    p.add_argument("--kv-compress-scopes", nargs="+", default=["auto"], choices=("auto", "page", "segment"),
                   help="--kv-compress-scope values to run each token dropper with (quantizers: once, page): "
                        "page = each page ranked alone (before issue 37), segment = whole prompts.")
    p.add_argument("--kv-head-budget", default="auto", choices=("auto", "uniform", "adaptive", "global"),
                   help="--kv-head-budget of the token droppers (segment scope): uniform (every KV head keeps the "
                        "same count), adaptive (AdaKV: one top-k over the layer's heads; the scope column reads "
                        "'segment, adaptive') or global (one top-k over every layer's heads: 'segment, global'); "
                        "default auto: the server's, each method's own (kvzip, kvzip_proxy and kvzap global).")
    p.add_argument("--kv-keep-recent", type=int, default=None,
                   help="--kv-keep-recent of the token droppers (default: the server's, each method's own: kvzap 128, the "
                        "others 64): a segment's last tokens "
                        "kept first by the methods that rank by a score alone; the scope column reads "
                        "'segment, last N kept' (0: the score alone, as before).")
    p.add_argument("--combine", nargs="+", default=None, metavar="NAME",
                   help="Run nothing: write --out from the rows of results/NAME.json files (runs split across "
                        "processes).")
    p.add_argument("--note", default=None, help="A paragraph added under the table (how the run was cut down).")
    p.add_argument("--max-new-tokens", type=int, default=256, help="Tokens generated per prompt.")
    p.add_argument("--page-size", type=int, default=32, help="Page = compression chunk size.")
    p.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"),
                   help="Compute and KV dtype (auto = the checkpoint's bfloat16). In bfloat16 a verify pass and "
                        "a decode step round differently, so outputs can part from full KV at near-ties.")
    p.add_argument("--merge", action="store_true",
                   help="Keep the rows of results/<out>.json that this run does not redo.")
    p.add_argument("--out", default="acceptance",
                   help="Results name under benchmark/results (a subset run: give it another name).")
    args = p.parse_args()

    if args.combine:
        parts = [json.loads((RESULTS / f"{name}.json").read_text()) for name in args.combine]
        for key in ("model_path", "num_prompts", "prompt_kinds", "context_tokens", "prompt_tokens",
                    "max_new_tokens", "page_size", "dtype"):  # the header describes the runs, not this command
            setattr(args, key, parts[0]["args"][key])
        report = {"model_path": parts[0]["model_path"], "machine": parts[0].get("machine", machine()),
                  "combined_from": args.combine,
                  "args": [part["args"] for part in parts], "rows": [r for part in parts for r in part["rows"]]}
        return write_report(args, report)
    tok = get_tokenizer(args.model_path)
    sizes = [(n, n) for n in args.context_tokens] if args.context_tokens else [tuple(args.prompt_tokens)]
    rows = []
    for kind in args.prompt_kinds:
        for lo, hi in sizes:
            make = code_prompts if kind == "code" else chat_prompts
            ids = [c.ids for c in make(tok, args.num_prompts, lo, hi, model_path=bundled_model_path())]
            if not ids:
                raise SystemExit(f"no {kind} prompt of {lo}-{hi} tokens in the held-out files")
            done = list(rows)
            rows += run_group(args, kind, ids, lo, hi,
                              save=lambda new: write_results(args.out, {"model_path": args.model_path, "partial": True,
                                                                        "args": vars(args), "rows": done + new}, ""))

    report = {"model_path": args.model_path, "machine": machine(), "args": vars(args), "rows": rows}
    write_report(args, report)


def write_report(args, report: dict) -> None:
    if args.merge:
        same = ("num_prompts", "prompt_tokens", "max_new_tokens", "page_size", "dtype", "model_path")
        report = merge_rows(args.out, report, lambda r: (r.get("prompt_kind", "code"), len(r.get("prompt_tokens", [])),
                                                         r["compressor"], r["ratio"], r.get("scope", "page"),
                                                         r.get("head_budget", "uniform"), r.get("layer_budget", "static"),
                                                         r.get("keep_recent", 0),
                                                         r["draft_tokens"]), same)
    rows = report["rows"]
    best = max(rows, key=lambda r: r["accept_length"])
    lines = [
        f"VeriCache acceptance on {' and '.join(args.prompt_kinds)} prompts: {args.model_path}",
        f"{args.num_prompts} held-out prompts per group ({', '.join(args.prompt_kinds)}; "
        f"{args.context_tokens or args.prompt_tokens} tokens), {args.max_new_tokens} greedy tokens each, page {args.page_size}, dtype {args.dtype}; machine: {report.get('machine') or machine()}",
        f"The paper reports {PAPER_TOKENS_PER_ROUND} tokens per round for its same-model drafter (Mistral-24B, "
        f"Qwen-32B, Llama-70B); here the most is {best['accept_length']:.2f} "
        f"({best['compressor']}, X = {best['draft_tokens']}: at most X + 1 = {best['draft_tokens'] + 1}).",
        "",
        "`draft step / full step`: a VeriCache run's mean DRAFT_DECODE forward (every running request drafts "
        "one token) over the full-KV run's mean DECODE forward (same requests).",
        "",
        "| prompts | tokens | compressor | ratio | scope | X | rounds | tokens/round | acceptance rate "
        "| VeriCache output = full | lossy output = full | draft step / full step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ratio = f"{r['ratio']:g}" if r["ratio"] else "-"
        same = {True: "yes", None: "-"}.get(r["identical_to_full"], f"NO at {r['first_divergence']}")
        step = "-" if r.get("draft_step_vs_full_step") is None else f"{r['draft_step_vs_full_step']:.2f}x"
        lossy = "-" if r.get("lossy_identical_share") is None else f"{r['lossy_identical_share']:.0%}"
        toks = r.get("prompt_tokens", [])
        size = f"{min(toks)}-{max(toks)}" if toks else "-"
        scope = scope_label(r)
        lines.append(f"| {r.get('prompt_kind', 'code')} | {size} | {r['compressor']} | {ratio} | {scope} | {r['draft_tokens']} "
                     f"| {r['rounds']} | {r['accept_length']:.2f} | {r['accept_rate']:.0%} | {same} | {lossy} | {step} |")
    if args.note:
        lines += ["", args.note]
    write_results(args.out, report, "\n".join(lines))
    plot(rows, 4.0 if 4.0 in args.ratios else args.ratios[0], RESULTS / f"{args.out}.png")
    print(f"wrote {RESULTS / args.out}.png")


if __name__ == "__main__":
    main()
