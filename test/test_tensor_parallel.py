"""--tp-size 2 on the CPU (gloo, two rank processes) against --tp-size 1.

One pool of two ranks (testing/tp_ranks.py) runs every scheduler-level job: each builds a
Scheduler on both ranks over the same random checkpoint and hands both the same requests. The
launcher, the broadcast of requests from rank 0 and a killed rank are checked through
Engine(tp_size=2), whose ranks are real scheduler processes behind ZMQ.
"""

from __future__ import annotations

import os
import signal

import msgspec
import pytest
import torch

import sglang_vericache
from sglang_vericache.managers import request_broadcast
from sglang_vericache.layers.vocab_parallel_embedding import vocab_range
from sglang_vericache.managers.io_struct import AbortReq, FlushCacheReq, GetStatsReq
from sglang_vericache.managers.watchdog import TP_EXIT_CODE
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request
from sglang_vericache.testing.tp_ranks import Job, TPRanks, run_job

FAMILY_OVERRIDES = {"llama": {}, "qwen2": {"vocab_size": 515}, "qwen3": {}}  # qwen2: tied, vocab not / 2
SEEDED = {"temperature": 0.9, "top_p": 0.95, "top_k": 40}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {f: make_random_checkpoint(f, str(tmp_path_factory.mktemp(f"tp-{f}")), **o)
            for f, o in FAMILY_OVERRIDES.items()}


@pytest.fixture(scope="module")
def ranks():
    pool = TPRanks(2)
    yield pool
    pool.close()


def prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def args(path, **extra):
    return {"model_path": path, "skip_tokenizer_init": True, "max_total_tokens": 1024, "page_size": 8, **extra}


@pytest.mark.parametrize("family", sorted(FAMILY_OVERRIDES))
def test_tp2_emits_the_tp1_tokens_in_float32(checkpoints, ranks, family):
    job = Job(args(checkpoints[family], enable_deterministic_inference=False), prompts([6, 19, 33], seed=1), 10)
    tp1 = run_job(job)  # this process: the one-rank group
    tp2 = ranks.run(job)
    assert tp2["output_ids"] == tp1["output_ids"]
    assert tp2["tp_stats"]["all_reduce"] > 0 and tp2["tp_stats"]["all_gather"] > 0  # really sharded
    assert tp1["tp_stats"] == {"all_reduce": 0, "all_gather": 0, "broadcast": 0}


@pytest.mark.parametrize(("compressor", "schedule", "sampling"), [
    ("snapkv", "lockstep", {"temperature": 0.0}),
    ("int8", "staggered", SEEDED),
    ("kvzip", "lockstep", SEEDED),  # its default ranks each rank's KV heads together (--kv-head-budget auto)
])
def test_vericache_at_tp2_equals_full_at_tp2_bitwise_in_bfloat16(checkpoints, ranks, compressor, schedule,
                                                                  sampling):
    base = args(checkpoints["qwen2"], dtype="bfloat16", enable_deterministic_inference=True)
    ps = prompts([5, 37, 70], seed=3)
    full = ranks.run(Job(base, ps, 12, sampling))
    room = {"max_total_tokens": 4096} if compressor == "kvzip" else {}  # room for its replay's scratch (2,071 slots here)
    vc = ranks.run(Job({**base, **room, "kv_compressor": compressor, "speculative_algorithm": "VERICACHE",
                        "speculative_num_draft_tokens": "6", "vericache_schedule": schedule,
                        **({"link_bandwidth": "1GB"} if schedule == "staggered" else {})}, ps, 12, sampling))
    assert vc["output_ids"] == full["output_ids"]
    assert vc["logprobs"] == full["logprobs"]  # bitwise: float == float
    assert sum(m["spec_rounds"] for m in vc["meta"]) > 0


def test_engine_at_tp2_serves_the_tp1_tokens_and_a_killed_rank_ends_it_clearly(checkpoints):
    path = checkpoints["llama"]
    ps = prompts([7, 12], seed=5)
    tp1 = run_job(Job(args(path), ps, 8, return_logprob=False))["output_ids"]
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with sglang_vericache.Engine(model_path=path, tp_size=2, max_total_tokens=1024, page_size=8,
                                 num_threads=1, log_level="warning") as eng:
        assert [eng.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in ps] == tp1
        procs = eng.tokenizer_manager.scheduler_proc.procs
        stream = eng.generate(input_ids=ps[0], stream=True,
                              sampling_params={**greedy, "max_new_tokens": 200})
        next(stream)  # running on both ranks
        os.kill(procs[1].pid, signal.SIGKILL)
        procs[0].join(30)
        assert procs[0].exitcode == TP_EXIT_CODE  # rank 0's next collective failed: it exits, no hang
        with pytest.raises(Exception, match=r"tensor-parallel rank 1 exited with code -9 \(killed by signal 9\)"):
            for _ in stream:
                pass
        with pytest.raises(Exception, match="the scheduler is not running: the scheduler process of "
                                            "tensor-parallel rank 1"):
            eng.generate(input_ids=ps[0], sampling_params=greedy)


def test_rank_zero_broadcasts_typed_scheduler_messages_not_pickle():
    req = make_request("r1", [5, 6, 7], seed=3, return_logprob=True, max_new_tokens=4, temperature=0.5, stop=["x"])
    data = request_broadcast.encode([req, AbortReq("r0"), FlushCacheReq()])
    assert b"\x80\x04" not in data[:2]  # msgpack, not a pickle stream
    assert request_broadcast.decode(data) == [req, AbortReq("r0"), FlushCacheReq()]
    with pytest.raises(ValueError, match="rank 0 broadcast an unknown message type 'GetStatsReq'"):
        request_broadcast.decode(msgspec.msgpack.encode([["GetStatsReq", {}]]))
    assert "GetStatsReq" not in request_broadcast.BROADCAST_TYPES and GetStatsReq  # stats stay on rank 0


def test_vocabulary_ranges_cover_the_vocabulary_once():
    assert [vocab_range(515, r, 2) for r in range(2)] == [(0, 258, 258), (258, 515, 258)]
    assert [vocab_range(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]


def test_a_tp_size_that_does_not_divide_the_heads_is_refused(checkpoints):
    mc = ModelConfig.from_path(checkpoints["llama"])  # 4 heads, 2 KV heads
    assert (mc.tp_shard(2).num_attention_heads, mc.tp_shard(2).num_key_value_heads) == (2, 1)
    with pytest.raises(ValueError, match=r"--tp-size 4 must divide the model's num_key_value_heads \(2\)"):
        mc.tp_shard(4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs two GPUs")
def test_engine_at_tp2_on_two_gpus_over_nccl_emits_the_tp1_tokens(checkpoints):
    path = checkpoints["qwen3"]
    ps = prompts([7, 12], seed=5)
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for tp in (1, 2):
        with sglang_vericache.Engine(model_path=path, device="cuda", tp_size=tp, max_total_tokens=1024,
                                     page_size=8, log_level="warning") as eng:
            outs[tp] = [eng.generate(input_ids=p, sampling_params=greedy)["output_ids"] for p in ps]
    assert outs[2] == outs[1]
