"""VeriCache through the HTTP server: the same text as a full-mode server, per-request round
counters in meta_info, tier budgets in /server_info, VeriCache counters in /metrics."""

from __future__ import annotations

import json

import pytest
import requests

FLAGS = ("--kv-compressor", "int8", "--speculative-algorithm", "VERICACHE",
         "--speculative-num-draft-tokens", "6", "--page-size", "8",
         "--vericache-schedule", "lockstep")  # rounds under test (the adaptive default may decode instead)
PROMPTS = ["def parse(text):\n", "import sys\n\nclass Config:\n", "x = [1, 2, 3]\nfor item in x:\n"]
BODY = {"sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def servers(server, default_model_dir):
    return server(default_model_dir, "--page-size", "8"), server(default_model_dir, *FLAGS)


def test_vericache_server_returns_the_full_mode_text(servers):
    full, vc = servers
    a = requests.post(full.base_url + "/generate", json={"text": PROMPTS, **BODY}).json()
    b = requests.post(vc.base_url + "/generate", json={"text": PROMPTS, **BODY}).json()
    assert [x["output_ids"] for x in b] == [x["output_ids"] for x in a]
    assert [x["text"] for x in b] == [x["text"] for x in a]
    meta = b[0]["meta_info"]
    # Rounds emit accepted drafts + the verifier's token; the first token comes from prefill.
    assert meta["spec_rounds"] + meta["spec_accepted_tokens"] == 23
    assert meta["spec_accept_length"] == pytest.approx((meta["spec_accepted_tokens"] + meta["spec_rounds"])
                                                       / meta["spec_rounds"])
    assert meta["spec_draft_time_s"] > 0 and meta["spec_verify_time_s"] > 0
    assert not any(k.startswith("_") for k in meta)


def test_streaming_sends_accepted_runs(servers):
    _, vc = servers
    with requests.post(vc.base_url + "/generate", json={"text": PROMPTS[0], "stream": True, **BODY},
                       stream=True) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                  if line and line.startswith("data: ") and line != "data: [DONE]"]
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts[-1] == 24 and counts == sorted(counts)
    # int8 drafts are accepted most of the time, so some events carry several tokens at once.
    assert max(b - a for a, b in zip(counts, counts[1:])) > 1


def test_server_info_and_metrics_report_the_tiers(servers):
    _, vc = servers
    info = requests.get(vc.base_url + "/server_info").json()
    assert info["kv_mode"] == "vericache"
    assert info["exact_tier"]["where"] == "host"
    assert info["compressed_tier"]["compressor"] == "int8"
    assert info["compressed_tier"]["chunks"] > 0
    requests.post(vc.base_url + "/generate", json={"text": PROMPTS[1], **BODY})
    metrics = requests.get(vc.base_url + "/metrics").text
    for name in ("spec_rounds_total", "spec_accepted_tokens_total", "compressed_chunks_total",
                 "compressed_chunks_free"):
        assert f"sglang:{name}{{" in metrics
