"""Remote prefix caching: stored prefixes reused over a slow link, every mode in one run.

    .venv/bin/python benchmark/bench_remote_prefix.py      # defaults: 8 documents x 2 questions

D documents (long held-out code windows) are stored once in a file KV store, both tiers, by a
single VeriCache instance. Then D x Q requests, each a document + a short question, all submitted
at once, go through a fresh instance (empty caches, its own copy of the store) in each mode:
  full-recompute   one full-KV instance without a store: prefills every document itself
  full-slow-store  one full-KV instance that pulls each document's exact KV from the store over the
                   slow link (--kv-store-bandwidth SLOW), then reuses it from its radix cache
  vericache        a drafter (this process) that pulls only the compressed pages over the slow link
                   and drafts, and a verifier (a subprocess) that pulls the exact pages over the fast
                   link, prefills the questions and verifies (--disagg-prefill verifier)
Reports time to first token (median over requests) and output tokens/s per mode (median of
--repeats), their ratios to full-slow-store, output identity with full-recompute, and the bytes each
link carried. The drafter has ONE slow link: the compressed pages from the store and the exact KV the
verifier sends (the questions' KV after its prefill, the committed tokens' KV each round) share it
(--disagg-bandwidth = --kv-store-bandwidth); the verifier's small messages from the drafter (draft
tokens) are not charged.
Threads: the single-instance modes get --threads-single (default 2: the whole machine); the drafter
and the verifier get 1 each.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from tqdm import tqdm

from common import RESULTS, heldout_files, machine, write_results
from sglang_vericache.utils.hf_tokenizer import get_tokenizer
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, bundled_model_path, parse_bytes
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

MODES = ("full-recompute", "full-slow-store", "vericache")


def workload(tok, model_path: str, docs: int, doc_len: int, questions: int, q_len: int):
    """docs disjoint windows of doc_len tokens; each followed by `questions` different windows of q_len."""
    ids: list[int] = []
    need = docs * doc_len + docs * questions * q_len
    for path in heldout_files(model_path):
        ids += tok(path.read_text(errors="replace")).input_ids
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"held-out files give {len(ids)} tokens, fewer than the {need} this workload needs")
    documents = [ids[i * doc_len : (i + 1) * doc_len] for i in range(docs)]
    rest = ids[docs * doc_len :]
    prompts = [documents[d] + rest[(d * questions + q) * q_len : (d * questions + q + 1) * q_len]
               for d in range(docs) for q in range(questions)]
    return documents, prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_args(args, **kw) -> ServerArgs:
    return ServerArgs(model_path=args.model_path, skip_tokenizer_init=True, page_size=args.page_size,
                      dtype=args.dtype, max_running_requests=args.docs * args.questions,
                      chunked_prefill_size=args.chunked_prefill_size, **kw)


def store_documents(args, documents, path: str) -> None:
    """Both tiers of every document's pages, written once by a single VeriCache instance."""
    writer = Scheduler(base_args(args, kv_compressor=args.compressor, speculative_algorithm="VERICACHE",
                                 kv_store="file", kv_store_path=path, num_threads=args.threads_single))
    drive(writer, [make_request(f"w{i}", d, max_new_tokens=1) for i, d in enumerate(documents)])
    st = writer.prefix_store.stats
    print(f"stored {st['exact'].pages_written} exact pages ({st['exact'].bytes_written / 1e6:.1f} MB) and "
          f"{st['compressed'].pages_written} compressed pages ({st['compressed'].bytes_written / 1e6:.1f} MB)")


def drive(sched: Scheduler, reqs) -> tuple[float, dict]:
    """Submits reqs at once, steps to the end; -> (wall seconds, per-rid results). Fails on aborts."""
    t0 = time.perf_counter()
    try:
        res = run_to_completion(sched, reqs)
    except ValueError as e:
        raise SystemExit(f"a request was refused: {e}") from e
    for rid, r in res.items():
        if r.finished_reason["type"] == "abort":
            raise SystemExit(f"request {rid} failed: {r.finished_reason.get('message')}")
    return time.perf_counter() - t0, res


def start_verifier(args, store: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", args.model_path,
           "--dtype", args.dtype, "--page-size", str(args.page_size), "--disagg-role", "verifier",
           "--disagg-port", str(port), "--kv-store", "file", "--kv-store-path", store,
           "--kv-store-bandwidth", args.fast_link, "--num-threads", "1",
           "--max-running-requests", str(args.docs * args.questions),
           "--chunked-prefill-size", str(args.chunked_prefill_size)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    if "verifier ready" not in line:
        proc.kill()
        raise SystemExit(f"the verifier did not start: {line!r}")
    return proc, port


def run_mode(args, name: str, prompts, store: str) -> dict:
    reqs = [make_request(f"r{i}", p, max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts)]
    verifier = None
    if name == "full-recompute":
        sched = Scheduler(base_args(args, num_threads=args.threads_single))
    elif name == "full-slow-store":
        sched = Scheduler(base_args(args, kv_store="file", kv_store_path=store, kv_store_bandwidth=args.slow_link,
                                    num_threads=args.threads_single))
    else:
        verifier, port = start_verifier(args, store)
        sched = Scheduler(base_args(
            args, kv_compressor=args.compressor, speculative_algorithm="VERICACHE",
            speculative_num_draft_tokens=str(args.draft_tokens), disagg_role="drafter", disagg_prefill="verifier",
            verifier_addr=f"tcp://127.0.0.1:{port}", kv_store="file", kv_store_path=store,
            kv_store_bandwidth=args.slow_link, disagg_bandwidth=args.slow_link, num_threads=1))
    try:
        wall, res = drive(sched, reqs)
    finally:
        if verifier is not None:
            verifier.terminate()
            verifier.wait(30)
    recs = [res[f"r{i}"] for i in range(len(prompts))]
    slow_bytes = sched.prefix_store.store.stats.bytes_out if sched.prefix_store is not None else 0
    zmq_bytes = 0  # exact KV the verifier sent: the questions' (prefill) and each round's committed tokens
    if sched.remote_prefill is not None:
        zmq_bytes = sched.remote_prefill.stats["kv_bytes_received"] + sched.spec_worker.stats["round_kv_bytes"]
    m = sched.metrics
    out = {
        "tok_s": sum(len(r.output_ids) for r in recs) / wall,
        "wall_s": wall,
        "ttft_median_s": statistics.median(r.first_token_s for r in recs),
        "outputs": [r.output_ids for r in recs],
        "slow_link_bytes": slow_bytes,
        "verifier_kv_bytes": zmq_bytes,
        "tokens_per_round": (m.spec_accepted_total + m.spec_rounds_total) / m.spec_rounds_total
        if m.spec_rounds_total else None,
    }
    del sched, res
    gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=bundled_model_path(), help="Model folder (default: bundled model).")
    p.add_argument("--docs", type=int, default=8, help="Stored documents (shared prefixes).")
    p.add_argument("--doc-len", type=int, default=1536, help="Tokens per document.")
    p.add_argument("--questions", type=int, default=2, help="Requests per document.")
    p.add_argument("--question-len", type=int, default=64, help="Tokens per question (the prompt's suffix).")
    p.add_argument("--output-len", type=int, default=32, help="New tokens per request (greedy).")
    p.add_argument("--slow-link", default="12.5MB",
                   help="Bytes/s between the serving instance and the store (the drafter's and the "
                        "single-instance baselines').")
    p.add_argument("--fast-link", default="1GB", help="Bytes/s between the verifier and the store.")
    p.add_argument("--compressor", default="int8", help="Query-free KV compressor of the compressed tier.")
    p.add_argument("--draft-tokens", type=int, default=16, help="VeriCache draft tokens per round.")
    p.add_argument("--page-size", type=int, default=32, help="KV page = store page = compression chunk, tokens.")
    p.add_argument("--chunked-prefill-size", type=int, default=2048, help="Prefill chunk, tokens.")
    p.add_argument("--threads-single", type=int, default=2,
                   help="torch threads of the single-instance modes (the drafter and verifier get 1 each).")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="Compute and KV dtype (float32 keeps verify and decode rounding alike).")
    p.add_argument("--repeats", type=int, default=3, help="Runs of every mode; medians are reported.")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="Modes to run.")
    args = p.parse_args()
    for flag in ("slow_link", "fast_link"):
        parse_bytes(getattr(args, flag), "--" + flag.replace("_", "-"))

    tok = get_tokenizer(args.model_path)
    documents, prompts = workload(tok, args.model_path, args.docs, args.doc_len, args.questions, args.question_len)
    work = tempfile.mkdtemp(prefix="bench_remote_prefix_")
    seed_store = os.path.join(work, "seed")
    try:
        store_documents(args, documents, seed_store)
        runs: dict[str, list[dict]] = {m: [] for m in args.modes}
        for rep in range(args.repeats):
            for name in tqdm(args.modes, desc=f"repeat {rep + 1}/{args.repeats}"):
                store = os.path.join(work, f"{name}-{rep}")
                shutil.copytree(seed_store, store)  # every run starts from the documents alone
                runs[name].append(run_mode(args, name, prompts, store))
                shutil.rmtree(store)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ref = runs["full-recompute"][0]["outputs"] if "full-recompute" in runs else None
    base = "full-slow-store" if "full-slow-store" in runs else None
    med = {n: statistics.median(r["tok_s"] for r in rs) for n, rs in runs.items()}
    ttft = {n: statistics.median(r["ttft_median_s"] for r in rs) for n, rs in runs.items()}
    rows = []
    for name, rs in runs.items():
        rows.append({
            "mode": name,
            "tok_s_median": med[name],
            "tok_s_runs": [r["tok_s"] for r in rs],
            "ttft_median_s": ttft[name],
            "tok_s_vs_slow_store": med[name] / med[base] if base else None,
            "ttft_vs_slow_store": ttft[name] / ttft[base] if base else None,
            "identical_to_full": None if ref is None else all(r["outputs"] == ref for r in rs),
            "slow_link_mb": rs[-1]["slow_link_bytes"] / 1e6,
            "verifier_kv_mb": rs[-1]["verifier_kv_bytes"] / 1e6,
            "tokens_per_round": rs[-1]["tokens_per_round"],
        })
    header = (
        f"Remote prefix caching: {args.docs} stored documents x {args.doc_len} tokens, {args.questions} requests "
        f"each (+{args.question_len}-token question, {args.output_len} new tokens, greedy), {args.model_path}\n"
        f"slow link (instance<->store) {args.slow_link}/s, fast link (verifier<->store) {args.fast_link}/s, "
        f"{args.compressor} compressed tier, X={args.draft_tokens}, page {args.page_size}, dtype {args.dtype}; "
        f"threads: single instance {args.threads_single}, drafter 1 + verifier 1; median of {args.repeats}; "
        f"machine: {machine(threads=False)}\n"
    )
    lines = [header,
             "| mode | output tok/s | vs slow-store | TTFT median s | TTFT vs slow-store | output = full "
             "| store over slow link MB | verifier KV over slow link MB | tokens/round |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        same = {True: "yes", False: "NO", None: "-"}[r["identical_to_full"]]
        tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        vs = f"{r['tok_s_vs_slow_store']:.2f}x" if base else "-"
        tv = f"{r['ttft_vs_slow_store']:.2f}x" if base else "-"
        lines.append(f"| {r['mode']} | {r['tok_s_median']:.1f} | {vs} | {r['ttft_median_s']:.2f} | {tv} | {same} | "
                     f"{r['slow_link_mb']:.1f} | {r['verifier_kv_mb']:.1f} | {tpr} |")
    write_results("remote_prefix", {"args": vars(args), "machine": machine(threads=False), "rows": rows},
                  "\n".join(lines))
    plot(rows, args, RESULTS / "remote_prefix.png")
    print(f"wrote {RESULTS / 'remote_prefix.png'}")


def plot(rows: list[dict], args, path) -> None:
    """Output tokens/s and median TTFT per mode, side by side, with the bytes on the slow link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["mode"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    bars = a.bar(names, [r["tok_s_median"] for r in rows], color=["tab:gray", "tab:orange", "tab:blue"][: len(rows)])
    for bar, r in zip(bars, rows):
        a.annotate(f"{r['slow_link_mb'] + r['verifier_kv_mb']:.0f} MB on\nthe slow link", (bar.get_x() + 0.4, 0),
                   xytext=(0, 4), textcoords="offset points", ha="center", fontsize=7, color="white")
    a.set_ylabel("output tokens/s (higher is better)")
    b.bar(names, [r["ttft_median_s"] for r in rows], color=["tab:gray", "tab:orange", "tab:blue"][: len(rows)])
    b.set_ylabel("median time to first token, s (lower is better)")
    for ax in (a, b):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Remote prefix caching: {args.docs} x {args.doc_len}-token stored documents, slow link "
                 f"{args.slow_link}/s, fast link {args.fast_link}/s ({args.compressor})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
