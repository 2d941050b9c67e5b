"""What a user sees of the running mode: the startup line (KV mode, compressor and ratio, draft
tokens, schedule), the spec_* fields of every response's meta_info (zero where no round ran), the
adaptive schedule's note on why it decodes as full mode, and SGLang's periodic "Prefill batch." /
"Decode batch." lines with the KV use of each tier."""

from __future__ import annotations

import logging
import re
import time

import pytest
import requests

from sglang_vericache.managers.batch_log import KVUse, decode_line, prefill_line
from sglang_vericache.speculative.controller import RequestView, StepCostModel, VeriCacheController
from sglang_vericache.speculative.full_mode_note import FullModeNote, best_rounds, full_mode_reason
from sglang_vericache.speculative.round_state import SPEC_META_DEFAULTS

# A server of this module's own: the "Decode batch." lines fall every N decode iterations counted since the
# server started (SGLang's forward_ct_decode), so a server other tests decoded on would shift them.
SERVING_FLAGS = ("--log-level", "info", "--decode-log-interval", "3")
VERICACHE_FLAGS = ("--log-level", "info", "--decode-log-interval", "4", "--kv-compressor", "int8",
                   "--speculative-algorithm", "VERICACHE", "--page-size", "8")  # the default (adaptive) schedule
PROMPT_IDS = [7, 300, 9, 301, 11, 302, 13, 303, 15, 304] * 2  # 20 tokens, shared with no other test's prompt
SPEC_ZEROS = {"spec_rounds": 0, "spec_drafted_tokens": 0, "spec_accepted_tokens": 0, "spec_accept_length": 0.0,
              "spec_draft_time_s": 0.0, "spec_verify_time_s": 0.0, "spec_ngram_proposed_tokens": 0,
              "spec_ngram_accepted_tokens": 0}


def read_log(server, since: int = 0) -> str:
    with open(server.log_path, errors="replace") as f:
        return f.read()[since:]


def generate_and_log(server, new_tokens: int) -> tuple[dict, str]:
    """One greedy request of PROMPT_IDS; -> its meta_info and the scheduler's log lines it caused."""
    start = len(read_log(server))
    body = {"input_ids": PROMPT_IDS, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                          "ignore_eos": True}}
    meta = requests.post(server.base_url + "/generate", json=body).json()["meta_info"]
    time.sleep(0.5)  # the scheduler's last lines reach the log file
    return meta, read_log(server)[start:]


def scheduler_lines(log: str, prefix: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"scheduler\] (" + re.escape(prefix) + r".*)", log)]


@pytest.fixture(scope="module")
def full_server(server, default_model_dir):
    s = server(default_model_dir, *SERVING_FLAGS)
    yield s
    s.kill()  # no other module asks for these flags: its memory back now, not at the session's end


@pytest.fixture(scope="module")
def vericache_server(server, default_model_dir):
    s = server(default_model_dir, *VERICACHE_FLAGS)
    yield s
    s.kill()


def test_full_mode_startup_line_meta_and_periodic_lines(full_server):
    assert scheduler_lines(read_log(full_server), "KV mode:") == [
        "KV mode: full (exact KV only, in the KV pool; no VeriCache)"]
    meta, log = generate_and_log(full_server, 10)
    assert {k: v for k, v in meta.items() if k.startswith("spec_")} == SPEC_ZEROS
    # One prefill of 20 tokens (2 pages of 16 held), then 9 decode steps: lines before steps 3, 6 and 9.
    assert scheduler_lines(log, "Prefill batch.") == [
        "Prefill batch. #new-seq: 1, #new-token: 20, #cached-token: 0, #token: 32, token usage: 0.00, "
        "#running-req: 0, #queue-req: 0"]
    decode = scheduler_lines(log, "Decode batch.")
    assert len(decode) == 3
    for line in decode:
        assert re.fullmatch(r"Decode batch\. #running-req: 1, #token: 32, token usage: 0\.00, "
                            r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: 0", line), line


def test_vericache_adaptive_without_rounds(vericache_server):
    log = read_log(vericache_server)
    ratio = requests.get(vericache_server.base_url + "/server_info").json()["compressed_tier"]["effective_ratio"]
    assert scheduler_lines(log, "KV mode:") == [
        "KV mode: vericache (VeriCache: draft over the compressed KV, verify over the exact KV; outputs equal "
        f"full mode's), compressor int8 (effective ratio {ratio:.2f}x), draft tokens 16 per round, schedule "
        "adaptive (rounds only where the measured costs predict them faster than decoding as full mode; else "
        "it decodes as full mode)"]
    # Before any decode forward is measured a request is admitted decode-only: it decodes as full mode.
    meta, log = generate_and_log(vericache_server, 10)
    assert {k: v for k, v in meta.items() if k.startswith("spec_")} == SPEC_ZEROS
    notes = re.findall(r"adaptive VeriCache decodes as full mode: (.*)", log)
    assert len(notes) == 1 and notes[0].startswith(
        "its 1 running request(s) were admitted decode-only (exact KV resident, no compressed tier")
    assert "step costs not measured yet (0 of 8 decode forwards, 1 prefills): " in notes[0]
    assert re.search(r"; predicted \d+\.\d tok/s decoding$", notes[0])
    decode = scheduler_lines(log, "Decode batch.")
    assert len(decode) == 2
    for line in decode:
        assert re.fullmatch(r"Decode batch\. #running-req: 1, #token: \d+, token usage: \d\.\d\d, "
                            r"#compressed-chunk: \d+/\d+, compressed usage: \d\.\d\d, #spec-round: 0, "
                            r"gen throughput \(token/s\): \d+\.\d\d, #queue-req: 0", line), line


def test_line_formats():
    use = KVUse(48, 1000)
    assert prefill_line(2, 40, 16, use, 1, 3) == (
        "Prefill batch. #new-seq: 2, #new-token: 40, #cached-token: 16, #token: 48, token usage: 0.05, "
        "#running-req: 1, #queue-req: 3")
    assert decode_line(4, use, 123.456, 0) == (
        "Decode batch. #running-req: 4, #token: 48, token usage: 0.05, gen throughput (token/s): 123.46, "
        "#queue-req: 0")
    two_tier = KVUse(48, 1000, 30, 120)
    assert decode_line(4, two_tier, 10.0, 2, (5, 10)) == (
        "Decode batch. #running-req: 4, #token: 48, token usage: 0.05, #compressed-chunk: 30/120, "
        "compressed usage: 0.25, #spec-round: 5, accept len: 3.00, gen throughput (token/s): 10.00, #queue-req: 2")
    assert decode_line(1, two_tier, 1.0, 0, (0, 0)).endswith(
        "#spec-round: 0, gen throughput (token/s): 1.00, #queue-req: 0")
    assert set(SPEC_META_DEFAULTS) == set(SPEC_ZEROS) and not any(SPEC_META_DEFAULTS.values())


def _controller(c_comp: float) -> VeriCacheController:
    # c0, c_row, c_exact, c_comp, c_qk (seconds); the draft overhead's prior is a quarter of c0.
    return VeriCacheController(StepCostModel((0.01, 1e-4, 1e-7, c_comp, 1e-10)), 1024, None)


def test_full_mode_note_says_why():
    views = [RequestView(committed=1000, resident=True, accept_rate=0.5, comp_keys=1000, max_draft=16),
             RequestView(committed=500, resident=True, accept_rate=0.0, comp_keys=0, max_draft=16, can_draft=False)]
    ctl = _controller(c_comp=1e-5)  # compressed keys dearer than exact ones: rounds lose
    decision = ctl.decide(views)
    assert not any(p.draft_len for p in decision.plans)
    alt, x = best_rounds(ctl, views)
    assert alt.throughput < decision.throughput and x in ctl.draft_lengths
    text = full_mode_reason(ctl, views, decision)
    assert text.startswith("adaptive VeriCache decodes as full mode: rounds are predicted slower than decoding "
                           "for the 1 of 2 request(s) that can draft (1 admitted decode-only); step costs not "
                           "measured yet (0 of 8 decode forwards, 0 prefills): 10 ms per forward, 100 us per row, "
                           "100 ns per exact key, 10 us per compressed key, 0.1 ns per query-key product, "
                           "2.5 ms per forward with drafts; ")
    assert text.endswith(f"predicted {decision.throughput:.1f} tok/s decoding vs {alt.throughput:.1f} tok/s "
                         f"with rounds of up to {x} drafts (acceptance 0.50)")
    only = [RequestView(committed=10, resident=True, accept_rate=0.8, comp_keys=0, max_draft=8, can_draft=False)]
    text = full_mode_reason(ctl, only, ctl.decide(only))
    assert "its 1 running request(s) were admitted decode-only" in text and " vs " not in text
    note = FullModeNote(every_s=3600.0)
    assert note.maybe_log(ctl, only, ctl.decide(only)) and not note.maybe_log(ctl, only, ctl.decide(only))
    again = FullModeNote(every_s=0.0)
    assert again.maybe_log(ctl, only, ctl.decide(only)) and again.maybe_log(ctl, only, ctl.decide(only))


def _fake_scheduler(running: int, queue: int):
    from types import SimpleNamespace

    from sglang_vericache.managers.stats import SchedulerMetrics

    return SimpleNamespace(metrics=SchedulerMetrics(), running=[object()] * running, waiting_queue=[object()] * queue,
                           max_total_num_tokens=1000, allocator=SimpleNamespace(available_size=lambda: 900),
                           tree_cache=SimpleNamespace(evictable_size=lambda: 36), two_tier=None)


def test_batch_log_interval_and_rank(caplog):
    from sglang_vericache.managers.batch_log import BatchLog

    s = _fake_scheduler(running=3, queue=1)
    s.metrics.num_cached_tokens_total = 16
    with caplog.at_level(logging.INFO, logger="sglang_vericache.managers.batch_log"):
        log = BatchLog(decode_log_interval=3, vericache=True)
        log.on_prefill(s, [(None, 24), (None, 8)])
        s.metrics.on_spec_round(drafted=4, accepted=3)
        s.metrics.on_spec_round(drafted=4, accepted=1)
        for _ in range(7):  # lines before the 3rd and the 6th iterations
            log.on_decode(s)
        quiet = BatchLog(decode_log_interval=1, vericache=False, enabled=False)  # a tensor-parallel rank > 0
        quiet.on_prefill(s, [(None, 24)])
        quiet.on_decode(s)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert lines[0] == ("Prefill batch. #new-seq: 2, #new-token: 32, #cached-token: 16, #token: 64, "
                        "token usage: 0.06, #running-req: 3, #queue-req: 1")
    assert re.fullmatch(r"Decode batch\. #running-req: 3, #token: 64, token usage: 0\.06, #spec-round: 2, "
                        r"accept len: 3\.00, gen throughput \(token/s\): 0\.00, #queue-req: 1", lines[1])
    assert re.fullmatch(r"Decode batch\. #running-req: 3, #token: 64, token usage: 0\.06, #spec-round: 0, "
                        r"gen throughput \(token/s\): 0\.00, #queue-req: 1", lines[2])
