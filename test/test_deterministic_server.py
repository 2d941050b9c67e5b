"""A user's view of deterministic inference, the default: the bundled model served without any
deterministic flag, in bfloat16 (its default dtype), gives every prompt the same tokens and logprobs when asked alone and when asked
among 18 concurrent requests, 4 of them aborted mid-stream and 4 malformed (the in-process tests
check 32 concurrent requests); a VeriCache server's
output equals the full-mode server's (neither started with a deterministic flag)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from sglang_vericache.server_args import bundled_model_path

pytestmark = pytest.mark.slow
NEW = 24


def targets():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (9, 40, 77, 150)]


def generate(url, ids, **extra):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
            "return_logprob": True, **extra}
    r = requests.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    out = r.json()
    return out["output_ids"], [e[0] for e in out["meta_info"]["output_token_logprobs"]]


def aborted_stream(url, ids):
    """Reads two events of a long stream, then hangs up (the server aborts the request)."""
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
            "stream": True}
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 2:
                break


def bad(url, i):
    bodies = [b"{not json", json.dumps({"input_ids": "x"}).encode(),
              json.dumps({"text": "a", "sampling_params": {"temperature": -1}}).encode(),
              json.dumps({"text": "a", "sampling_params": {"max_new_tokens": "many"}}).encode()]
    r = requests.post(url + "/generate", data=bodies[i % 4], headers={"Content-Type": "application/json"},
                      timeout=60)
    assert 400 <= r.status_code < 500, r.text


def under_load(url, prompts):
    g = torch.Generator().manual_seed(12)
    crowd = [torch.randint(10, 4000, (int(n),), generator=g).tolist() for n in torch.randint(5, 160, (10,))]
    with ThreadPoolExecutor(24) as pool:
        mine = [pool.submit(generate, url, p) for p in prompts]
        others = [pool.submit(generate, url, c) for c in crowd]
        others += [pool.submit(aborted_stream, url, c) for c in crowd[:4]]
        others += [pool.submit(bad, url, i) for i in range(4)]
        for f in others:
            f.result()
        return [f.result() for f in mine]


@pytest.fixture(scope="module")
def full_server(server):
    return server(bundled_model_path(), "--dtype", "bfloat16")  # deterministic by default: no flag


def test_full_mode_alone_equals_under_load_with_aborts_and_bad_input(full_server):
    url = full_server.base_url
    info = requests.get(url + "/server_info", timeout=10).json()
    assert info["enable_deterministic_inference"] is True and info["dtype"] == "bfloat16"
    assert info["batch_invariant_linear"] == "packed x16"
    alone = [generate(url, p) for p in targets()]
    assert under_load(url, targets()) == alone


def test_vericache_server_equals_deterministic_full_server(server, full_server):
    vc = server(bundled_model_path(), "--dtype", "bfloat16", "--kv-compressor", "snapkv",
                "--speculative-algorithm", "VERICACHE", "--speculative-num-draft-tokens", "4")
    assert requests.get(vc.base_url + "/server_info", timeout=10).json()["enable_deterministic_inference"] is True
    assert under_load(vc.base_url, targets()) == [generate(full_server.base_url, p) for p in targets()]
