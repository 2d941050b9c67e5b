"""python -m sglang_vericache.bench_serving against a live server: request and token counts, the
summary block and the JSONL result line (counts and fields, not timings); the figures' arithmetic
on fixed outputs; bad flags."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import requests

from sglang_vericache.bench_serving.backends import RequestFuncOutput
from sglang_vericache.bench_serving.metrics import calculate_metrics, summary_lines

# The server of test_serving_logs.py too (same flags: one server per session).
SERVING_FLAGS = ("--log-level", "info", "--decode-log-interval", "4")
CONVERSATIONS = [
    {"conversations": [{"from": "human", "value": f"Question {i}: what is {i} plus {i}?"},
                       {"from": "gpt", "value": f"{i} plus {i} is {2 * i}."}]} for i in range(5)
] + [{"conversations": [{"from": "human", "value": "one turn only"}]}]


@pytest.fixture(scope="module")
def bench_server(server, default_model_dir):
    return server(default_model_dir, *SERVING_FLAGS)


def run_bench(base_url: str, tmp_path, *flags: str) -> tuple[str, dict]:
    out = tmp_path / "result.jsonl"  # appended to, as sglang.bench_serving's output file
    before = out.read_text().splitlines() if out.exists() else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "sglang_vericache.bench_serving", "--base-url", base_url,
                           "--output-file", str(out), "--output-details", "--disable-tqdm", *flags],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = out.read_text().splitlines()
    assert lines[:-1] == before
    return proc.stdout, json.loads(lines[-1])


def summary_value(stdout: str, label: str) -> str:
    rows = [line for line in stdout.splitlines() if line.startswith(label)]
    assert len(rows) == 1, stdout
    return rows[0][len(label):].strip()


def test_random_native_streaming(bench_server, tmp_path):
    stdout, res = run_bench(bench_server.base_url, tmp_path, "--backend", "sglang", "--dataset-name", "random",
                            "--num-prompts", "5", "--random-input-len", "12", "--random-output-len", "6",
                            "--random-range-ratio", "1.0", "--max-concurrency", "2", "--request-rate", "40")
    assert (res["completed"], res["total_input_tokens"], res["total_output_tokens"]) == (5, 60, 30)
    assert res["input_lens"] == [12] * 5 and res["output_lens"] == [6] * 5 and res["errors"] == [""] * 5
    assert (res["backend"], res["dataset_name"], res["request_rate"], res["max_concurrency"]) == \
        ("sglang", "random", 40.0, 2)
    # Streamed: every request's first event gives its TTFT, the later ones its inter-token gaps.
    assert all(0 < t for t in res["ttfts"]) and all(1 <= len(itl) <= 5 for itl in res["itls"])
    for key in ("duration", "request_throughput", "input_throughput", "output_throughput", "total_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
                "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms", "mean_tpot_ms",
                "concurrency", "max_concurrent_requests"):
        assert isinstance(res[key], (int, float)), key
    assert res["max_concurrent_requests"] >= 1  # requests in flight during one wall-clock second (sglang's)
    assert summary_value(stdout, "Successful requests:") == "5"
    assert summary_value(stdout, "Total input tokens:") == "60"
    assert summary_value(stdout, "Total generated tokens:") == "30"
    assert summary_value(stdout, "Max request concurrency:") == "2"
    for label in ("Benchmark duration (s):", "Request throughput (req/s):", "Output token throughput (tok/s):",
                  "Mean TTFT (ms):", "Median ITL (ms):", "P99 E2E Latency (ms):", "Concurrency:"):
        float(summary_value(stdout, label))


def test_sharegpt_openai_backends(bench_server, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(CONVERSATIONS))
    prompts = [c["conversations"][0]["value"] for c in CONVERSATIONS[:5]]
    url = bench_server.base_url
    # Completions: the prompt's tokens as the server counts them (special tokens added).
    want = sum(requests.post(url + "/v1/tokenize", json={"prompt": p}).json()["count"] for p in prompts)
    _, res = run_bench(url, tmp_path, "--backend", "sglang-oai", "--dataset-name", "sharegpt",
                       "--dataset-path", str(path), "--num-prompts", "5", "--sharegpt-output-len", "4")
    assert (res["completed"], res["total_input_tokens"], res["total_output_tokens"]) == (5, want, 20)
    # Chat, not streamed: each prompt as one user message under the chat template.
    want = sum(requests.post(url + "/v1/tokenize", json={"messages": [{"role": "user", "content": p}]}).json()["count"]
               for p in prompts)
    _, res = run_bench(url, tmp_path, "--backend", "sglang-oai-chat", "--dataset-name", "sharegpt",
                       "--dataset-path", str(path), "--num-prompts", "8", "--sharegpt-output-len", "3",
                       "--disable-stream")
    assert (res["completed"], res["total_input_tokens"], res["total_output_tokens"]) == (5, want, 15)
    assert res["itls"] == [[]] * 5 and all(t > 0 for t in res["ttfts"])  # one event: TTFT is the latency
    # random over the file's text (sglang's random): first turns' ids repeated or cut to 10 tokens, sent as ids.
    _, res = run_bench(url, tmp_path, "--backend", "sglang", "--dataset-name", "random", "--dataset-path", str(path),
                       "--num-prompts", "3", "--random-input-len", "10", "--random-output-len", "3",
                       "--random-range-ratio", "1")
    assert (res["completed"], res["total_input_tokens"], res["total_output_tokens"]) == (3, 30, 9)


def test_metrics_of_fixed_outputs():
    outs = [RequestFuncOutput(success=True, latency=1.0, ttft=0.25, itl=[0.25, 0.5, 0.25], prompt_len=10,
                              output_len=4, start_time=100.0),
            RequestFuncOutput(success=True, latency=2.0, ttft=0.5, itl=[0.5, 1.0], prompt_len=20, output_len=4,
                              start_time=100.5),
            RequestFuncOutput(success=False, error="boom", prompt_len=30, start_time=100.0)]
    m = calculate_metrics(outs, dur_s=4.0)
    assert (m.completed, m.total_input, m.total_output) == (2, 30, 8)
    assert (m.request_throughput, m.input_throughput, m.output_throughput, m.total_throughput) == (0.5, 7.5, 2.0, 9.5)
    assert (m.mean_ttft_ms, m.median_ttft_ms, m.p90_ttft_ms) == (375.0, 375.0, 475.0)
    assert (m.mean_e2e_latency_ms, m.p99_e2e_latency_ms) == (1500.0, pytest.approx(1990.0))
    assert m.mean_tpot_ms == 375.0  # (1.0 - 0.25) / 3 and (2.0 - 0.5) / 3
    assert (m.mean_itl_ms, m.median_itl_ms, m.max_itl_ms) == (500.0, 500.0, 1000.0)
    assert m.concurrency == 0.75
    # Tokens at 100.25, 100.5, 101.0, 101.25 and 101.0, 101.5, 102.5: 4 in the second from 101.0.
    assert (m.max_output_tokens_per_s, m.max_concurrent_requests) == (4.0, 2)
    lines = summary_lines("sglang", float("inf"), None, m, 4.0, None)
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert "{:<40} {:<10}".format("Successful requests:", 2) in lines
    assert "{:<40} {:<10}".format("Max request concurrency:", "not set") in lines
    assert "Mean TTFT (ms):" + " " * 26 + "375.00    " in lines


@pytest.mark.parametrize("flags,message", [
    (("--num-prompts", "0"), "--num-prompts must be at least 1"),
    (("--request-rate", "0"), "--request-rate must be positive"),
    (("--dataset-name", "sharegpt"), "needs --dataset-path"),
    (("--dataset-name", "random", "--random-range-ratio", "1.5"), "--random-range-ratio must be in [0, 1]"),
    (("--dataset-name", "random", "--extra-request-body", "[1]"), "must be a JSON object"),
])
def test_bad_flags(flags, message):
    from sglang_vericache.bench_serving import make_parser, run_benchmark

    with pytest.raises(SystemExit, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_benchmark(make_parser().parse_args(list(flags)))


class _WordTokenizer:
    """One token per word (its length), to test the datasets without a server."""

    vocab_size = 50

    def encode_batch(self, texts):
        return [[len(w) for w in t.split()] for t in texts]

    def decode_batch(self, ids):
        return [" ".join("x" * i for i in row) for row in ids]


def test_datasets(tmp_path):
    import numpy as np

    from sglang_vericache.bench_serving.datasets import sample_random_requests, sample_sharegpt_requests

    path = tmp_path / "d.json"
    path.write_text(json.dumps([
        {"conversations": [{"value": "aa bbb"}, {"value": "c dd eee"}]},  # prompt 2 tokens, answer 3
        {"conversations": [{"value": "single"}, {"value": "x y z"}]},  # a 1-token prompt: pruned
        {"conversation": [{"value": "a b c d e f"}, {"value": "q"}]},  # a 1-token answer: pruned
        {"conversations": [{"value": "a b c d"}, {"value": "x y z w"}]},  # 4 + 4 tokens
    ]))
    rows = sample_sharegpt_requests(str(path), 10, _WordTokenizer())
    assert sorted((r.prompt, r.prompt_len, r.output_len) for r in rows) == [("a b c d", 4, 4), ("aa bbb", 2, 3)]
    rows = sample_sharegpt_requests(str(path), 10, _WordTokenizer(), fixed_output_len=5, context_len=8)
    assert [(r.prompt_len, r.output_len) for r in rows] == [(2, 5)]  # 4 + 5 > 8, and "single" still 1 token
    one = tmp_path / "one.json"
    one.write_text(json.dumps([{"conversations": [{"value": "a bb"}, {"value": "x"}]}]))
    rows = sample_random_requests(5, 4, 2, 1.0, _WordTokenizer(), as_text=False, dataset_path=str(one))
    assert [(r.prompt, r.prompt_len, r.output_len) for r in rows] == [([1, 2, 1, 2, 1], 5, 4)] * 2
    np.random.seed(0)
    rows = sample_random_requests(6, 3, 8, 0.5, _WordTokenizer(), as_text=False)
    for r in rows:  # lengths in [len * ratio, len]; ids consecutive (mod the vocabulary) from an offset
        assert 3 <= r.prompt_len <= 6 and 1 <= r.output_len <= 3 and len(r.prompt) == r.prompt_len
        assert all(b == (a + 1) % 50 for a, b in zip(r.prompt, r.prompt[1:]))
    assert len({r.prompt_len for r in rows}) > 1
    np.random.seed(3)  # chat backends get the text: the ids' decoding
    rows = sample_random_requests(4, 2, 1, 1.0, _WordTokenizer(), as_text=True)
    np.random.seed(3)
    np.random.randint(4, 5, size=1), np.random.randint(2, 3, size=1)  # the lengths' draws
    offset = int(np.random.randint(0, 50, size=1)[0])
    want = _WordTokenizer().decode_batch([[(offset + j) % 50 for j in range(4)]])[0]
    assert (rows[0].prompt, rows[0].prompt_len, rows[0].output_len) == (want, 4, 2)


def test_client_needs_no_torch():
    code = ("import sys, sglang_vericache.bench_serving.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'sglang') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
