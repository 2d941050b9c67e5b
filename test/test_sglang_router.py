"""End to end behind sglang-router (`python -m sglang_router.launch_router --worker-urls` two of our
servers on the bundled model), as a user runs it: both workers register and serve, native /generate
(plain and streaming) and the OpenAI endpoints pass through, and the worker endpoints the router calls
(/health, /server_info, /model_info, /get_model_info, /get_load, /metrics, /flush_cache) answer in
SGLang's shape. Skipped when the sglang-router package is not installed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from sglang_vericache.server_args import default_model_path

pytest.importorskip("sglang_router")

ROUTER_START_TIMEOUT_S = 60
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
MODEL = default_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers(server):
    # --log-requests: each worker's log names the rids it served. The seeds make them two servers.
    flags = ("--log-requests", "--log-level", "info")
    return [server(MODEL, *flags, "--random-seed", str(i)) for i in range(2)]


@pytest.fixture(scope="module")
def router(workers, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("router") / "router.log"
    args = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
            *(w.base_url for w in workers), "--host", "127.0.0.1", "--port", str(port),
            "--policy", "round_robin", "--log-level", "warn"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"the router exited:\n{log_path.read_text()[-4000:]}"
            try:
                ready = requests.get(url + "/readiness", timeout=2)
                if ready.status_code == 200 and ready.json().get("healthy_workers") == 2:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"router not ready:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


def test_both_workers_register(router, workers):
    listed = requests.get(router + "/workers", timeout=30).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(w.base_url for w in workers)


def test_generate_through_the_router_is_served_by_both_workers_with_the_same_tokens(router, workers):
    prompt = "def f(x):\n    return"
    body = {"text": prompt, "sampling_params": GREEDY}
    direct = requests.post(workers[0].base_url + "/generate", json=body, timeout=120).json()
    rids = [f"routed-{uuid.uuid4().hex}" for _ in range(2)]
    for rid in rids:  # round robin: one to each worker
        r = requests.post(router + "/generate", json={**body, "rid": rid}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == direct["output_ids"] and r.json()["meta_info"]["id"] == rid
    logs = [Path(w.log_path).read_text(errors="replace") for w in workers]
    assert sorted(sum(f"Finish: rid={rid}" in log for rid in rids) for log in logs) == [1, 1]


def test_streaming_generate_through_the_router(router):
    body = {"text": "import os\n", "sampling_params": GREEDY, "stream": True, "return_logprob": True}
    r = requests.post(router + "/generate", json=body, stream=True, timeout=120)
    assert r.status_code == 200
    lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    meta = json.loads(lines[-2][6:])["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["finish_reason"]["type"] == "length"


def test_openai_endpoints_through_the_router(router):
    completion = {"model": MODEL, "prompt": "def f(", "max_tokens": 3}
    r = requests.post(router + "/v1/completions", json=completion, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    r = requests.post(router + "/v1/chat/completions", json=chat, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


def test_the_routers_calls_on_workers_answer(router):
    loads = requests.get(router + "/get_loads", timeout=30).json()["workers"]
    assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads  # -1: /get_load failed
    flushed = requests.post(router + "/flush_cache", timeout=60).json()
    assert (flushed["status"], flushed["workers_flushed"]) == ("success", 2), flushed
    assert requests.get(router + "/get_model_info", timeout=30).json()["model_path"] == MODEL
    metrics = requests.get(router + "/engine_metrics", timeout=30)
    assert metrics.status_code == 200 and "num_requests_total" in metrics.text
