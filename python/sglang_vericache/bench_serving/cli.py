"""`python -m sglang_vericache.bench_serving`: sglang.bench_serving's main flags, checked."""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
from datetime import datetime

import numpy as np
import requests

from sglang_vericache.bench_serving.backends import ASYNC_REQUEST_FUNCS, CHAT_BACKENDS
from sglang_vericache.bench_serving.datasets import (
    LocalTokenizer,
    ServerTokenizer,
    sample_random_requests,
    sample_sharegpt_requests,
)
from sglang_vericache.bench_serving.runner import benchmark

DEFAULT_PORT = 30000


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang_vericache.bench_serving",
                                description="Benchmark a running server's online serving throughput and latency.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--backend", default="sglang", choices=list(ASYNC_REQUEST_FUNCS),
        help="API to call: sglang = native /generate; sglang-oai = /v1/completions; "
             "sglang-oai-chat = /v1/chat/completions (vllm, vllm-chat: the same OpenAI APIs).")
    add("--base-url", default=None, help="Server URL, e.g. http://127.0.0.1:30000 (instead of --host/--port).")
    add("--host", default="127.0.0.1", help="Server host (without --base-url).")
    add("--port", type=int, default=DEFAULT_PORT, help="Server port (without --base-url).")
    add("--dataset-name", default="sharegpt", choices=["sharegpt", "random", "random-ids"],
        help="sharegpt: conversations from --dataset-path; random (random-ids): prompts of token ids "
             "of --random-input-len (from --dataset-path's text if given).")
    add("--dataset-path", default="", help="A local ShareGPT-format JSON (needed by --dataset-name sharegpt).")
    add("--model", default=None, help="Model name sent to OpenAI APIs (default: the server's, from /v1/models).")
    add("--tokenizer", default=None,
        help="A local Hugging Face tokenizer to measure prompts with (default: the server's, via /v1/tokenize).")
    add("--num-prompts", type=int, default=1000, help="Number of prompts to send.")
    add("--sharegpt-output-len", type=int, default=None,
        help="Output length of every sharegpt request (default: its second turn's token count).")
    add("--sharegpt-context-len", type=int, default=None,
        help="Drop sharegpt requests whose prompt + output exceed this many tokens.")
    add("--random-input-len", type=int, default=1024, help="Input tokens per random request.")
    add("--random-output-len", type=int, default=1024, help="Output tokens per random request.")
    add("--random-range-ratio", type=float, default=0.0,
        help="Random lengths are drawn uniformly from [len * ratio, len]; 1.0 gives exactly len.")
    add("--request-rate", type=float, default=float("inf"),
        help="Requests per second, at Poisson arrivals; inf sends them all at once.")
    add("--max-concurrency", type=int, default=None, help="Most requests in flight at once (default: no cap).")
    add("--output-file", default=None,
        help="JSONL file the result line is appended to (default: <backend>_<MMDD>_<num-prompts>_... .jsonl).")
    add("--output-details", action="store_true",
        help="Also write each request's lengths, TTFT, ITLs, text and error.")
    add("--disable-tqdm", action="store_true", help="No progress bar.")
    add("--disable-stream", action="store_true", help="Non-streaming requests (TTFT is then the whole latency).")
    add("--disable-ignore-eos", action="store_true", help="Let requests stop at EOS (default: ignore_eos).")
    add("--temperature", type=float, default=0.0, help="Sampling temperature of every request.")
    add("--extra-request-body", default=None, metavar='{"key": "value"}',
        help="JSON object merged into every request's body.")
    add("--seed", type=int, default=42, help="Seed of the dataset sampling and the arrival times.")
    add("--warmup-requests", type=int, default=1, help="Requests sent (and not measured) before the run.")
    add("--tag", default=None, help="A label written into the result line.")
    return p


def check_args(args: argparse.Namespace) -> None:
    def bad(msg: str) -> None:
        raise SystemExit(f"error: {msg}")

    if args.num_prompts < 1:
        bad(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not args.request_rate > 0:
        bad(f"--request-rate must be positive (inf: all at once), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        bad(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if args.random_input_len < 1 or args.random_output_len < 1:
        bad("--random-input-len and --random-output-len must be at least 1")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        bad(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    if args.warmup_requests < 0:
        bad(f"--warmup-requests must be at least 0, got {args.warmup_requests}")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        bad("--dataset-name sharegpt needs --dataset-path (a local ShareGPT-format JSON; nothing is downloaded)")
    if args.dataset_path and not os.path.isfile(args.dataset_path):
        bad(f"--dataset-path {args.dataset_path!r} is not a file")
    if args.extra_request_body:
        import json

        try:
            if not isinstance(json.loads(args.extra_request_body), dict):
                bad("--extra-request-body must be a JSON object")
        except json.JSONDecodeError as e:
            bad(f"--extra-request-body is not JSON: {e}")


def _headers() -> dict[str, str]:
    key = os.environ.get("OPENAI_API_KEY") or os.environ.get("SGLANG_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def run_benchmark(args: argparse.Namespace) -> dict:
    """Runs one benchmark against a live server; -> the result (and details) dict."""
    check_args(args)
    random.seed(args.seed)
    np.random.seed(args.seed)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = _headers()
    try:
        info = requests.get(base_url + "/v1/models", headers=headers, timeout=30)
        info.raise_for_status()
    except requests.RequestException as e:
        raise SystemExit(f"error: no server answers at {base_url} ({e})") from e
    model_id = args.model or info.json()["data"][0]["id"]
    if args.tokenizer:
        tokenizer = LocalTokenizer(args.tokenizer)
    else:
        vocab = requests.get(base_url + "/server_info", headers=headers, timeout=30).json()["vocab_size"]
        tokenizer = ServerTokenizer(base_url, headers, int(vocab))
    print(f"benchmark args: {vars(args)}")
    if args.dataset_name == "sharegpt":
        rows = sample_sharegpt_requests(args.dataset_path, args.num_prompts, tokenizer, args.sharegpt_output_len,
                                        args.sharegpt_context_len)
        if not rows:
            raise SystemExit(f"error: no conversation of {args.dataset_path!r} fits the length limits")
    else:
        rows = sample_random_requests(args.random_input_len, args.random_output_len, args.num_prompts,
                                      args.random_range_ratio, tokenizer, args.backend in CHAT_BACKENDS,
                                      args.dataset_path)
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}")
    print(f"#Output tokens: {sum(r.output_len for r in rows)}")
    if args.output_file is None:
        now = datetime.now().strftime("%m%d")
        tail = (f"{args.random_input_len}_{args.random_output_len}" if args.dataset_name.startswith("random")
                else args.dataset_name)
        args.output_file = f"{args.backend}_{now}_{args.num_prompts}_{tail}.jsonl"
    return asyncio.run(benchmark(args, rows, model_id, base_url, headers))


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    result = run_benchmark(args)
    sys.exit(0 if result["completed"] else 1)
