"""SGLang launch flags with their meaning here: --tp-size's bounds (tensor parallelism itself is in
test_tensor_parallel.py), --dp-size (>= 1; replicas behind sglang-router: test_sglang_router.py,
test_dp_flags.py), --mem-fraction-static,
--trust-remote-code, --quantization (refused), --schedule-policy lpm, --log-requests,
--enable-cache-report; --reasoning-parser is in test_reasoning_parser.py."""

from __future__ import annotations

import logging

import pytest

import sglang_vericache
from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.model_executor import model_runner
from sglang_vericache.model_executor.model_runner import static_kv_bytes
from sglang_vericache.server_args import ServerArgs, prepare_server_args
from sglang_vericache.testing.scheduler_harness import make_request, random_prompts, run_to_completion

GIB = 2**30


def test_sglang_command_line_parses():
    args = prepare_server_args(
        [
            "--tensor-parallel-size",
            "1",
            "--dp-size",
            "1",
            "--mem-fraction-static",
            "0.8",
            "--trust-remote-code",
            "--schedule-policy",
            "lpm",
            "--enable-metrics",
            "--log-requests",
            "--enable-cache-report",
            "--reasoning-parser",
            "qwen3",
        ]
    )
    assert (args.tp_size, args.dp_size, args.mem_fraction_static) == (1, 1, 0.8)
    assert (args.trust_remote_code, args.enable_metrics, args.log_requests, args.enable_cache_report) == (
        True,
        True,
        True,
        True,
    )
    assert (args.schedule_policy, args.reasoning_parser, args.quantization) == ("lpm", "qwen3", None)
    defaults = prepare_server_args([])
    assert (defaults.tp_size, defaults.schedule_policy, defaults.mem_fraction_static) == (1, "fcfs", None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tp_size": 0}, r"--tp-size 0, --nnodes 1, --node-rank 0: need tp_size >= 1"),
        ({"tp_size": 2, "nnodes": 2}, r"--nnodes > 1 needs --dist-init-addr HOST:PORT"),
        ({"tp_size": 2, "dist_init_addr": "node0"}, r"--dist-init-addr must be HOST:PORT, got 'node0'"),
        ({"tp_size": 2, "kv_compressor": "snapkv", "speculative_algorithm": "VERICACHE",
          "vericache_schedule": "adaptive"},
         r"--vericache-schedule adaptive is not supported with --tp-size 2 \(its controller decides from each"),
        ({"dp_size": 0}, "--dp-size must be >= 1, got 0"),
        ({"dp_size": 2, "disagg_role": "verifier", "disagg_port": 31000},
         "--dp-size with --disagg-role verifier: a verifier serves no HTTP"),
        ({"mem_fraction_static": 0.0}, r"--mem-fraction-static must be in \(0, 1\), got 0.0"),
        ({"mem_fraction_static": 1.2}, r"--mem-fraction-static must be in \(0, 1\), got 1.2"),
        ({"quantization": "fp8"}, "--quantization fp8: quantized weights are not supported"),
        ({"schedule_policy": "random"}, "--schedule-policy must be one of fcfs, lpm, got 'random'"),
        ({"reasoning_parser": "nope"}, "--reasoning-parser must be one of .*qwen3.*; got 'nope'"),
    ],
)
def test_bad_values_are_refused_with_the_flag_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_cli_reports_bad_values_as_usage_errors(capsys):
    with pytest.raises(SystemExit) as e:
        prepare_server_args(["--tp-size", "8", "--nnodes", "3", "--dist-init-addr", "10.0.0.1:5000"])
    assert e.value.code == 2
    assert "--nnodes 3 must divide --tp-size 8 (ranks per node)" in capsys.readouterr().err


def test_static_kv_bytes_is_the_fraction_minus_what_is_in_use():
    # 100 GiB device, 20 GiB in use after the weights: 0.9 leaves 90 - 20 = 70 GiB for KV.
    assert static_kv_bytes(0.9, 100 * GIB, 80 * GIB) == 70 * GIB
    assert static_kv_bytes(0.5, 64 * GIB, 40 * GIB) == 8 * GIB
    with pytest.raises(
        ValueError,
        match=r"--mem-fraction-static 0.2 leaves no memory for the KV cache: "
        r"30.0 GiB of 100.0 GiB is in use",
    ):
        static_kv_bytes(0.2, 100 * GIB, 70 * GIB)


def _scheduler(path, **kwargs) -> Scheduler:
    return Scheduler(
        ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=8, **kwargs)
    )


def test_mem_fraction_static_sizes_the_exact_pool_in_full_mode(default_model_dir, monkeypatch):
    monkeypatch.setattr(model_runner, "_memory", lambda device: (1000 * 2**20, 900 * 2**20))
    sched = _scheduler(default_model_dir, mem_fraction_static=0.2)  # 200 MiB - 100 MiB in use
    mr = sched.model_runner
    per_token = mr.exact_bytes_per_token
    assert mr.static_kv_bytes == 100 * 2**20
    assert sched.max_total_num_tokens == (100 * 2**20 // per_token) // 8 * 8
    # --max-total-tokens still wins.
    assert (
        _scheduler(default_model_dir, mem_fraction_static=0.2, max_total_tokens=512).max_total_num_tokens
        == 512
    )


def test_mem_fraction_static_is_the_device_budget_of_the_compressed_tier(default_model_dir, monkeypatch):
    monkeypatch.setattr(model_runner, "_memory", lambda device: (1000 * 2**20, 990 * 2**20))
    two_tier = {"kv_compressor": "snapkv", "speculative_algorithm": "VERICACHE", "max_total_tokens": 4096}
    by_fraction = _scheduler(default_model_dir, mem_fraction_static=0.012, **two_tier)  # 12 - 10 = 2 MiB
    by_budget = _scheduler(default_model_dir, device_kv_budget=str(2 * 2**20), **two_tier)
    assert by_fraction.two_tier.pool.num_chunks == by_budget.two_tier.pool.num_chunks
    assert (
        by_fraction.two_tier.pool.num_chunks
        < _scheduler(default_model_dir, **two_tier).two_tier.pool.num_chunks
    )


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first(default_model_dir):
    shared, other, tail = random_prompts([48, 40, 8], seed=3)
    results = {}
    for policy in ("fcfs", "lpm"):
        sched = _scheduler(default_model_dir, schedule_policy=policy, max_running_requests=1)
        run_to_completion(sched, [make_request("warm", shared + [7], max_new_tokens=2, temperature=0.0)])
        for r in (
            make_request("cold", other, max_new_tokens=4, temperature=0.0),
            make_request("hit", shared + tail, max_new_tokens=4, temperature=0.0),
        ):
            assert sched.handle_message(r) is None
        sched.step()
        results[policy] = [(r.rid, r.cached_tokens) for r in sched.running]
    assert results == {"fcfs": [("cold", 0)], "lpm": [("hit", 48)]}


MODES = {
    "full": {},
    "vericache": {
        "kv_compressor": "snapkv",
        "speculative_algorithm": "VERICACHE",
        "speculative_num_draft_tokens": "4",
    },
    "lossy": {"kv_compressor": "kivi4"},
}


@pytest.mark.parametrize("mode", MODES)
def test_lpm_changes_order_not_outputs_in_every_mode(default_model_dir, mode):
    # Three shared prefixes, nine requests, a small pool and chunked prefill: the policies admit in
    # different orders (and lpm passes over same-prefix requests within a batch).
    shared = random_prompts([40, 72, 24], seed=11)
    tails = random_prompts([5, 9, 17, 3, 30, 12, 8, 21, 6], seed=12)
    prompts = [shared[i % 3] + t for i, t in enumerate(tails)]
    outs = {}
    for policy in ("fcfs", "lpm"):
        sched = _scheduler(
            default_model_dir,
            schedule_policy=policy,
            max_total_tokens=320,
            max_running_requests=3,
            chunked_prefill_size=32,
            **MODES[mode],
        )
        reqs = [
            make_request(f"r{i}", p, max_new_tokens=20, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts)
        ]
        res = run_to_completion(sched, reqs)
        outs[policy] = [res[f"r{i}"].output_ids for i in range(len(prompts))]
        assert sched.allocator.available_size() + sched.tree_cache.evictable_size() == sched.allocator.size
    assert outs["lpm"] == outs["fcfs"]
    assert all(len(o) == 20 for o in outs["lpm"])


def test_log_requests_logs_arrival_and_finish(default_model_dir, caplog):
    with sglang_vericache.Engine(
        model_path=default_model_dir, max_total_tokens=1024, log_requests=True
    ) as eng:
        with caplog.at_level(logging.INFO, logger="sglang_vericache.requests"):
            out = eng.generate(
                "def f(x):", {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}, rid="r-1"
            )
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_vericache.requests"]
    n = out["meta_info"]["prompt_tokens"]
    assert lines[0] == (
        f"Receive: rid=r-1 prompt_tokens={n} stream=False sampling_params="
        "{'max_new_tokens': 5, 'temperature': 0, 'ignore_eos': True}"
    )
    assert lines[1].startswith(
        f"Finish: rid=r-1 prompt_tokens={n} completion_tokens=5 cached_tokens=0 "
        "finish_reason={'type': 'length', 'length': 5} e2e_latency="
    )
    assert lines[1].endswith(f" text={out['text']!r}")
    assert len(lines) == 2


def test_usage_reports_cached_prompt_tokens_once_per_prompt():
    from sglang_vericache.entrypoints.openai.utils import usage_of

    outs = [{"meta_info": {"prompt_tokens": 40, "completion_tokens": c, "cached_tokens": 32}} for c in (5, 7)]
    usage = usage_of(outs, n=2, cache_report=True)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 12, 52)
    assert usage.prompt_tokens_details.cached_tokens == 32
    assert usage_of(outs, n=2).prompt_tokens_details is None


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "


def test_server_with_cache_report_request_log_and_chat_template(server, default_model_dir, tmp_path):
    import requests
    from transformers import AutoTokenizer

    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    srv = server(
        default_model_dir,
        "--enable-cache-report",
        "--log-requests",
        "--log-level",
        "info",
        "--chat-template",
        str(template),
    )
    messages = [{"role": "user", "content": "def f(x):"}]
    r = requests.post(srv.base_url + "/v1/tokenize", json={"model": "m", "messages": messages}, timeout=60)
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert r.json()["tokens"] == tok.encode("[user] def f(x):\n[assistant] ", add_special_tokens=False)
    prompt = random_prompts([40], seed=5)[0]
    body = {"model": "m", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    cached = []
    for _ in range(2):
        r = requests.post(srv.base_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    # The second request finds the first's prompt in the radix cache: 39 reusable tokens, 2 pages of 16.
    assert cached == [0, 32]
    log = srv.log_tail(200)
    assert log.count("Receive: rid=") == 2  # /v1/tokenize is not a request
    assert "prompt_tokens=40 completion_tokens=3 cached_tokens=32 finish_reason={'type': 'length'" in log


def test_chat_template_is_checked_at_launch(tmp_path):
    with pytest.raises(ValueError, match=r"--chat-template /nonexistent.jinja: no such file"):
        ServerArgs(chat_template="/nonexistent.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(
        ValueError, match=r"not a valid Jinja template: Unexpected end of template.*\(line 1\)"
    ):
        ServerArgs(chat_template=str(bad))
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert ServerArgs(chat_template=str(good)).chat_template == str(good)
