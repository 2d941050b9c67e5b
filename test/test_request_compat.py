"""Request compatibility with SGLang: /generate takes every field of the installed sglang's
GenerateReqInput (used, ignored with a warning, or refused by name when set: managers/field_policy.py),
keys SGLang does not know are ignored with a logged warning on the native and OpenAI endpoints, and
wrong types, impossible values and unknown sampling parameters stay 400s."""

from __future__ import annotations

import ast
import importlib.util
import json
import time
import uuid
from pathlib import Path

import pytest
import requests

from sglang_vericache.managers.field_policy import (
    GENERATE_FIELDS,
    OPENAI_ONLY_FIELDS,
    Policy,
    check_openai_body,
)
from sglang_vericache.sampling.sampling_params import InvalidRequest

PROMPT = "def return import class self value"
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
# What sglang-router 0.3.2 adds to every /generate body it forwards (it serializes its own request type).
ROUTER_EXTRA_FIELDS = {"model": None, "no_logs": False, "return_bytes": False, "return_entropy": False}


def sglang_generate_fields() -> dict[str, object]:
    """The installed sglang's GenerateReqInput fields -> their defaults, read from its source (importing
    sglang.srt.managers.io_struct needs GPU-only dependencies)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin, "sglang is not installed"
    source = (Path(spec.origin).parent / "srt" / "managers" / "io_struct.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "GenerateReqInput":
            return {s.target.id: _default(s.value) for s in node.body if isinstance(s, ast.AnnAssign)}
    raise AssertionError("no GenerateReqInput in sglang's io_struct.py")


def _default(node: ast.expr | None) -> object:
    if isinstance(node, ast.Call):  # field(default=..., kw_only=True)
        node = next((k.value for k in node.keywords if k.arg == "default"), None)
    return None if node is None else ast.literal_eval(node)


# A plausible non-default value per field; a field missing here (a newer sglang's) is posted at its default.
PLAUSIBLE = {
    "rid": "compat-rid",
    "session_id": "session-1",
    "text": PROMPT,
    "input_ids": [1, 320, 290, 12],
    "input_embeds": [[0.0] * 8],
    "image_data": "https://example.com/cat.png",
    "video_data": "https://example.com/cat.mp4",
    "audio_data": "https://example.com/cat.wav",
    "mm_hashes": ["ab" * 32],
    "mm_content_hashes": ["sha256:" + "0" * 64],
    "use_audio_in_video": True,
    "video_config": {"fps": 2},
    "sampling_params": GREEDY,
    "watermark": {"key": "k"},
    "return_logprob": True,
    "logprob_start_len": 0,
    "top_logprobs_num": 2,
    "token_ids_logprob": [1, 2],
    "return_sampling_mask": True,
    "sampling_logprobs_mode": "selected",
    "return_text_in_logprobs": True,
    "return_flat_raw_top_logprobs": True,
    "return_flat_raw_output_top_logprobs": True,
    "return_flat_raw_top_logprobs_b64": True,
    "stream": True,
    "log_metrics": False,
    "return_hidden_states": True,
    "return_routed_experts": True,
    "routed_experts_start_len": 1,
    "return_indexer_topk": True,
    "modalities": ["image"],
    "session_params": {"id": "session-1"},
    "lora_path": "my-adapter",
    "lora_id": "adapter-1",
    "custom_logit_processor": '{"callable": "x"}',
    "positional_embed_overrides": {"positions": [0]},
    "bootstrap_host": "127.0.0.1",
    "bootstrap_port": 8998,
    "bootstrap_room": 7,
    "bootstrap_pair_key": "pair",
    "decode_tp_size": 2,
    "routed_dp_rank": 0,
    "data_parallel_rank": 0,
    "disagg_prefill_dp_rank": 0,
    "routing_key": "tenant-a",
    "conversation_id": "conv_1",
    "http_worker_ipc": "ipc:///tmp/worker",
    "background": True,
    "require_reasoning": True,
    "max_thinking_tokens": 16,
    "priority": 5,
    "extra_key": "tenant-a",
    "no_logs": True,
    "custom_labels": {"team": "a"},
    "return_bytes": True,
    "return_entropy": True,
    "return_prompt_token_ids": True,
    "external_trace_header": {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"},
    "received_time": 1700000000.0,
    "need_wait_for_mm_inputs": True,
    "num_items_assigned": {"image": [1]},
    "encoder_urls": ["http://127.0.0.1:1"],
    "max_dynamic_patch": 6,
    "min_dynamic_patch": 1,
    "image_max_dynamic_patch": 6,
    "video_max_dynamic_patch": 2,
    "images_config": {"max_pixels": 1024},
    "mm_processor_kwargs": {"do_resize": False},
    "multi_item_delimiter_indices": [[1]],
    "token_indices_to_pool": [1],
    "cache_salt": "salt",
    "kv_hints": {"version": 1},
}


def post(base_url: str, path: str = "/generate", **body) -> requests.Response:
    return requests.post(base_url + path, json=body, timeout=120)


def message(r: requests.Response) -> str:
    body = r.json()
    err = body.get("error", body)
    return err["message"] if isinstance(err, dict) else err


def wait_for_log(server, text: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        log = Path(server.log_path).read_text(errors="replace")
        if text in log or time.monotonic() > deadline:
            return log
        time.sleep(0.2)


# ---------------------------------------------------------------- the field list


def test_every_field_of_the_installed_sglangs_generate_req_input_has_a_rule():
    fields = sglang_generate_fields()
    assert len(fields) >= 72  # sglang 0.5.23 has 72
    missing = sorted(set(fields) - set(GENERATE_FIELDS))
    assert not missing, f"GenerateReqInput fields with no rule in managers/field_policy.py: {missing}"


@pytest.mark.parametrize("name", sorted(sglang_generate_fields()))
def test_each_sglang_field_is_honoured_ignored_or_refused_by_name(default_server, name):
    fields = sglang_generate_fields()
    value = PLAUSIBLE.get(name, fields[name])
    body = {"text": PROMPT, "sampling_params": GREEDY, name: value}
    if name == "input_ids":
        del body["text"]
    if name == "rid":
        body["rid"] = f"compat-{uuid.uuid4().hex}"
    r = post(default_server.base_url, **body)
    rule = GENERATE_FIELDS.get(name)
    refused = rule is not None and rule.policy is Policy.REFUSED and value != fields[name]
    if refused:
        assert r.status_code == 400, r.text
        assert message(r) == f"{name} is not supported by this server: {rule.why}"
        return
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.text.rstrip().endswith("data: [DONE]")
        return
    assert r.json()["meta_info"]["completion_tokens"] == 4
    if rule is not None and rule.policy is Policy.IGNORED and value != fields[name]:
        log = wait_for_log(default_server, f"request field {name!r} is accepted and ignored")
        assert f"/generate: request field {name!r} is accepted and ignored: {rule.why}" in log


def test_the_routers_extra_fields_change_nothing(base_url):
    plain = post(base_url, text=PROMPT, sampling_params=GREEDY)
    routed = post(base_url, text=PROMPT, sampling_params=GREEDY, **ROUTER_EXTRA_FIELDS)
    assert plain.status_code == routed.status_code == 200, routed.text
    assert routed.json()["output_ids"] == plain.json()["output_ids"]
    assert routed.json()["text"] == plain.json()["text"]


def test_the_routers_full_body_is_served(base_url):
    """Exactly what sglang-router 0.3.2 forwarded for {"text", "sampling_params", "rid"}."""
    body = {
        "text": PROMPT, "model": None, "sampling_params": GREEDY, "return_text_in_logprobs": False,
        "stream": False, "log_metrics": True, "return_hidden_states": False, "background": False,
        "no_logs": False, "return_bytes": False, "return_entropy": False, "rid": f"router-{uuid.uuid4().hex}",
    }
    r = post(base_url, **body)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["id"] == body["rid"]


# ---------------------------------------------------------------- unknown keys: ignored, logged once


@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", {"text": PROMPT, "sampling_params": GREEDY}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ],
)
def test_an_unknown_top_level_field_is_ignored_with_a_logged_warning(default_server, path, body):
    name = f"garbage_{uuid.uuid4().hex[:8]}"
    r = post(default_server.base_url, path, **body, **{name: {"x": 1}})
    assert r.status_code == 200, r.text
    warning = f"{path}: unknown request field {name!r} ignored (as SGLang's server ignores it)"
    log = wait_for_log(default_server, warning)
    assert warning in log
    post(default_server.base_url, path, **body, **{name: 2})
    assert Path(default_server.log_path).read_text(errors="replace").count(warning) == 1  # once per name


@pytest.mark.parametrize(
    "body,words",
    [
        ({"no_logs": "yes"}, ["no_logs must be a boolean"]),
        ({"return_bytes": 1}, ["return_bytes must be a boolean"]),
        ({"priority": "high"}, ["priority must be an integer"]),
        ({"custom_labels": {"team": 1}}, ["custom_labels must be an object of strings"]),
        ({"lora_path": 3}, ["lora_path must be a string"]),
        ({"return_logprob": "yes"}, ["return_logprob must be a boolean"]),
        ({"log_metrics": None}, ["log_metrics must be a boolean"]),
        ({"data_parallel_rank": 1}, ["data_parallel_rank=1 out of range [0, 1)"]),
        ({"routed_dp_rank": -1}, ["routed_dp_rank=-1 out of range [0, 1)"]),
        ({"sampling_params": {"max_new_token": 4}}, ["unknown sampling_params", "max_new_token"]),
        ({"sampling_params": {"structural_tag": "{}"}}, ["sampling_params.structural_tag is not supported"]),
        ({"sampling_params": {"beam_width": 2}}, ["sampling_params.beam_width is not supported"]),
        ({"sampling_params": {"stream_interval": 0}}, ["stream_interval must be >= 1"]),
        ({"sampling_params": {"stream_interval": "2"}}, ["stream_interval must be an integer"]),
    ],
)
def test_wrong_types_impossible_values_and_unknown_sampling_params_are_400s(base_url, body, words):
    r = post(base_url, **{"text": PROMPT, **body})
    assert r.status_code == 400, r.text
    for word in words:
        assert word in message(r)


def test_openai_endpoints_refuse_what_generate_refuses_and_keep_pydantic_types(base_url):
    r = post(base_url, "/v1/completions", prompt=PROMPT, max_tokens=2, lora_path="my-adapter")
    assert r.status_code == 400 and message(r) == (
        "lora_path is not supported by this server: LoRA adapters are not supported"
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = post(base_url, "/v1/chat/completions", **chat, data_parallel_rank=2)
    assert r.status_code == 400 and "data_parallel_rank=2 out of range" in message(r)
    r = post(base_url, "/v1/chat/completions", **chat, return_hidden_states=False, data_parallel_rank=0)
    assert r.status_code == 200, r.text
    r = post(base_url, "/v1/completions", prompt=PROMPT, max_tokens="two")
    assert r.status_code == 400 and "max_tokens" in message(r)


def test_every_own_field_of_the_installed_sglangs_openai_requests_has_a_rule():
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    for model in (CompletionRequest, ChatCompletionRequest):
        own = set(model.model_fields) - set(GENERATE_FIELDS)
        rules = set(OPENAI_ONLY_FIELDS[model.__name__])
        assert (sorted(own - rules), sorted(rules - own)) == ([], []), model.__name__


def test_openai_only_fields_are_ignored_with_one_warning_or_refused_by_name(caplog):
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    where = f"/v1/chat/completions-{uuid.uuid4().hex}"  # warnings are once per (endpoint, name)
    with caplog.at_level("WARNING", logger="sglang_vericache.managers.field_policy"):
        for _ in range(2):
            check_openai_body({**chat, "user": "u-1", "reasoning_effort": "low", "return_meta_info": False},
                              ChatCompletionRequest, where)
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"{where}: request field 'reasoning_effort' is accepted and ignored: read by some reasoning models' "
        "chat templates; not passed to the template here (chat_template_kwargs is)",
        f"{where}: request field 'user' is accepted and ignored: an end-user id for the provider's abuse "
        "monitoring; nothing here uses it",
    ]
    with pytest.raises(InvalidRequest, match="^continue_final_message is not supported by this server: the chat "
                                             "template always opens a new assistant message here$"):
        check_openai_body({**chat, "continue_final_message": True}, ChatCompletionRequest, where)
    with pytest.raises(InvalidRequest, match="^return_token_ids is not supported by this server: this server "
                                             "does not compute it on this endpoint"):
        check_openai_body({"model": "m", "prompt": "x", "return_token_ids": True}, CompletionRequest, where)
    check_openai_body({"model": "m", "prompt": "x", "echo": True, "return_token_ids": False}, CompletionRequest,
                      where)


# ---------------------------------------------------------------- fields implemented here


def test_beam_width_one_is_ordinary_sampling(base_url):
    plain = post(base_url, text=PROMPT, sampling_params=GREEDY).json()
    one = post(base_url, text=PROMPT, sampling_params={**GREEDY, "beam_width": 1, "watermark": None}).json()
    assert one["output_ids"] == plain["output_ids"]


def test_return_prompt_token_ids_returns_the_tokenized_prompt(base_url, default_model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(default_model_dir).encode(PROMPT)
    out = post(base_url, text=PROMPT, sampling_params=GREEDY, return_prompt_token_ids=True).json()
    assert out["prompt_token_ids"] == ids
    batch = [[1, 5, 9], [1, 7]]
    outs = post(base_url, input_ids=batch, sampling_params=GREEDY, return_prompt_token_ids=True).json()
    assert [o["prompt_token_ids"] for o in outs] == batch
    assert "prompt_token_ids" not in post(base_url, text=PROMPT, sampling_params=GREEDY).json()


def _requests_total(base_url: str) -> float:
    for line in requests.get(base_url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("sglang:num_requests_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no sglang:num_requests_total")


def test_log_metrics_false_leaves_the_request_out_of_the_metrics(base_url):
    before = _requests_total(base_url)
    assert post(base_url, text=PROMPT, sampling_params=GREEDY, log_metrics=False).status_code == 200
    assert requests.get(base_url + "/health_generate", timeout=60).status_code == 200  # SGLang's: unlogged
    assert _requests_total(base_url) == before
    assert post(base_url, text=PROMPT, sampling_params=GREEDY).status_code == 200
    assert _requests_total(base_url) == before + 1


def test_per_request_stream_interval_batches_stream_events(base_url):
    params = {**GREEDY, "max_new_tokens": 10, "stream_interval": 4}
    body = {"text": PROMPT, "sampling_params": params, "stream": True}
    r = requests.post(base_url + "/generate", json=body, stream=True, timeout=120)
    counts = [
        json.loads(line[6:])["meta_info"]["completion_tokens"]
        for line in r.iter_lines(decode_unicode=True)
        if line.startswith("data: {")
    ]
    assert counts[-1] == 10
    steps = [b - a for a, b in zip(counts, counts[1:-1])]  # between the first and the final event
    assert all(step >= 4 for step in steps), counts


def test_get_load_is_sglangs_per_dp_rank_list(base_url):
    loads = requests.get(base_url + "/get_load", timeout=30).json()
    assert [sorted(x) for x in loads] == [["dp_rank", "num_reqs", "num_tokens", "num_waiting_reqs"]]
    assert loads[0]["dp_rank"] == 0 and loads[0]["num_reqs"] >= 0 and loads[0]["num_tokens"] >= 0


def test_model_info_has_sglangs_keys(base_url):
    info = requests.get(base_url + "/model_info", timeout=30).json()
    keys = (
        "model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
        "weight_version", "load_format", "reasoning_parser", "tool_call_parser", "disaggregation_mode",
        "has_image_understanding", "has_audio_understanding", "model_type", "architectures",
    )  # SGLang 0.5.23's /model_info
    assert [k for k in keys if k not in info] == []


@pytest.fixture(scope="module")
def logged_server(server, default_model_dir):
    return server(default_model_dir, "--log-requests", "--log-level", "info")


def test_no_logs_keeps_the_request_out_of_the_request_log(logged_server):
    quiet, loud = f"quiet-{uuid.uuid4().hex}", f"loud-{uuid.uuid4().hex}"
    url = logged_server.base_url
    assert post(url, text=PROMPT, sampling_params=GREEDY, rid=quiet, no_logs=True).status_code == 200
    assert post(url, text=PROMPT, sampling_params=GREEDY, rid=loud).status_code == 200
    log = wait_for_log(logged_server, f"Finish: rid={loud}")
    assert f"Receive: rid={loud}" in log and f"Finish: rid={loud}" in log
    assert quiet not in log
