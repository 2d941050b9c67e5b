"""--exact-kv-pool host (mem_cache/device_page_cache.py): the exact pool in host memory, forwards reading
and writing exact KV through an accelerator page cache smaller than the pool. On a CPU both are host
memory, but separate tensors: a forward reads only what the cache was given, so a missing page, a wrong
translation or a row not written back changes the output. VeriCache and lossy output stay deterministic
full mode's, tokens and logprobs, bitwise, in bfloat16 and float32."""

from __future__ import annotations

import pytest
import torch

from test_vericache_adaptive import NEW, PAGE, PROMPT_LENS, ROUNDS_WIN, llama, prompts, scheduler  # noqa: F401

from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion

VC = dict(kv_compressor="snapkv", kv_compression_ratio=4, speculative_algorithm="VERICACHE")


def run(sched, batch):
    reqs = [make_request(f"r{i}", ids, seed=100 + i, max_new_tokens=NEW, ignore_eos=True, return_logprob=True,
                         temperature=0.0) for i, ids in enumerate(batch)]
    res = run_to_completion(sched, reqs)
    return [(res[f"r{i}"].output_ids, res[f"r{i}"].output_token_logprobs) for i in range(len(batch))]


@pytest.fixture(scope="module")
def reference(llama):
    batch = prompts()
    return batch, run(scheduler(llama), batch)


def cache_of(sched):
    return sched.model_runner.exact_cache


def test_host_tier_and_resident_requests_through_a_small_cache(llama, reference):
    """Adaptive VeriCache with a device budget holding about the shortest request's exact KV: the others
    run from the host tier (their verifications streamed from the host pool), and the cache (51 pages of
    the run's ~57) drops pages as the batch grows."""
    batch, full = reference
    link = dict(link_bandwidth="1GB", verify_staging_tokens=128)
    probe = scheduler(llama, **VC, vericache_schedule="adaptive", **link)
    pl = probe.spec_worker.placement
    comp = sum((n + NEW) // PAGE for n in PROMPT_LENS) * probe.two_tier.pool.bytes_per_chunk()
    budget = comp + pl.staging + len(batch) * pl.scratch + pl.exact_bytes(9 + NEW)
    sched = scheduler(llama, ROUNDS_WIN, **VC, vericache_schedule="adaptive", device_kv_budget=str(budget),
                      exact_kv_pool="host", exact_kv_cache_tokens=51 * PAGE, chunked_prefill_size=64, **link)
    cache = cache_of(sched)
    assert cache.num_pages == 51 and cache.pool.k_buffer[0].data_ptr() != sched.model_runner.token_to_kv_pool.k_buffer[0].data_ptr()
    assert run(sched, batch) == full
    assert sched.metrics.spec_rounds_total > 0 and sched.link.engine.bytes_total > 0
    assert sched.spec_worker.max_resident < len(batch)
    assert cache.stats["pages_dropped"] > 0 and cache.stats["rows_written_back"] > 0


def test_a_prefix_hit_on_pages_the_cache_dropped(llama, reference):
    """Staggered int8 (a query-free compressor: a cached prefix stays usable whatever happened to its
    compressed chunks) through a 30-page cache: a prompt again whose cached pages the cache dropped reads
    them copied back in from the host pool (the cache's free pages poisoned with NaN first)."""
    batch, full = reference
    sched = scheduler(llama, kv_compressor="int8", speculative_algorithm="VERICACHE", vericache_schedule="staggered",
                      speculative_num_draft_tokens="6", exact_kv_pool="host", exact_kv_cache_tokens=30 * PAGE,
                      chunked_prefill_size=64, link_bandwidth="1GB")
    cache = cache_of(sched)
    assert run(sched, batch) == full
    for i, ids in enumerate(batch):  # the hit is the cached pages before the prompt's last token
        slots = sched.tree_cache.match_prefix(ids[:-1], record_stats=False).device_indices.tolist()[::PAGE]
        dropped = [s for s in slots if not cache.map[s // PAGE]]
        if len(dropped) > 1:
            break
    assert len(dropped) > 1
    free = torch.tensor(cache.free)
    for buf in cache.pool.k_buffer + cache.pool.v_buffer:
        buf[(free[:, None] * PAGE + torch.arange(PAGE)).flatten()] = float("nan")
    pages_in, hits = cache.stats["pages_in"], sched.tree_cache.num_matched_tokens
    assert run(sched, [batch[i]]) == [full[i]]
    assert sched.tree_cache.num_matched_tokens - hits >= len(slots) * PAGE  # the prefix was a hit
    assert cache.stats["pages_in"] - pages_in >= len(dropped)


@pytest.mark.parametrize("schedule", ["lockstep", "staggered"])
def test_fixed_schedules_and_a_prefix_hit(llama, reference, schedule):
    """Every request streamed (staggered) or verified over the cache (lock-step); the last request repeats
    the first prompt after it finished, so its prefix comes from the radix cache's host pages."""
    batch, full = reference
    sched = scheduler(llama, **VC, vericache_schedule=schedule, speculative_num_draft_tokens="6",
                      exact_kv_pool="host", exact_kv_cache_tokens=88 * PAGE, link_bandwidth="1GB")
    assert run(sched, batch) == full
    again = run(sched, [batch[0]])
    assert again == [full[0]] and sched.metrics.spec_rounds_total > 0
    assert sched.tree_cache.total_size() > 0


def test_float32_streamed_rounds_through_a_small_cache(llama):
    """float32 (the other tests: bfloat16): staggered rounds whose verifications stream from the host pool,
    and the cache (40 pages of the run's ~57) dropping pages and writing rows back."""
    batch = prompts(seed=2)
    full = run(scheduler(llama, dtype="float32"), batch)
    sched = scheduler(llama, dtype="float32", **VC, vericache_schedule="staggered", speculative_num_draft_tokens="6",
                      exact_kv_pool="host", exact_kv_cache_tokens=40 * PAGE, chunked_prefill_size=64,
                      link_bandwidth="1GB")
    assert sched.model_runner.dtype == torch.float32
    assert run(sched, batch) == full
    assert sched.metrics.spec_rounds_total > 0 and sched.link.engine.bytes_total > 0
    assert cache_of(sched).stats["pages_dropped"] > 0 and cache_of(sched).stats["rows_written_back"] > 0


def test_lossy_mode_reads_its_tail_through_the_cache(llama):
    batch = prompts(seed=1)
    lossy = dict(kv_compressor="int8")
    sched = scheduler(llama, **lossy, exact_kv_pool="host", exact_kv_cache_tokens=40 * PAGE, chunked_prefill_size=64)
    assert run(sched, batch) == run(scheduler(llama, **lossy), batch)
    assert cache_of(sched).stats["rows_written_back"] > 0
    tier = sched.tier_info()["exact_tier"]
    assert tier["memory"] == "cpu" and tier["device_cache"]["tokens"] == 40 * PAGE


def test_a_cache_smaller_than_one_forward_is_refused_at_start(llama):
    # a prefill chunk of 64 tokens (8 pages) and 8 running requests' tail and new pages (2 each), + 1
    with pytest.raises(ValueError, match="--exact-kv-cache-tokens 16 is too small: a forward may touch 200 tokens"):
        scheduler(llama, **VC, vericache_schedule="staggered", exact_kv_pool="host", exact_kv_cache_tokens=2 * PAGE,
                  chunked_prefill_size=64)
    with pytest.raises(ValueError, match="without a link every request verifies over the cache"):
        scheduler(llama, **VC, vericache_schedule="lockstep", exact_kv_pool="host", exact_kv_cache_tokens=64 * PAGE)


def test_pages_the_allocator_frees_leave_the_cache(llama):
    sched = scheduler(llama, **VC, vericache_schedule="lockstep", exact_kv_pool="host")
    run(sched, [prompts()[0]])
    cache, alloc = cache_of(sched), sched.model_runner.token_to_kv_pool_allocator
    cached = list(cache.lru)
    assert cached and all(cache.map[p] for p in cached)
    alloc.free_page_ids(cached[:1])
    assert not cache.map[cached[0]] and cached[0] not in cache.lru
    alloc.clear()
    assert not cache.lru and int(cache.map.sum()) == 0 and len(cache.free) == cache.num_pages


def test_full_mode_has_no_host_pool(llama):
    with pytest.raises(ValueError, match="--exact-kv-pool host is for the two-tier modes"):
        ServerArgs(model_path=llama, exact_kv_pool="host")
