"""The two-tier KV cache inside the scheduler: per-tier budgets, shared prefixes compressed once,
rebuilding a missing compressed copy, lossy mode, and no leaks in either tier."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.mem_cache.two_tier import TwoTierKV
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion
from sglang_vericache.testing.tree_invariants import check_invariants

PS = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


def sched(path, **kw) -> Scheduler:
    kw.setdefault("page_size", PS)
    kw.setdefault("vericache_schedule", "lockstep")  # the compressed tier under test (adaptive may decode instead)
    return Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, **kw))


def ids(n, seed):
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_device_budget_sizes_the_compressed_tier_and_host_budget_the_exact(llama):
    s = sched(llama, kv_compressor="kivi2", speculative_algorithm="VERICACHE",
              device_kv_budget="2MB", host_kv_budget="1MB")
    per_chunk = s.two_tier.pool.bytes_per_chunk()
    # The device budget also holds the drafts' scratch KV (one row of X+1 slots per request row).
    draft_scratch = (1 + s.req_to_token_pool.size * 17) * s.model_runner.token_to_kv_pool.bytes_per_token()
    assert TwoTierKV.device_overhead_bytes(s.server_args, s.model_runner) == draft_scratch
    assert s.two_tier.pool.num_chunks == (2_000_000 - draft_scratch) // per_chunk
    exact_per_token = s.model_runner.token_to_kv_pool.bytes_per_token()
    assert s.max_total_num_tokens == 1_000_000 // exact_per_token // PS * PS
    info = s.ready_message().server_info
    assert info["kv_mode"] == "vericache"
    assert info["exact_tier"] == {"where": "host", "tokens": s.max_total_num_tokens,
                                  "bytes": s.max_total_num_tokens * exact_per_token, "memory": "cpu"}
    assert info["compressed_tier"]["chunks"] == s.two_tier.pool.num_chunks
    assert info["compressed_tier"]["bytes"] == s.two_tier.pool.num_chunks * per_chunk


def test_full_mode_device_budget_sizes_the_exact_pool(llama):
    s = sched(llama, device_kv_budget="300KB")
    per_token = s.model_runner.token_to_kv_pool.bytes_per_token()
    assert s.max_total_num_tokens == 300_000 // per_token // PS * PS
    assert s.ready_message().server_info["exact_tier"]["where"] == "device"


@pytest.mark.parametrize("mode", ["lossy", "vericache"])
def test_shared_prefix_is_compressed_once(llama, mode):
    extra = {"speculative_algorithm": "VERICACHE"} if mode == "vericache" else {}
    # Page scope: both tiers are shared page by page (segment scope: test_segment_compression.py).
    s = sched(llama, kv_compressor="streamingllm", kv_compress_scope="page", **extra)
    prefix = ids(64, 1)
    first = run_to_completion(s, [make_request("a", prefix + ids(5, 2), max_new_tokens=4, temperature=0.0)])
    chunks_after_first = s.tree_cache.comp_total_chunks()
    free_after_first = s.two_tier.pool.available_chunks()
    second = run_to_completion(s, [make_request("b", prefix + ids(7, 3), max_new_tokens=4, temperature=0.0)])
    assert first["a"].cached_tokens == 0
    assert second["b"].cached_tokens == 64  # both tiers hit for the 8 whole pages of the prefix
    assert s.tree_cache.num_comp_matched_tokens == 64
    # The second request compressed only its own new page(s): 69+4 vs 71+4 tokens, 9 whole pages each,
    # of which 8 are shared, so the tree gains exactly one chunk.
    assert s.tree_cache.comp_total_chunks() == chunks_after_first + 1
    assert s.two_tier.pool.available_chunks() == free_after_first - 1


def test_missing_compressed_copy_is_rebuilt_from_exact_kv(llama):
    s = sched(llama, kv_compressor="int8", speculative_algorithm="VERICACHE")
    prefix = ids(48, 4)
    run_to_completion(s, [make_request("a", prefix + [5], max_new_tokens=3, temperature=0.0)])
    evicted = s.tree_cache.evict_compressed(10**6)  # drop the compressed tier, keep the exact one
    assert evicted > 0 and s.tree_cache.comp_total_chunks() == 0
    full = sched(llama)
    want = run_to_completion(full, [make_request("b", prefix + [9], max_new_tokens=12, temperature=0.0)])
    got = run_to_completion(s, [make_request("b", prefix + [9], max_new_tokens=12, temperature=0.0)])
    assert got["b"].cached_tokens == 48  # the exact hit was used, its compressed copy rebuilt
    assert got["b"].output_ids == want["b"].output_ids
    assert s.tree_cache.comp_total_chunks() >= 6


def test_snapkv_hit_without_compressed_copy_recomputes_the_prefix(llama):
    # SnapKV scores need the chunk's queries, which only a forward pass has: no rebuild from KV.
    s = sched(llama, kv_compressor="snapkv", speculative_algorithm="VERICACHE", kv_compress_scope="page")
    prefix = ids(48, 5)
    run_to_completion(s, [make_request("a", prefix + [5], max_new_tokens=3, temperature=0.0)])
    s.tree_cache.evict_compressed(10**6)
    got = run_to_completion(s, [make_request("b", prefix + [9], max_new_tokens=12, temperature=0.0)])
    want = run_to_completion(sched(llama), [make_request("b", prefix + [9], max_new_tokens=12, temperature=0.0)])
    assert got["b"].cached_tokens == 0
    assert got["b"].output_ids == want["b"].output_ids


@pytest.mark.parametrize("compressor", ["snapkv", "kivi2"])
def test_no_leak_in_either_tier(llama, compressor):
    s = sched(llama, kv_compressor=compressor, speculative_algorithm="VERICACHE", chunked_prefill_size=16,
              max_total_tokens=256)
    free_exact, free_comp = s.allocator.available_size(), s.two_tier.pool.available_chunks()
    reqs = [make_request(f"r{i}", ids(20 + 13 * i, i), max_new_tokens=20, temperature=0.0, ignore_eos=True)
            for i in range(6)]
    res = run_to_completion(s, reqs)
    assert all(r.finished_reason["type"] == "length" for r in res.values())
    s.tree_cache.evict(10**9)
    assert s.allocator.available_size() == free_exact
    assert s.two_tier.pool.available_chunks() == free_comp
    check_invariants(s.tree_cache)


def test_lossy_mode_decodes_from_the_compressed_tier_alone(llama):
    prompt = ids(96, 6)
    full = run_to_completion(sched(llama), [make_request("r", prompt, max_new_tokens=24, temperature=0.0)])
    lossy_r1 = run_to_completion(sched(llama, kv_compressor="snapkv", kv_compression_ratio=1.0),
                                 [make_request("r", prompt, max_new_tokens=24, temperature=0.0)])
    lossy_r8 = run_to_completion(sched(llama, kv_compressor="snapkv", kv_compression_ratio=8.0),
                                 [make_request("r", prompt, max_new_tokens=24, temperature=0.0)])
    # Ratio 1 keeps every token, so the compressed tier is exact; at 8x the output changes.
    assert lossy_r1["r"].output_ids == full["r"].output_ids
    assert lossy_r8["r"].output_ids != full["r"].output_ids


@pytest.mark.parametrize("mode", ["lossy", "vericache"])
def test_compressed_tier_smaller_than_the_workload_queues_instead_of_thrashing(llama, mode):
    # The compressed pool holds about two of these requests at once: the rest must wait their turn,
    # and every request must finish in a bounded number of steps (no admit/requeue livelock).
    extra = {"speculative_algorithm": "VERICACHE"} if mode == "vericache" else {}
    probe = roomy = sched(llama, kv_compressor="int8", max_running_requests=8, **extra)
    chunks = 2 * ((100 + 30) // PS + 1) + 4
    overhead = TwoTierKV.device_overhead_bytes(probe.server_args, probe.model_runner)
    budget = overhead + chunks * probe.two_tier.pool.bytes_per_chunk()
    s = sched(llama, kv_compressor="int8", max_running_requests=8, device_kv_budget=str(budget), **extra)
    assert s.two_tier.pool.num_chunks == chunks
    reqs = lambda: [make_request(f"r{i}", ids(100, 20 + i), max_new_tokens=30, temperature=0.0, ignore_eos=True)
                    for i in range(6)]
    want = run_to_completion(roomy, reqs())
    got = run_to_completion(s, reqs(), max_steps=3000)
    assert {k: v.output_ids for k, v in got.items()} == {k: v.output_ids for k, v in want.items()}


def test_a_request_longer_than_the_compressed_tier_is_refused_not_left_waiting(llama):
    # A fixed schedule folds every whole page of a request into the compressed tier; one that could
    # never fit it alone used to wait in the queue forever (nothing running, nothing admissible).
    s = sched(llama, kv_compressor="snapkv", speculative_algorithm="VERICACHE", device_kv_budget="470KB",
              host_kv_budget="4MB", vericache_schedule="staggered", link_bandwidth="1GB", verify_staging_tokens=512,
              speculative_num_draft_tokens="4")
    chunks = s.two_tier.pool.num_chunks
    assert 8 <= chunks < s.context_len // PS - 2  # the tier, not the context, limits a request here
    longest = (chunks + 1) * PS - 1
    assert s.max_req_len == longest < s.max_total_num_tokens - PS
    err = s.handle_message(make_request("long", ids(longest - 3, 1), max_new_tokens=4))
    assert err is not None and err.status_code == 400 and f"more than the {longest} tokens" in err.message
    res = run_to_completion(s, [make_request("fits", ids(longest - 4, 2), max_new_tokens=4, ignore_eos=True)])
    assert len(res["fits"].output_ids) == 4


def test_kvzip_names_its_reconstruction_scratch_when_the_pool_limits_a_request(llama):
    # kvzip's reconstruction pass keeps KV slots of its own: with a small --max-total-tokens they are
    # what leaves a request short, and the refusal says so.
    s = sched(llama, kv_compressor="kvzip", max_total_tokens=2250)
    scratch = len(s.two_tier.reconstruction.scratch)
    longest = s.max_total_num_tokens - PS
    assert s.max_req_len == longest < s.context_len and s.max_total_num_tokens <= 2250 - scratch
    err = s.handle_message(make_request("long", ids(longest - 3, 1), max_new_tokens=4))
    assert err is not None and err.status_code == 400
    assert err.message.endswith(f"more than the {longest} tokens a request may have (kvzip's reconstruction pass "
                                f"holds {scratch} of the KV pool's slots; raise --max-total-tokens)")
