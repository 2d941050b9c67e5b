"""What the benchmarks share: code prompts from held-out stdlib files, an in-process runner that
drives the scheduler in any KV mode, the machine's description, and result writers."""

from __future__ import annotations

import ast
import gc
import json
import os
import platform
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang_vericache.compress.base import KVZIP_CHUNK_TOKENS
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

RESULTS = Path(__file__).parent / "results"


def machine(threads: bool = True) -> str:
    """The CPU, its cores and torch; with threads, torch's thread count now (benchmarks that run
    processes with different counts say so themselves)."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
    return text + (f" ({torch.get_num_threads()} threads)" if threads else "")


# ---------------------------------------------------------------- prompts


def heldout_files(model_path: str = bundled_model_path()) -> list[Path]:
    """The bundled model's held-out stdlib files (its corpus manifest), as found on this machine."""
    manifest = json.loads((Path(model_path) / "corpus_manifest.json").read_text())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    rels = [f["path"] for f in manifest["heldout"]["files"]]
    return [stdlib / r for r in rels if (stdlib / r).exists()]


@dataclass(frozen=True)
class CodePrompt:
    ids: list[int]
    header: str  # the function's header as it stands in the file (original indentation, no final newline)


def parsed_heldout(model_path: str):
    """(source, its AST) of each held-out file that parses, in manifest order."""
    for path in heldout_files(model_path):
        text = path.read_text(errors="replace")
        try:
            yield text, ast.parse(text)
        except SyntaxError:
            continue


def code_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int,
                 model_path: str = bundled_model_path(), per_file: int = 1) -> list[CodePrompt]:
    """n prompts of [min_tokens, max_tokens] tokens: the source of a held-out file up to and
    including one of its function headers (signature + docstring), so the model writes the body.
    Up to per_file prompts per file (its first such functions), files in manifest order: deterministic."""
    prompts = []
    for text, tree in parsed_heldout(model_path):
        lines = text.splitlines(keepends=True)
        nodes = [x for x in ast.walk(tree) if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))]
        taken = 0
        for node in sorted(nodes, key=lambda x: x.lineno):
            if node.decorator_list or len(node.body) < 2 or ast.get_docstring(node, clean=False) is None:
                continue
            end = node.body[0].end_lineno
            # End at the docstring's closing quotes: this tokenizer merges a newline with the next
            # line's indentation, so a prompt ending in a bare newline is unlike its training text.
            ids = tokenizer("".join(lines[:end]).rstrip("\n")).input_ids
            if len(ids) < min_tokens:
                continue
            prompts.append(CodePrompt(ids[-max_tokens:], "".join(lines[node.lineno - 1 : end]).rstrip("\n")))
            taken += 1
            if taken == per_file or len(prompts) == n:
                break
        if len(prompts) == n:
            break
    return prompts


CHAT_QUESTION = "Explain what the function `{name}` above does, then write it again with type hints."


def chat_prompts(tokenizer, n: int, min_tokens: int, max_tokens: int,
                 model_path: str = bundled_model_path()) -> list[CodePrompt]:
    """n chat prompts of about [min_tokens, max_tokens] tokens: a held-out file's source (its tail, so
    the prompt fits) in a user turn with a question about its last function, in the tokenizer's chat
    template with the assistant's turn opened. Deterministic (files in manifest order)."""
    prompts = []
    for text, tree in parsed_heldout(model_path):
        funcs = [x for x in ast.walk(tree) if isinstance(x, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if not funcs:
            continue
        last = max(funcs, key=lambda x: x.end_lineno)
        src = "".join(text.splitlines(keepends=True)[: last.end_lineno])
        question = CHAT_QUESTION.format(name=last.name)

        def render(body: str) -> list[int]:
            msg = [{"role": "user", "content": f"```python\n{body}\n```\n\n{question}"}]
            return tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]

        ids = render(src)
        if len(ids) < min_tokens:
            continue
        if len(ids) > max_tokens:  # keep the source's tail: cut whole lines from the front
            src_ids = tokenizer(src).input_ids
            src = tokenizer.decode(src_ids[len(src_ids) - (max_tokens - (len(ids) - len(src_ids))):])
            src = src[src.find("\n") + 1:]
            ids = render(src)
        prompts.append(CodePrompt(ids, last.name))
        if len(prompts) == n:
            break
    return prompts


def function_parses(header: str, completion: str) -> bool:
    """Whether header + completion, cut where the body ends (the first non-empty line indented no
    deeper than the def), is a function that ast.parse accepts."""
    indent = len(header) - len(header.lstrip())
    kept = []
    for line in completion.split("\n"):
        if line.strip() and len(line) - len(line.lstrip()) <= indent:
            break
        kept.append(line)
    try:
        ast.parse(textwrap.dedent(header + "\n".join(kept)))
    except SyntaxError:
        return False
    return True


# ---------------------------------------------------------------- running


@dataclass
class RunResult:
    outputs: list[list[int]]
    seconds: float
    metrics: dict


def run_mode(model_path: str, prompts: list[list[int]], max_new_tokens: int, sampling: dict | None = None,
             **server) -> RunResult:
    """All prompts at once through an in-process scheduler in the given mode; greedy by default."""
    # Pools sized to the workload: benchmarks build many schedulers in one process.
    # (kvzip's reconstruction pass holds a chunk's scratch slots of its own)
    scratch = KVZIP_CHUNK_TOKENS + 256 if str(server.get("kv_compressor", "")).startswith("kvzip") else 0
    server.setdefault("max_total_tokens", sum(len(p) + max_new_tokens for p in prompts) + 64 * len(prompts) + scratch)
    args = ServerArgs(model_path=model_path, skip_tokenizer_init=True, **server)
    sched = Scheduler(args)
    sampling = sampling or {"temperature": 0.0}
    reqs = [make_request(f"p{i}", ids, max_new_tokens=max_new_tokens, **sampling) for i, ids in enumerate(prompts)]
    sched.metrics.round_trace = []
    forward_seconds = time_forwards(sched.model_runner)
    t0 = time.perf_counter()
    res = run_to_completion(sched, reqs)
    seconds = time.perf_counter() - t0
    m = sched.metrics
    metrics = {
        "spec_rounds": m.spec_rounds_total,
        "spec_drafted": m.spec_drafted_total,
        "spec_accepted": m.spec_accepted_total,
        "retracted": m.num_retracted_total,
        "draft_rows": m.spec_draft_rows_total,
        "spec_ngram_proposed": m.spec_ngram_proposed_total,
        "spec_ngram_accepted": m.spec_ngram_accepted_total,
        "round_trace": m.round_trace,
        "forward_seconds": forward_seconds,
        # what --kv-compress-scope resolved to (TwoTierKV.resolve_scope); None in full mode
        "scope": None if sched.two_tier is None else "segment" if sched.two_tier.segment_scope else "page",
        "keep_recent": 0 if sched.two_tier is None else sched.two_tier.keep_recent,  # a segment's last tokens kept first
        # what --kv-head-budget resolved to (auto: the method's own, TwoTierKV)
        # a segment's chunks dealt to the layers by per-segment budgets (PyramidKV's, global head budgets)
        "layer_budget": "per segment" if getattr(getattr(sched.two_tier, "compressor", None), "deals_layers", False)
        else "static",
        "head_budget": "uniform" if sched.two_tier is None else getattr(
            getattr(sched.two_tier.compressor, "drop", sched.two_tier.compressor).config, "head_budget", "uniform"),
    }
    rec = getattr(sched.two_tier, "reconstruction", None)
    if rec is not None:  # kvzip: what its reconstruction passes forwarded
        metrics["reconstruction"] = {"forwards": rec.forwards, "tokens": rec.tokens, "seconds": rec.seconds}
    outputs = [res[f"p{i}"].output_ids for i in range(len(prompts))]
    del sched  # its pools are large; free them before the next run builds its own
    gc.collect()
    return RunResult(outputs, seconds, metrics)


def time_forwards(model_runner) -> dict[str, list[float]]:
    """Times every forward of model_runner from now on: -> {forward mode name: [seconds of each forward]}
    (filled in as the forwards run); kvzip's reconstruction passes under "RECONSTRUCT"."""
    seconds: dict[str, list[float]] = {}
    forward = model_runner.forward

    def timed(fb, *args, **kwargs):
        t0 = time.perf_counter()
        out = forward(fb, *args, **kwargs)
        # kvzip's reconstruction pass (an EXTEND that captures keys) is timed apart from the prefill
        name = "RECONSTRUCT" if getattr(fb, "captured_k", None) is not None else fb.forward_mode.name
        seconds.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    model_runner.forward = timed
    return seconds


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def merge_rows(name: str, report: dict, key, settings: tuple[str, ...]) -> dict:
    """report with the rows of results/<name>.json it did not rerun kept in front (--merge): a rerun
    row replaces the stored row of the same key(row); settings (args that change every number) must
    match the stored run's, else ValueError. report["args"]["compressors"] becomes the union."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        return report
    old = json.loads(path.read_text())
    differ = [s for s in settings if old["args"].get(s) != report["args"].get(s)]
    if differ:
        raise ValueError(f"--merge: {path} was run with other {', '.join(differ)}: "
                         + ", ".join(f"{s}={old['args'].get(s)!r}" for s in differ))
    new_keys = {key(r) for r in report["rows"]}
    kept = [r for r in old["rows"] if key(r) not in new_keys]
    args = dict(report["args"])
    args["compressors"] = list(dict.fromkeys(old["args"]["compressors"] + args["compressors"]))
    return {**report, "args": args, "rows": kept + report["rows"], "merged_from": str(path)}


def write_results(name: str, report: dict, table: str) -> None:
    """results/<name>.json and .md; paths inside this checkout are written relative to it (a result
    names no machine's folders)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    root = str(RESULTS.resolve().parents[1]) + "/"
    (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=2).replace(root, ""))
    (RESULTS / f"{name}.md").write_text(table.replace(root, "") + "\n")
    print(table)
    print(f"\nwrote {RESULTS / name}.json and .md")
