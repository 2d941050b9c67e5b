"""Server start-up on a GGUF file: seconds from `python -m sglang_vericache.launch_server` to /health
answering (model and tokenizer loaded) and to the first /v1/chat/completions answer, on a first start
(empty GGUF cache: config, tensor table and tokenizer converted from the file) and on a second start
(cache filled). Each start is a fresh server process; the cache lives in a temporary $XDG_CACHE_HOME.
Medians of --repeats runs. Writes benchmark/results/gguf_startup_<model>.json and .md.

    python benchmark/bench_gguf_startup.py --model-path /path/SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import requests

from common import machine, write_results

QUESTION = "What is the capital of France?"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(model_path: str, cache_home: str, extra: list[str], log_path: str) -> dict:
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": cache_home}
    cmd = [sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", model_path,
           "--port", str(port), *extra]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; log: {log_path}")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        ready = time.perf_counter() - t0
        r = requests.post(url + "/v1/chat/completions", timeout=300, json={
            "model": "default", "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 24, "temperature": 0})
        r.raise_for_status()
        answered = time.perf_counter() - t0
        return {"ready_s": round(ready, 1), "answer_s": round(answered, 1),
                "answer": r.json()["choices"][0]["message"]["content"], "loadavg_1min": os.getloadavg()[0]}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True, help="the .gguf file")
    ap.add_argument("--repeats", type=int, default=3, help="starts of each kind (default 3; medians reported)")
    ap.add_argument("--extra", default="", help="more launch_server flags, e.g. '--dtype float32'")
    args = ap.parse_args()

    runs = {"first": [], "second": []}
    logs = tempfile.mkdtemp(prefix="gguf-startup-")
    for i in range(args.repeats):
        home = tempfile.mkdtemp(prefix="gguf-cache-")
        try:
            for kind in ("first", "second"):  # interleaved: the machine's load drifts
                r = one_start(args.model_path, home, args.extra.split(), os.path.join(logs, f"{kind}-{i}.log"))
                print(f"{kind} start {i}: health after {r['ready_s']} s, answer after {r['answer_s']} s: {r['answer']!r}")
                runs[kind].append(r)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ready_s", "answer_s")} for k, v in runs.items()}
    load = statistics.median(r["loadavg_1min"] for v in runs.values() for r in v)
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", os.path.basename(args.model_path))
    report = {"args": vars(args), "machine": machine(), "median": med, "runs": runs, "logs": logs}
    table = "\n".join([
        f"# Server start-up on {os.path.basename(args.model_path)}",
        "",
        f"Seconds from launch to /health (model + tokenizer loaded) and to the first chat answer "
        f"(\"{QUESTION}\", 24 tokens, greedy); medians of {args.repeats}. Machine: {machine()}; "
        f"1-minute load average at the answers: median {load:.1f} (other jobs share the cores).",
        "",
        f"Command: `python benchmark/bench_gguf_startup.py --model-path {args.model_path} --repeats {args.repeats}"
        + (f" --extra '{args.extra}'" if args.extra else "") + "`",
        "",
        "| start | GGUF cache | health (s) | first answer (s) |",
        "|---|---|---|---|",
        f"| first | empty: config, tensor table, tokenizer converted | {med['first']['ready_s']} | {med['first']['answer_s']} |",
        f"| second | filled | {med['second']['ready_s']} | {med['second']['answer_s']} |",
        "",
        f"Answer: {runs['second'][-1]['answer']!r}",
    ])
    write_results(f"gguf_startup_{name}", report, table)


if __name__ == "__main__":
    main()
