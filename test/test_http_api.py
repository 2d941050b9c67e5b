"""The native HTTP API (SGLANG_API.md): /generate shapes, streaming, logprobs, n, lists, stops,
abort frees KV, and the small endpoints. One shared server with a random llama checkpoint."""

from __future__ import annotations

import json
import time

import pytest
import requests
from transformers import AutoTokenizer

PROMPT = "def return import class self value"


@pytest.fixture(scope="module")
def tok(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def generate(base_url: str, **body) -> dict | list:
    r = requests.post(base_url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def greedy(max_new_tokens: int, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, **extra}


def plain_ascii(s: str) -> bool:
    return bool(s.strip()) and s.isascii() and s.isprintable()


def stream_events(base_url: str, **body) -> list[dict]:
    """All SSE events of a streaming /generate; asserts the framing (data lines, [DONE] last)."""
    r = requests.post(base_url + "/generate", json={**body, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith(b"data: ") for line in lines)
    assert lines[-1] == b"data: [DONE]"
    return [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]


def scheduler_state(base_url: str) -> dict:
    r = requests.get(base_url + "/server_info", timeout=30)
    assert r.status_code == 200
    return r.json()["internal_states"][0]


def wait_idle(base_url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = scheduler_state(base_url)
        if s["num_running_reqs"] == 0 and s["num_waiting_reqs"] == 0:
            return s
        time.sleep(0.2)
    raise AssertionError(f"scheduler not idle after {timeout} s: {s}")


def flushed_usage(base_url: str) -> int:
    wait_idle(base_url)
    assert requests.post(base_url + "/flush_cache", timeout=30).status_code == 200
    return scheduler_state(base_url)["num_used_tokens"]


# ---------------------------------------------------------------- /generate


def test_generate_returns_completion_only_text_and_meta_info(base_url, tok):
    out = generate(base_url, text=PROMPT, sampling_params=greedy(8))
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == len(tok.encode(PROMPT))
    assert meta["completion_tokens"] == 8
    assert isinstance(meta["id"], str) and meta["id"]
    assert isinstance(meta["cached_tokens"], int)
    assert meta["e2e_latency"] > 0
    assert "input_token_logprobs" not in meta


def test_generate_accepts_input_ids(base_url, tok):
    by_text = generate(base_url, text=PROMPT, sampling_params=greedy(6))
    by_ids = generate(base_url, input_ids=tok.encode(PROMPT), sampling_params=greedy(6))
    assert by_ids["output_ids"] == by_text["output_ids"]
    assert by_ids["text"] == by_text["text"]


def test_user_rid_is_the_meta_info_id(base_url):
    out = generate(base_url, text=PROMPT, rid="my-request-1", sampling_params=greedy(2))
    assert out["meta_info"]["id"] == "my-request-1"


def test_max_new_tokens_zero_is_prefill_only(base_url):
    out = generate(base_url, text=PROMPT, sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0


def test_list_input_returns_a_list_in_order(base_url):
    prompts = [PROMPT, "while if else print", "the model token cache"]
    batch = generate(base_url, text=prompts, sampling_params=greedy(5))
    assert isinstance(batch, list) and len(batch) == 3
    for prompt, out in zip(prompts, batch):
        single = generate(base_url, text=prompt, sampling_params=greedy(5))
        assert out["output_ids"] == single["output_ids"]
        assert out["text"] == single["text"]


def test_n_expands_into_n_samples(base_url):
    outs = generate(base_url, text=PROMPT, sampling_params=greedy(5, n=3))
    assert isinstance(outs, list) and len(outs) == 3
    assert len({o["meta_info"]["id"] for o in outs}) == 3
    assert outs[0]["output_ids"] == outs[1]["output_ids"] == outs[2]["output_ids"]  # greedy


def test_seeded_samples_are_reproducible_and_distinct_per_sample(base_url):
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "n": 3, "sampling_seed": 1234}
    first = [o["output_ids"] for o in generate(base_url, text=PROMPT, sampling_params=params)]
    again = [o["output_ids"] for o in generate(base_url, text=PROMPT, sampling_params=params)]
    assert first == again
    assert len({tuple(ids) for ids in first}) > 1  # seed + i per sample, not one seed for all


def test_list_input_with_n_orders_samples_by_prompt(base_url):
    outs = generate(base_url, text=[PROMPT, "while if else"], sampling_params=greedy(3, n=2))
    assert len(outs) == 4
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
    assert outs[2]["output_ids"] == outs[3]["output_ids"]
    assert outs[0]["meta_info"]["prompt_tokens"] == outs[1]["meta_info"]["prompt_tokens"]


# ---------------------------------------------------------------- stops


def test_stop_string_is_trimmed_and_reported(base_url, tok):
    full = generate(base_url, text=PROMPT, sampling_params=greedy(24))
    pieces = [tok.decode([t]) for t in full["output_ids"]]
    k = next(i for i in range(2, len(pieces)) if plain_ascii(pieces[i]))
    stop = pieces[k]
    out = generate(base_url, text=PROMPT, sampling_params=greedy(24, stop=[stop]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full["text"][: full["text"].find(stop)]
    kept = generate(base_url, text=PROMPT, sampling_params=greedy(24, stop=stop, no_stop_trim=True))
    pos = full["text"].find(stop)
    assert kept["text"] == full["text"][: pos + len(stop)]


def test_stop_token_id_ends_generation_and_is_trimmed_from_text(base_url, tok):
    full = generate(base_url, text=PROMPT, sampling_params=greedy(16))
    ids = full["output_ids"]
    k = 5
    stop_id = ids[k]
    first = ids.index(stop_id)
    out = generate(base_url, text=PROMPT, sampling_params=greedy(16, stop_token_ids=[stop_id]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"] == ids[: first + 1]
    assert out["text"] == tok.decode(ids[:first], skip_special_tokens=True)


# ---------------------------------------------------------------- logprobs


def test_logprob_shapes_with_top_logprobs_and_text(base_url, tok):
    prompt_ids = tok.encode(PROMPT)
    out = generate(
        base_url,
        text=PROMPT,
        sampling_params=greedy(4),
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert [e[1] for e in inp] == prompt_ids
    assert inp[0][0] is None and all(isinstance(e[0], float) for e in inp[1:])
    assert [e[2] for e in inp] == [tok.decode([t]) for t in prompt_ids]
    assert [e[1] for e in outp] == out["output_ids"]
    assert meta["output_token_logprobs_length"] == 4
    assert len(meta["input_top_logprobs"]) == len(prompt_ids) and meta["input_top_logprobs"][0] is None
    assert all(len(row) == 3 for row in meta["input_top_logprobs"][1:])
    assert len(meta["output_top_logprobs"]) == 4
    for entry, row in zip(outp, meta["output_top_logprobs"]):
        assert len(row) == 3
        assert row[0][1] == entry[1] and row[0][0] == pytest.approx(entry[0])  # greedy picks the top token
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        assert all(len(e) == 3 and e[2] == tok.decode([e[1]]) for e in row)


def test_logprob_start_len_selects_the_prompt_suffix(base_url, tok):
    n = len(tok.encode(PROMPT))
    out = generate(
        base_url, text=PROMPT, sampling_params=greedy(1), return_logprob=True, logprob_start_len=n - 2
    )
    inp = out["meta_info"]["input_token_logprobs"]
    assert len(inp) == 2 and inp[0][0] is None and isinstance(inp[1][0], float)
    assert all(e[2] is None for e in inp)  # no text unless return_text_in_logprobs


def test_return_logprob_without_start_len_has_no_input_logprobs(base_url):
    out = generate(base_url, text=PROMPT, sampling_params=greedy(3), return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == []
    assert len(out["meta_info"]["output_token_logprobs"]) == 3


# ---------------------------------------------------------------- streaming


def test_streaming_events_are_cumulative_text_and_per_event_logprobs(base_url):
    final = generate(base_url, text=PROMPT, sampling_params=greedy(10), return_logprob=True)
    events = stream_events(base_url, text=PROMPT, sampling_params=greedy(10), return_logprob=True)
    assert len(events) >= 2  # streamed as the tokens come, not in one piece at the end
    prev_text, prev_count = "", 0
    for ev in events:
        meta = ev["meta_info"]
        assert ev["text"].startswith(prev_text)
        prev_text = ev["text"]
        count = meta["completion_tokens"]
        assert count > prev_count and count == len(ev["output_ids"]) == meta["output_token_logprobs_length"]
        assert [e[1] for e in meta["output_token_logprobs"]] == ev["output_ids"][prev_count:]
        prev_count = count
    assert [ev["meta_info"]["finish_reason"] for ev in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert events[-1]["text"] == final["text"] and events[-1]["output_ids"] == final["output_ids"]


def test_streaming_batch_events_carry_index(base_url):
    events = stream_events(base_url, text=[PROMPT, "while if"], sampling_params=greedy(3))
    assert sorted({ev["index"] for ev in events}) == [0, 1]
    for idx in (0, 1):
        counts = [ev["meta_info"]["completion_tokens"] for ev in events if ev["index"] == idx]
        assert counts == sorted(set(counts)) and counts[-1] == 3


def test_streaming_n_samples_carry_index(base_url):
    events = stream_events(base_url, text=PROMPT, sampling_params=greedy(3, n=2))
    assert sorted({ev["index"] for ev in events}) == [0, 1]
    finals = [ev for ev in events if ev["meta_info"]["finish_reason"] is not None]
    assert sorted(ev["index"] for ev in finals) == [0, 1]
    assert finals[0]["output_ids"] == finals[1]["output_ids"]  # greedy


def test_streaming_text_never_shows_a_stop_string(base_url, tok):
    full = generate(base_url, text=PROMPT, sampling_params=greedy(24))
    text = full["text"]
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if plain_ascii(text[i : i + 2]))
    events = stream_events(base_url, text=PROMPT, sampling_params=greedy(24, stop=[stop]))
    for ev in events:
        assert stop not in ev["text"]
    assert events[-1]["text"] == text[: text.find(stop)]


def test_concurrent_requests_each_get_their_own_output(base_url):
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"{PROMPT} {i} while" * (1 + i % 3) for i in range(16)]
    solo = [generate(base_url, text=p, sampling_params=greedy(8))["output_ids"] for p in prompts]

    def one(i: int) -> list[int]:
        if i % 2:  # half of them streaming
            return stream_events(base_url, text=prompts[i], sampling_params=greedy(8))[-1]["output_ids"]
        return generate(base_url, text=prompts[i], sampling_params=greedy(8))["output_ids"]

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, range(16)))
    assert together == solo


# ---------------------------------------------------------------- abort frees KV


def generated_total(base_url: str) -> int:
    return scheduler_state(base_url)["num_generation_tokens_total"]


def test_dropping_a_stream_midway_frees_its_kv(base_url):
    idle = flushed_usage(base_url)
    generated = generated_total(base_url)
    body = {"text": PROMPT * 4, "stream": True, "sampling_params": greedy(1500)}
    r = requests.post(base_url + "/generate", json=body, stream=True, timeout=60)
    seen = 0
    for line in r.iter_lines():
        if line.startswith(b"data: {"):
            seen += 1
            if seen == 3:
                break
    r.close()
    assert flushed_usage(base_url) == idle
    assert generated_total(base_url) - generated < 1500  # aborted, not run to the end


def test_disconnecting_a_non_stream_request_frees_its_kv(base_url):
    idle = flushed_usage(base_url)
    generated = generated_total(base_url)
    with pytest.raises(requests.exceptions.ReadTimeout):  # 1500 tokens take well over 0.5 s here
        body = {"text": PROMPT * 4, "sampling_params": greedy(1500)}
        requests.post(base_url + "/generate", json=body, timeout=0.5)
    assert flushed_usage(base_url) == idle
    assert generated_total(base_url) - generated < 1500


# ---------------------------------------------------------------- small endpoints


def test_health_endpoints(base_url):
    assert requests.get(base_url + "/health", timeout=10).status_code == 200
    assert requests.get(base_url + "/health_generate", timeout=60).status_code == 200


def test_model_and_server_info(base_url, default_model_dir):
    info = requests.get(base_url + "/get_model_info", timeout=10).json()
    assert info["model_path"] == default_model_dir
    assert info["is_generation"] is True
    assert info["architectures"] == ["LlamaForCausalLM"]
    for path in ("/server_info", "/get_server_info"):
        s = requests.get(base_url + path, timeout=10).json()
        assert s["model_path"] == default_model_dir
        assert s["context_length"] == 2048
        assert s["max_total_num_tokens"] > 0
        assert set(s["internal_states"][0]) >= {
            "num_running_reqs",
            "num_waiting_reqs",
            "num_used_tokens",
            "token_usage",
            "cache_hit_rate",
        }


def test_flush_and_concat_endpoints_answer_200(base_url):
    wait_idle(base_url)
    assert requests.get(base_url + "/flush_cache", timeout=30).status_code == 200
    assert requests.post(base_url + "/flush_cache", json={"empty_cache": True}, timeout=30).status_code == 200
    # The SGLang frontend's parallel encoding calls it (and raises on anything but 200): nothing is
    # moved here, and the answer says so; a malformed body is a 400.
    body = {"src_rids": ["a"], "dst_rid": "b"}
    r = requests.post(base_url + "/concate_and_append_request", json=body, timeout=10)
    assert r.status_code == 200 and "KV not concatenated" in r.text
    r = requests.post(base_url + "/concate_and_append_request", json={"src_rids": "a"}, timeout=10)
    assert r.status_code == 400 and "concate_and_append_request needs" in r.json()["error"]["message"]


def _trace(path) -> dict:
    with open(path) as f:
        trace = json.load(f)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    return trace


def test_start_and_stop_profile_write_a_chrome_trace(base_url, tmp_path):
    wait_idle(base_url)
    r = requests.post(base_url + "/start_profile", json={"output_dir": str(tmp_path), "profile_id": "p1"}, timeout=30)
    assert r.status_code == 200, r.text
    again = requests.get(base_url + "/start_profile", timeout=30)
    assert again.status_code == 400 and "already running" in again.json()["error"]["message"]
    generate(base_url, text=PROMPT, sampling_params=greedy(4))
    assert not list(tmp_path.iterdir())  # written on stop
    r = requests.get(base_url + "/stop_profile", timeout=60)
    assert r.status_code == 200, r.text
    path = tmp_path / "p1-TP-0.trace.json"
    assert str(path) in r.text
    _trace(path)
    r = requests.post(base_url + "/stop_profile", timeout=30)
    assert r.status_code == 400 and "profiling is not running" in r.json()["error"]["message"]


def test_profile_stops_by_itself_after_num_steps(base_url, tmp_path):
    wait_idle(base_url)
    body = {"output_dir": str(tmp_path / "traces"), "num_steps": 2, "activities": ["CPU"]}
    assert requests.post(base_url + "/start_profile", json=body, timeout=30).status_code == 200
    generate(base_url, text=PROMPT, sampling_params=greedy(6))
    deadline = time.monotonic() + 60
    while not list((tmp_path / "traces").glob("*-TP-0.trace.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    [path] = (tmp_path / "traces").glob("*-TP-0.trace.json")
    _trace(path)
    r = requests.get(base_url + "/stop_profile", timeout=30)
    assert r.status_code == 400 and str(path) in r.json()["error"]["message"]


@pytest.mark.parametrize("body, message", [
    ({"num_steps": 0}, "num_steps must be >= 1"),
    ({"activities": ["MEM"]}, "activities must be a non-empty list of CPU, GPU"),
    ({"activities": ["GPU"]}, "GPU needs a server on CUDA"),
    ({"profile_by_stage": True}, "not supported by this runtime: profile_by_stage"),
    ({"output_dirr": "/tmp"}, "unknown profile field"),
    ({"profile_id": "../x"}, "no path separators"),
])
def test_bad_profile_requests_are_400s(base_url, body, message):
    r = requests.post(base_url + "/start_profile", json=body, timeout=30)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert requests.get(base_url + "/stop_profile", timeout=30).status_code == 400  # nothing started


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"sglang:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} missing")


def test_metrics_count_requests_and_tokens(base_url, tok):
    before = requests.get(base_url + "/metrics", timeout=10).text
    generate(base_url, text=PROMPT, sampling_params=greedy(7))
    generate(base_url, text="while if", sampling_params=greedy(3))
    after = requests.get(base_url + "/metrics", timeout=10).text

    def delta(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    assert delta("num_requests_total") == 2
    assert delta("generation_tokens_total") == 10
    assert delta("prompt_tokens_total") == len(tok.encode(PROMPT)) + len(tok.encode("while if"))
    assert delta("e2e_request_latency_seconds_count") == 2
    assert _metric(after, "num_running_reqs") == 0 and _metric(after, "num_queue_reqs") == 0
    gauges = ("token_usage", "cache_hit_rate", "gen_throughput", "num_used_tokens", "max_total_num_tokens")
    for gauge in gauges:
        assert _metric(after, gauge) >= 0
    assert "# TYPE sglang:e2e_request_latency_seconds histogram" in after


# ---------------------------------------------------------------- --skip-tokenizer-init


@pytest.fixture(scope="module")
def small_pool_ids_server(server, default_model_dir):
    """--skip-tokenizer-init, and a KV pool (512 tokens) much smaller than the context (2048)."""
    return server(default_model_dir, "--skip-tokenizer-init", "--max-total-tokens", "512")


def test_skip_tokenizer_init_takes_and_returns_token_ids(small_pool_ids_server, base_url, tok):
    ids = tok.encode(PROMPT)
    out = generate(small_pool_ids_server.base_url, input_ids=ids, sampling_params=greedy(6))
    assert "text" not in out
    assert out["output_ids"] == generate(base_url, input_ids=ids, sampling_params=greedy(6))["output_ids"]
    r = requests.post(small_pool_ids_server.base_url + "/generate", json={"text": PROMPT}, timeout=30)
    assert r.status_code == 400 and "input_ids" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_scheduler_refuses_gets_its_error_status(small_pool_ids_server, stream):
    body = {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 600}, "stream": stream}
    r = requests.post(small_pool_ids_server.base_url + "/generate", json=body, timeout=30)
    assert r.status_code == 400
    assert "10 prompt + 600 new tokens" in r.json()["error"]["message"]
    assert (
        generate(small_pool_ids_server.base_url, input_ids=[5] * 10, sampling_params=greedy(2))["meta_info"][
            "completion_tokens"
        ]
        == 2
    )


def test_abort_request_endpoint_ends_a_running_request_with_abort(base_url):
    r = requests.post(
        base_url + "/generate",
        stream=True,
        timeout=60,
        json={"text": PROMPT, "rid": "to-abort", "stream": True, "sampling_params": greedy(1500)},
    )
    events = []
    for line in r.iter_lines():
        if not line.startswith(b"data: {"):
            continue
        events.append(json.loads(line[len(b"data: ") :]))
        if len(events) == 2:
            abort = requests.post(base_url + "/abort_request", json={"rid": "to-abort"}, timeout=10)
            assert abort.status_code == 200
    reason = events[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort"
    assert events[-1]["meta_info"]["completion_tokens"] < 1500
    wait_idle(base_url)


def test_a_dead_scheduler_gives_503_and_errors_not_hangs(small_pool_ids_server):
    """Runs last in this module: it kills that server's scheduler (and then the server)."""
    import psutil

    srv = small_pool_ids_server
    try:
        children = psutil.Process(srv.proc.pid).children(recursive=True)
        scheduler = next(c for c in children if "spawn_main" in " ".join(c.cmdline()))
        scheduler.kill()
        deadline = time.monotonic() + 10
        while requests.get(srv.base_url + "/health", timeout=5).status_code == 200:
            assert time.monotonic() < deadline, "health still 200 after the scheduler died"
            time.sleep(0.2)
        assert requests.get(srv.base_url + "/health", timeout=5).status_code == 503
        r = requests.post(srv.base_url + "/generate", json={"input_ids": [5, 6]}, timeout=10)
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
    finally:
        srv.kill()  # the session's server cache starts a fresh one if anyone asks again
