"""sglang-router in front of our servers, both ways a user runs it, on one set of two replicas (the
bundled model):

- `launch_server --dp-size 2` (dp/controller.py): its /server_info lists both replicas, the other
  endpoints of one server answer at its --port, requests through it are answered by both replicas
  with one server's tokens and logprobs (native, streamed, OpenAI; a named rank by that replica),
  a killed replica's stream ends with an error event naming it while new requests go to the other,
  and stopping launch_server stops every child;
- the router run by hand (`python -m sglang_router.launch_router --worker-urls`) in front of the same
  two replicas: both register, /generate (plain, streamed with logprobs) and the OpenAI endpoints pass
  through, and the worker endpoints the router calls (/health, /server_info, /model_info,
  /get_model_info, /get_load, /metrics, /flush_cache) answer in SGLang's shape.

The tests run in file order (pytest's default): the replica kill and the shutdown come last.
Skipped when the sglang-router package is not installed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from sglang_vericache.server_args import bundled_model_path

pytest.importorskip("sglang_router")

START_TIMEOUT_S = 180
GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = "def f(x):\n    return"
MODEL = bundled_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(15)


@dataclass
class DataParallelServer:
    proc: subprocess.Popen
    url: str
    log_path: Path
    replica_urls: list[str]
    replica_pids: list[int]
    hand_router: subprocess.Popen  # started early: its import takes seconds
    hand_router_url: str
    hand_router_log: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def served_by(self, rid: str, marker: str = "Finish", wait: float = 10.0) -> list[int]:
        """The dp ranks whose log lines say they served rid, waiting up to `wait` seconds for a first one:
        a replica's lines reach the log through launch_server's pipe, possibly after its response."""
        deadline = time.monotonic() + wait
        while True:
            ranks = sorted({int(m) for m in re.findall(rf"^\[dp(\d)\] .*{marker}: rid={re.escape(rid)} ",
                                                       self.log(), re.M)})
            if ranks or time.monotonic() >= deadline:
                return ranks
            time.sleep(0.05)


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp")
    port = free_port()
    log_path = logs / "launch_server.log"
    args = [sys.executable, "-m", "sglang_vericache.launch_server", "--model-path", MODEL,
            "--port", str(port), "--dp-size", "2", "--log-requests", "--log-level", "info",
            "--router-policy", "round_robin", "--router-prometheus-port", str(free_port())]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    hand = None
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the front binds --port once both replicas and the router are up
            assert proc.poll() is None, f"launch_server exited:\n{log_path.read_text()[-4000:]}"
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"not up:\n{log_path.read_text()[-4000:]}"
            time.sleep(0.5)
        info = requests.get(url + "/server_info", timeout=30).json()
        replica_urls = [r["url"] for r in info["replicas"]]
        hand_port = free_port()
        hand_log = logs / "router.log"
        with open(hand_log, "w") as log:
            hand = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *replica_urls,
                 "--host", "127.0.0.1", "--port", str(hand_port), "--policy", "round_robin",
                 "--log-level", "warn", "--prometheus-port", str(free_port())],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        yield DataParallelServer(proc, url, log_path, replica_urls, [r["pid"] for r in info["replicas"]],
                                 hand, f"http://127.0.0.1:{hand_port}", hand_log)
    finally:
        if hand is not None:  # the router alone, no children: no need for its graceful shutdown
            hand.kill()
            hand.wait(15)
        stop(proc)


@pytest.fixture(scope="module")
def expected(dp):
    """One server's answer (replica 0 asked directly), with logprobs."""
    body = {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
    return requests.post(dp.replica_urls[0] + "/generate", json=body, timeout=120).json()


@pytest.fixture(scope="module")
def router(dp):
    """The router run by hand in front of the two replicas."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert dp.hand_router.poll() is None, f"the router exited:\n{dp.hand_router_log.read_text()[-4000:]}"
        try:
            ready = requests.get(dp.hand_router_url + "/readiness", timeout=2)
            if ready.status_code == 200 and ready.json().get("healthy_workers") == 2:
                return dp.hand_router_url
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"router not ready:\n{dp.hand_router_log.read_text()[-4000:]}"
        time.sleep(0.5)


def generate_both_ways(base_url: str, dp: DataParallelServer, expected: dict) -> None:
    """Two requests (round robin: one per replica) answered with one server's tokens and logprobs."""
    rids = [f"routed-{uuid.uuid4().hex}" for _ in range(2)]
    for rid in rids:
        body = {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "rid": rid}
        r = requests.post(base_url + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == expected["output_ids"] and out["meta_info"]["id"] == rid
        assert out["meta_info"]["output_token_logprobs"] == expected["meta_info"]["output_token_logprobs"]
    assert sorted(rank for rid in rids for rank in dp.served_by(rid)) == [0, 1]


def stream_both_ways(base_url: str, expected: dict) -> None:
    body = {"text": PROMPT, "sampling_params": GREEDY, "stream": True, "return_logprob": True}
    r = requests.post(base_url + "/generate", json=body, stream=True, timeout=120)
    assert r.status_code == 200
    lines = [line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert events[-1]["output_ids"] == expected["output_ids"]  # the text so far; logprobs: the new ones
    logprobs = [lp for e in events for lp in e["meta_info"]["output_token_logprobs"]]
    assert logprobs == expected["meta_info"]["output_token_logprobs"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def openai_both_ways(base_url: str, dp: DataParallelServer) -> None:
    completion = {"model": MODEL, "prompt": "def f(", "max_tokens": 3, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        direct = requests.post(dp.replica_urls[1] + path, json=body, timeout=120).json()
        r = requests.post(base_url + path, json=body, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        assert r.json()["choices"] and r.json()["choices"][0].keys() == direct["choices"][0].keys()
        text = "text" if path == "/v1/completions" else "message"
        assert r.json()["choices"][0][text] == direct["choices"][0][text]


# ---------------------------------------------------------------------- launch_server --dp-size 2


def test_dp_server_info_lists_each_replica(dp):
    info = requests.get(dp.url + "/server_info", timeout=30).json()
    assert (info["dp_size"], info["port"], info["model_path"]) == (2, int(dp.url.rsplit(":", 1)[1]), MODEL)
    assert [(r["dp_rank"], r["state"], r["exit"]) for r in info["replicas"]] == [(0, "serving", None),
                                                                                 (1, "serving", None)]
    assert len(info["internal_states"]) == 2 and info["router"]["state"] == "running"
    assert info["router"]["policy"] == "round_robin"
    assert requests.get(dp.url + "/get_server_info", timeout=30).json()["dp_size"] == 2


def test_dp_generate_is_answered_by_both_replicas_with_one_servers_tokens(dp, expected):
    generate_both_ways(dp.url, dp, expected)


def test_dp_streamed_generate_with_logprobs(dp, expected):
    stream_both_ways(dp.url, expected)


def test_dp_openai_endpoints(dp):
    openai_both_ways(dp.url, dp)


def test_dp_the_endpoints_of_one_server_answer_at_the_front(dp):
    assert requests.get(dp.url + "/ready", timeout=30).status_code == 200
    assert requests.get(dp.url + "/health_generate", timeout=60).status_code == 200
    assert requests.get(dp.url + "/model_info", timeout=30).json()["model_path"] == MODEL
    loads = requests.get(dp.url + "/get_load", timeout=30).json()
    assert [(e["dp_rank"], e["num_waiting_reqs"]) for e in loads] == [(0, 0), (1, 0)]
    assert requests.get(dp.url + "/flush_cache", timeout=60).json()["workers_flushed"] == 2
    metrics = requests.get(dp.url + "/metrics", timeout=30)
    assert metrics.status_code == 200
    for url in dp.replica_urls:  # every replica's counters, labelled with it
        line = rf'^sglang_num_requests_total{{.*worker_addr="{re.escape(url)}"}} '
        assert re.search(line, metrics.text, re.M)


def test_dp_a_request_naming_its_rank_is_served_by_that_replica(dp, expected):
    for rank in (1, 0):
        rid = f"ranked-{uuid.uuid4().hex}"
        body = {"text": PROMPT, "sampling_params": GREEDY, "rid": rid, "routed_dp_rank": rank}
        r = requests.post(dp.url + "/generate", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["output_ids"] == expected["output_ids"], r.text
        assert dp.served_by(rid) == [rank]
    r = requests.post(dp.url + "/generate", json={"text": PROMPT, "routed_dp_rank": 2}, timeout=30)
    assert (r.status_code, r.json()["error"]["message"]) == (
        400, "routed_dp_rank=2 out of range [0, 2): launch_server runs 2 data-parallel replicas")


# ---------------------------------------------------------------------- the router run by hand


def test_both_replicas_register_with_the_router_run_by_hand(router, dp):
    listed = requests.get(router + "/workers", timeout=30).json()["workers"]
    assert sorted(w["url"] for w in listed) == sorted(dp.replica_urls)


def test_generate_through_the_router_run_by_hand(router, dp, expected):
    generate_both_ways(router, dp, expected)
    stream_both_ways(router, expected)


def test_openai_endpoints_through_the_router_run_by_hand(router, dp):
    openai_both_ways(router, dp)


def test_the_routers_calls_on_workers_answer(router):
    loads = requests.get(router + "/get_loads", timeout=30).json()["workers"]
    assert len(loads) == 2 and all(w["load"] >= 0 for w in loads), loads  # -1: /get_load failed
    flushed = requests.post(router + "/flush_cache", timeout=60).json()
    assert (flushed["status"], flushed["workers_flushed"]) == ("success", 2), flushed
    assert requests.get(router + "/get_model_info", timeout=30).json()["model_path"] == MODEL
    metrics = requests.get(router + "/engine_metrics", timeout=30)
    assert metrics.status_code == 200 and "num_requests_total" in metrics.text
    assert requests.get(router + "/health_generate", timeout=60).status_code == 200
    assert [m["id"] for m in requests.get(router + "/v1/models", timeout=30).json()["data"]] == [MODEL]


# ---------------------------------------------------------------------- a replica killed, then shutdown


def test_a_killed_replicas_stream_ends_with_an_error_and_new_requests_go_to_the_other(dp, expected):
    rid = f"victim-{uuid.uuid4().hex}"
    body = {"text": PROMPT, "stream": True, "rid": rid,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    r = requests.post(dp.url + "/generate", json=body, stream=True, timeout=120)
    events = (line for line in r.iter_lines(decode_unicode=True) if line.startswith("data: "))
    assert "error" not in json.loads(next(events)[6:])  # its first token: the request is in flight
    assert dp.served_by(rid, "Receive"), "no replica logged the request"
    [victim] = dp.served_by(rid, "Receive")
    os.killpg(dp.replica_pids[victim], signal.SIGKILL)
    rest = list(events)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == 502
    assert f"dp{victim} ({dp.replica_urls[victim]}) killed by SIGKILL" in error["message"], error
    rids = [f"after-{uuid.uuid4().hex}" for _ in range(3)]
    for new_rid in rids:
        body = {"text": PROMPT, "sampling_params": GREEDY, "rid": new_rid}
        out = requests.post(dp.url + "/generate", json=body, timeout=120)
        assert out.status_code == 200 and out.json()["output_ids"] == expected["output_ids"], out.text
        assert dp.served_by(new_rid) == [1 - victim]
    info = requests.get(dp.url + "/server_info", timeout=30).json()
    states = {r["dp_rank"]: (r["state"], r["exit"]) for r in info["replicas"]}
    assert states == {victim: ("exited", "killed by SIGKILL"), 1 - victim: ("serving", None)}
    assert dp.proc.poll() is None


def test_stopping_launch_server_stops_every_child_with_a_stream_open(dp):
    children = psutil.Process(dp.proc.pid).children(recursive=True)
    # the router, the surviving replica and its scheduler (at least)
    assert len(children) >= 3, children
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
    r = requests.post(dp.url + "/generate", json=body, stream=True, timeout=120)
    lines = r.iter_lines(decode_unicode=True)
    assert next(line for line in lines if line.startswith("data: "))  # in flight
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=15)
    assert alive == []
    with pytest.raises(requests.exceptions.ChunkedEncodingError):
        list(lines)  # the open stream was cut
