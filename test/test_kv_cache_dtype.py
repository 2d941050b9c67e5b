"""--kv-cache-dtype: float32 compute over bfloat16 exact KV.

Every mode stores and reads the same rounded KV (a verify pass sees its new tokens' K/V as stored,
as a decode step does), so VeriCache output equals full-mode output under the same KV dtype, for
query-free and query-scored compressors, greedy and seeded, with and without a streamed link; the
exact pools take half the bytes per token.
"""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

P = 8
NEW = 24
LENS = [40, 71, 9, 23]
SAMPLING = {"temperature": 0.8, "top_p": 0.9, "top_k": 50}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in LENS]


def run(path, batch, sampling=None, **server):
    sched = Scheduler(ServerArgs(model_path=path, dtype="float32", kv_cache_dtype="bfloat16",
                                 skip_tokenizer_init=True, page_size=P, **server))
    sampling = sampling or {"temperature": 0.0}
    reqs = [make_request(f"r{i}", ids, seed=7 + i, max_new_tokens=NEW, ignore_eos=True, **sampling)
            for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return sched, [res[f"r{i}"].output_ids for i in range(len(batch))]


@pytest.fixture(scope="module")
def full(llama, batch):
    return {"greedy": run(llama, batch)[1], "seeded": run(llama, batch, SAMPLING)[1]}


def test_exact_pool_is_bfloat16_at_half_the_bytes(llama, batch):
    sched, _ = run(llama, batch[:1])
    pool = sched.model_runner.token_to_kv_pool
    assert pool.dtype == torch.bfloat16
    assert sched.model_runner.model.lm_head.weight.dtype == torch.float32
    f32 = Scheduler(ServerArgs(model_path=llama, dtype="float32", skip_tokenizer_init=True, page_size=P))
    assert 2 * pool.bytes_per_token() == f32.model_runner.token_to_kv_pool.bytes_per_token()


@pytest.mark.parametrize("compressor", ["streamingllm", "snapkv", "int8", "kivi4"])
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_vericache_equals_full_over_bfloat16_kv(compressor, sampling, llama, batch, full):
    _, out = run(llama, batch, SAMPLING if sampling == "seeded" else None, kv_compressor=compressor,
                 speculative_algorithm="VERICACHE", speculative_num_draft_tokens="6", vericache_schedule="lockstep")
    assert out == full[sampling]


def test_staggered_streamed_verification_and_offload_equal_full(llama, batch, full):
    link = dict(link_bandwidth="2GB", host_kv_budget="64MB")
    _, staggered = run(llama, batch, kv_compressor="snapkv", speculative_algorithm="VERICACHE",
                       speculative_num_draft_tokens="6", vericache_schedule="staggered", **link)
    assert staggered == full["greedy"]
    _, offload = run(llama, batch, kv_offload=True, **link)
    assert offload == full["greedy"]


def test_other_attention_backends_refuse_a_separate_kv_dtype():
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 needs --attention-backend torch"):
        ServerArgs(model_path="x", kv_cache_dtype="bfloat16", attention_backend="triton")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of"):
        ServerArgs(model_path="x", kv_cache_dtype="fp4")


def test_streamed_verify_sees_its_new_kv_rounded_like_a_pool_verify(tmp_path):
    """Logits of a streamed (staged) verify equal those of a verify over the pool: both attend to
    the new tokens' K/V rounded to bfloat16 (unrounded, logits differ by up to ~0.2 here)."""
    from test_staged_attention import PROMPTS, VERIFY, prefill, verify_all_rows

    from sglang_vericache.model_executor.model_runner import ModelRunner

    path = make_random_checkpoint("llama", str(tmp_path / "llama"))
    runner = ModelRunner(ServerArgs(model_path=path, dtype="float32", kv_cache_dtype="bfloat16", page_size=4,
                                    max_total_tokens=2048, max_running_requests=40, link_bandwidth="1GB"))
    runner.init_kv_stager(max_tokens=128)
    try:
        assert runner.token_to_kv_pool.dtype == torch.bfloat16
        ref = verify_all_rows(runner, prefill(runner, PROMPTS), VERIFY, staged=False)
        got = verify_all_rows(runner, prefill(runner, PROMPTS), VERIFY, staged=True)
        torch.testing.assert_close(got, ref, atol=5e-5, rtol=0)
    finally:
        runner.transfer_engine.shutdown()
