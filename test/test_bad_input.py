"""Bad input gets a 4xx JSON error that names the problem, and the server answers afterwards."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import requests

CONTEXT_LEN = 2048  # the default test server's checkpoint (conftest.DEFAULT_OVERRIDES)
OK_BODY = {"text": "def return", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}

# (case id, path, JSON body or raw bytes, expected status, words the error message must contain)
GENERATE_CASES = [
    ("malformed-json", "/generate", b'{"text": "hi", ', 400, ["malformed JSON"]),
    ("not-an-object", "/generate", [1, 2], 400, ["JSON object"]),
    (  # unknown top-level keys are ignored with a warning, as SGLang's server ignores them
        "wrongly-typed-sglang-field",
        "/generate",
        {"text": "hi", "no_logs": "yes"},
        400,
        ["no_logs", "boolean"],
    ),
    (
        "unknown-sampling-field",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_token": 5}},
        400,
        ["unknown sampling_params", "max_new_token"],
    ),
    (
        "wrongly-typed-sampling-field",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}},
        400,
        ["max_new_tokens", "integer"],
    ),
    (
        "wrongly-typed-top-level-field",
        "/generate",
        {"text": "hi", "stream": "yes"},
        400,
        ["stream", "boolean"],
    ),
    ("wrongly-typed-text", "/generate", {"text": 42}, 400, ["text"]),
    ("no-prompt", "/generate", {"sampling_params": {}}, 400, ["text", "input_ids"]),
    ("empty-text", "/generate", {"text": ""}, 400, ["empty"]),
    ("empty-input-ids", "/generate", {"input_ids": []}, 400, ["empty"]),
    ("over-long-prompt", "/generate", {"input_ids": [5] * (CONTEXT_LEN + 10)}, 400, ["context length"]),
    (
        "prompt-plus-output-over-context",
        "/generate",
        {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": CONTEXT_LEN}},
        400,
        ["context length"],
    ),
    (
        "negative-max-new-tokens",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": -1}},
        400,
        ["max_new_tokens"],
    ),
    (
        "negative-temperature",
        "/generate",
        {"text": "hi", "sampling_params": {"temperature": -1}},
        400,
        ["temperature"],
    ),
    ("zero-top-p", "/generate", {"text": "hi", "sampling_params": {"top_p": 0}}, 400, ["top_p"]),
    ("absurd-n", "/generate", {"text": "hi", "sampling_params": {"n": 100000}}, 400, ["n must be"]),
    ("token-id-outside-vocab", "/generate", {"input_ids": [0, 10**6]}, 400, ["vocabulary", "1000000"]),
    ("negative-token-id", "/generate", {"input_ids": [3, -1]}, 400, ["vocabulary"]),
    (
        "stop-token-id-outside-vocab",
        "/generate",
        {"text": "hi", "sampling_params": {"stop_token_ids": [10**6]}},
        400,
        ["stop_token_ids"],
    ),
    (
        "logprob-start-past-prompt",
        "/generate",
        {"input_ids": [3, 4], "return_logprob": True, "logprob_start_len": 5},
        400,
        ["logprob_start_len"],
    ),
    ("unsupported-feature", "/generate", {"text": "hi", "lora_path": "adapter"}, 400, ["lora_path"]),
    (
        "logit-bias-not-a-token",
        "/generate",
        {"text": "hi", "sampling_params": {"logit_bias": {"abc": 1.0}}},
        400,
        ["logit_bias", "abc"],
    ),
    (
        "logit-bias-absurd",
        "/generate",
        {"text": "hi", "sampling_params": {"logit_bias": {"5": 1e9}}},
        400,
        ["logit_bias"],
    ),
    ("openai-malformed-json", "/v1/completions", b"{nope", 400, ["malformed JSON"]),
    ("openai-wrong-type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, ["temperature"]),
    (
        "openai-negative-max-tokens",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": -3},
        400,
        ["max_tokens"],
    ),
    (
        "openai-over-long-prompt",
        "/v1/completions",
        {"prompt": [5] * (CONTEXT_LEN + 1)},
        400,
        ["context length"],
    ),
    ("chat-missing-messages", "/v1/chat/completions", {"model": "x"}, 400, ["messages"]),
    (
        "chat-bad-top-p",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_p": 0},
        400,
        ["top_p"],
    ),
]


def error_message(r: requests.Response) -> str:
    body = r.json()
    if "error" in body:
        err = body["error"]
        return err["message"] if isinstance(err, dict) else err
    return body["message"]  # OpenAI ErrorResponse


@pytest.mark.parametrize(
    "path,body,status,words", [c[1:] for c in GENERATE_CASES], ids=[c[0] for c in GENERATE_CASES]
)
def test_bad_request_gets_4xx_naming_the_problem_and_server_still_answers(
    base_url, path, body, status, words
):
    if isinstance(body, bytes):
        headers = {"Content-Type": "application/json"}
        r = requests.post(base_url + path, data=body, headers=headers, timeout=30)
    else:
        r = requests.post(base_url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    message = error_message(r)
    for word in words:
        assert word in message, message
    ok = requests.post(base_url + "/generate", json=OK_BODY, timeout=60)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_streaming_bad_request_is_an_http_error_not_a_stream(base_url):
    r = requests.post(base_url + "/generate", json={"text": "", "stream": True}, timeout=30)
    assert r.status_code == 400 and "empty" in error_message(r)


# ---------------------------------------------------------------- --api-key


@pytest.fixture(scope="module")
def keyed_server(server, default_model_dir):
    return server(default_model_dir, api_key="sekrit")


def test_api_key_is_required(keyed_server):
    url = keyed_server.base_url
    assert requests.post(url + "/generate", json=OK_BODY, timeout=30).status_code == 401
    bad = requests.post(url + "/generate", json=OK_BODY, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert bad.status_code == 401 and bad.json() == {"error": "Unauthorized"}
    assert requests.get(url + "/v1/models", timeout=30).status_code == 401
    headers = {"Authorization": "Bearer sekrit"}
    good = requests.post(url + "/generate", json=OK_BODY, headers=headers, timeout=60)
    assert good.status_code == 200


def test_health_and_metrics_stay_open_with_an_api_key(keyed_server):
    # Like SGLang: probes and Prometheus scraping need no key.
    assert requests.get(keyed_server.base_url + "/health", timeout=30).status_code == 200
    assert requests.get(keyed_server.base_url + "/metrics", timeout=30).status_code == 200


# ---------------------------------------------------------------- start-up


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_vericache.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_missing_model_folder_exits_2_with_a_clear_message(tmp_path):
    missing = str(tmp_path / "no-such-model")
    res = launch("--model-path", missing)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"error: model folder not found: {missing} (--model-path must be a local Hugging Face model folder or a .gguf file)"
    )


def test_folder_without_config_exits_2(tmp_path):
    res = launch("--model-path", str(tmp_path))
    assert res.returncode == 2
    assert "has no config.json" in res.stderr and str(tmp_path) in res.stderr


def test_bad_flag_value_exits_non_zero(tmp_path):
    res = launch("--model-path", str(tmp_path), "--page-size", "0")
    assert res.returncode != 0 and "--page-size" in res.stderr


def test_unloadable_checkpoint_exits_non_zero_with_the_scheduler_error(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"], "model_type": "nosuch"}')
    with socket.socket() as s:  # a port free now (launch checks it can bind before loading)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = launch("--model-path", str(tmp_path), "--skip-tokenizer-init", "--port", str(port))
    assert res.returncode == 1
    assert any(line.startswith("error: the scheduler failed to start: ") for line in res.stderr.splitlines())


def test_a_port_in_use_exits_2_before_loading_anything(default_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = launch("--model-path", default_model_dir, "--port", str(port))
    assert res.returncode == 2
    assert res.stderr.strip() == (
        f"error: cannot serve on 127.0.0.1:{port}: Address already in use (pick another --port)"
    )


def test_constrained_decoding_is_refused_until_the_scheduler_has_a_grammar_backend(base_url):
    has_grammar = bool(requests.get(base_url + "/server_info", timeout=30).json().get("grammar_backend"))
    r = requests.post(
        base_url + "/generate",
        timeout=60,
        json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}},
    )
    if has_grammar:
        assert r.status_code == 200
    else:
        assert r.status_code == 400 and "regex" in error_message(r)
