"""Specification of mem_cache/two_tier_radix_cache.py: exact slots and compressed chunk ids per node,
each tier with its own locks and LRU eviction, and the request hooks for both tiers."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from sglang_vericache.compress import CompressorConfig, get_compressor
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool
from sglang_vericache.mem_cache.memory_pool import PagedTokenAllocator, ReqToTokenPool
from sglang_vericache.mem_cache.two_tier_radix_cache import TwoTierRadixCache
from sglang_vericache.testing.tree_invariants import check_invariants

P = 2  # page size = compression chunk size
NUM_PAGES, NUM_CHUNKS = 8, 8


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_cache(disable: bool = False):
    cfg = CompressorConfig("streamingllm", ratio=2, chunk_size=P, num_layers=1, num_kv_heads=1,
                           num_q_heads=1, head_dim=2, dtype=torch.float32)
    pool = CompressedKVPool(get_compressor("streamingllm", cfg), num_layers=1, num_chunks=NUM_CHUNKS)
    allocator = PagedTokenAllocator(num_pages=NUM_PAGES, page_size=P)
    req_pool = ReqToTokenPool(size=4, max_context_len=32)
    cache = TwoTierRadixCache(req_pool, allocator, pool, page_size=P, disable=disable)
    return cache, allocator, pool, req_pool


def take(allocator: PagedTokenAllocator, n: int) -> torch.Tensor:
    return allocator.alloc_extend(last_slot=0, cur_len=0, num_new=n)


def sizes(cache: TwoTierRadixCache) -> tuple[int, int, int, int]:
    """(exact evictable, exact protected, comp evictable, comp protected)"""
    return (cache.evictable_size(), cache.protected_size(),
            cache.comp_evictable_chunks(), cache.comp_protected_chunks())


def handles(cache: TwoTierRadixCache, key: list[int]) -> tuple[list[int], list[int], int]:
    m = cache.match_prefix(key, record_stats=False)
    return m.device_indices.tolist(), m.comp_indices.tolist(), m.comp_len


# ----------------------------------------------------------------- match / insert


def test_match_on_empty_tree_has_no_handles():
    cache, _, _, _ = make_cache()
    m = cache.match_prefix([1, 2, 3, 4])
    assert (m.device_indices.tolist(), m.comp_indices.tolist(), m.comp_len) == ([], [], 0)
    assert m.comp_indices.dtype == torch.int64
    assert m.last_node is cache.root_node


def test_insert_with_comp_then_match_returns_both_handles():
    cache, _, _, _ = make_cache()
    res = cache.insert([1, 2, 3, 4, 5, 6], t([2, 3, 4, 5, 6, 7]), t([5, 6, 7]))
    assert (res.prefix_len, res.dup_comp.tolist()) == (0, [])
    assert handles(cache, [1, 2, 3, 4, 5, 6, 7]) == ([2, 3, 4, 5, 6, 7], [5, 6, 7], 6)
    assert sizes(cache) == (6, 0, 3, 0)


def test_partial_match_splits_comp_together_with_value():
    cache, _, _, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], t(list(range(2, 10))), t([1, 2, 3, 4]))
    m = cache.match_prefix([1, 2, 3, 4, 9, 9])
    assert (m.device_indices.tolist(), m.comp_indices.tolist(), m.comp_len) == ([2, 3, 4, 5], [1, 2], 4)
    upper = m.last_node
    (lower,) = upper.children.values()
    assert (upper.key, upper.value.tolist(), upper.comp.tolist()) == ([1, 2, 3, 4], [2, 3, 4, 5], [1, 2])
    assert (lower.key, lower.value.tolist(), lower.comp.tolist()) == ([5, 6, 7, 8], [6, 7, 8, 9], [3, 4])
    assert handles(cache, [1, 2, 3, 4, 5, 6, 7, 8]) == (list(range(2, 10)), [1, 2, 3, 4], 8)
    assert sizes(cache) == (8, 0, 4, 0)


def test_comp_shorter_than_key_covers_a_prefix_and_splits_where_it_ends():
    cache, _, _, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], t([2, 3, 4, 5, 6, 7]), t([7]))
    (upper,) = cache.root_node.children.values()
    (lower,) = upper.children.values()
    assert (upper.key, upper.comp.tolist(), lower.key, lower.comp) == ([1, 2], [7], [3, 4, 5, 6], None)
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [7], 2)


def test_node_without_comp_adopts_the_callers_comp():
    cache, _, _, _ = make_cache()
    assert cache.insert([1, 2, 3, 4], t([2, 3, 4, 5])).prefix_len == 0
    assert handles(cache, [1, 2, 3, 4]) == ([2, 3, 4, 5], [], 0)
    res = cache.insert([1, 2, 3, 4], t([8, 9, 10, 11]), t([3, 4]))
    assert (res.prefix_len, res.dup_comp.tolist()) == (4, [])  # exact duplicates: the caller's to free
    assert handles(cache, [1, 2, 3, 4]) == ([2, 3, 4, 5], [3, 4], 4)


def test_shared_prefix_is_compressed_once_and_the_second_callers_chunks_are_duplicates():
    cache, _, _, _ = make_cache()
    cache.insert([1, 2, 3, 4], t([2, 3, 4, 5]), t([1, 2]))
    res = cache.insert([1, 2, 3, 4, 5, 6], t([8, 9, 10, 11, 12, 13]), t([3, 4, 5]))
    assert (res.prefix_len, res.dup_comp.tolist()) == (4, [3, 4])
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 12, 13], [1, 2, 5], 6)
    assert sizes(cache) == (6, 0, 3, 0)


def test_ids_the_tree_already_holds_at_those_pages_are_neither_adopted_nor_duplicates():
    cache, _, _, _ = make_cache()
    cache.insert([1, 2, 3, 4], t([2, 3, 4, 5]), t([1, 2]))
    res = cache.insert([1, 2, 3, 4, 5, 6], t([2, 3, 4, 5, 6, 7]), t([1, 2, 3]))  # its matched prefix
    assert (res.prefix_len, res.dup_comp.tolist()) == (4, [])
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [1, 2, 3], 6)


def test_set_comp_attaches_rebuilt_chunks_to_an_exact_only_prefix():
    cache, _, _, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], t([2, 3, 4, 5, 6, 7]))
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    assert cache.set_comp(node, t([4, 5])).tolist() == []  # first two pages; splits at page 2
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [4, 5], 4)
    assert node.key == [5, 6] and node.comp is None  # the caller's node is still the deepest
    assert cache.set_comp(node, t([4, 5, 6])).tolist() == []  # the tree's own ids, then one new
    assert cache.set_comp(node, t([7, 8, 9])).tolist() == [7, 8, 9]  # all present: duplicates
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [4, 5, 6], 6)
    assert sizes(cache) == (6, 0, 3, 0)


def test_comp_hit_rate_counts_compressed_tokens_over_queried():
    cache, _, _, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], t([2, 3, 4, 5, 6, 7]), t([1]))
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # 6 exact, 2 compressed of 8
    assert (cache.num_matched_tokens, cache.num_comp_matched_tokens, cache.num_queried_tokens) == (6, 2, 8)
    assert (cache.hit_rate(), cache.comp_hit_rate()) == (6 / 8, 2 / 8)


# ----------------------------------------------------------------- locks


def test_comp_lock_protects_comp_and_the_exact_kv_under_it():
    cache, allocator, pool, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], take(allocator, 6), pool.alloc(3))
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    assert cache.inc_comp_lock_ref(node) == -3
    assert sizes(cache) == (0, 6, 0, 3)
    assert cache.evict_compressed(10) == 0
    assert cache.evict(10) == 0
    assert cache.dec_comp_lock_ref(node) == 3
    assert sizes(cache) == (6, 0, 3, 0)


def test_exact_lock_protects_exact_but_comp_can_still_go():
    cache, allocator, pool, _ = make_cache()
    cache.insert([1, 2, 3, 4, 5, 6], take(allocator, 6), pool.alloc(3))
    node = cache.match_prefix([1, 2, 3, 4, 5, 6]).last_node
    assert cache.inc_lock_ref(node) == -6
    assert sizes(cache) == (0, 6, 3, 0)
    assert cache.evict(10) == 0
    assert cache.evict_compressed(10) == 3
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [], 0)
    assert pool.available_chunks() == NUM_CHUNKS
    assert cache.dec_lock_ref(node) == 6
    assert sizes(cache) == (6, 0, 0, 0)


def test_second_lock_in_either_tier_changes_no_size():
    cache, allocator, pool, _ = make_cache()
    cache.insert([1, 2], take(allocator, 2), pool.alloc(1))
    node = cache.match_prefix([1, 2]).last_node
    assert (cache.inc_lock_ref(node), cache.inc_comp_lock_ref(node)) == (-2, -1)
    assert (cache.inc_comp_lock_ref(node), cache.inc_lock_ref(node)) == (0, 0)
    assert (node.lock_ref, node.comp_lock_ref) == (2, 2)
    assert (cache.dec_lock_ref(node), cache.dec_lock_ref(node)) == (0, 0)  # still comp-locked
    assert sizes(cache) == (0, 2, 0, 1)
    assert (cache.dec_comp_lock_ref(node), cache.dec_comp_lock_ref(node)) == (0, 1)
    assert sizes(cache) == (2, 0, 1, 0)


def test_comp_lock_on_a_node_without_comp_protects_comp_attached_later():
    cache, allocator, pool, _ = make_cache()
    cache.insert([1, 2, 3, 4], take(allocator, 4))
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    assert cache.inc_comp_lock_ref(node) == 0
    assert sizes(cache) == (0, 4, 0, 0)
    cache.set_comp(node, pool.alloc(2))
    assert sizes(cache) == (0, 4, 0, 2)
    assert cache.evict_compressed(10) == 0
    cache.dec_comp_lock_ref(node)
    assert sizes(cache) == (4, 0, 2, 0)


def test_split_of_a_locked_node_keeps_both_counts_on_both_halves():
    cache, allocator, pool, _ = make_cache()
    cache.insert([1, 2, 3, 4], take(allocator, 4), pool.alloc(2))
    node = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(node)
    cache.inc_comp_lock_ref(node)
    upper = cache.match_prefix([1, 2, 9, 9]).last_node
    assert (upper.lock_ref, upper.comp_lock_ref, node.lock_ref, node.comp_lock_ref) == (1, 1, 1, 1)
    assert sizes(cache) == (0, 4, 0, 2)
    cache.dec_lock_ref(node)
    cache.dec_comp_lock_ref(node)
    assert sizes(cache) == (4, 0, 2, 0)


# ----------------------------------------------------------------- eviction


def two_branches(cache, allocator, pool):
    """[1,2,3,4] -> {[5,6], [7,8]}, all with comp; [7,8] used last. Returns the chunk ids."""
    a = pool.alloc(3)  # 1, 2, 3
    cache.insert([1, 2, 3, 4, 5, 6], take(allocator, 6), a)
    b = pool.alloc(1)  # 4
    slots = torch.cat([cache.match_prefix([1, 2, 3, 4]).device_indices, take(allocator, 2)])
    assert cache.insert([1, 2, 3, 4, 7, 8], slots, torch.cat([a[:2], b])).dup_comp.tolist() == []
    cache.match_prefix([1, 2, 3, 4, 7, 8])
    return a.tolist() + b.tolist()


def test_evict_compressed_leaves_exact_kv_and_later_matches_report_less_comp():
    cache, allocator, pool, _ = make_cache()
    assert two_branches(cache, allocator, pool) == [1, 2, 3, 4]
    free_slots = allocator.available_size()
    assert cache.evict_compressed(1) == 1  # [5, 6]: the least recently used comp leaf
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [1, 2], 4)  # the rebuild case
    assert handles(cache, [1, 2, 3, 4, 7, 8]) == ([2, 3, 4, 5, 8, 9], [1, 2, 4], 6)
    assert pool.free_ids.tolist()[-1] == 3
    assert cache.evict_compressed(1) == 1  # [7, 8]
    assert cache.evict_compressed(1) == 2  # then [1, 2, 3, 4] whole
    assert handles(cache, [1, 2, 3, 4, 7, 8]) == ([2, 3, 4, 5, 8, 9], [], 0)
    assert (allocator.available_size(), pool.available_chunks()) == (free_slots, NUM_CHUNKS)
    assert cache.total_size() == 8
    assert sizes(cache) == (8, 0, 0, 0)


def test_evict_compressed_drops_deepest_comp_first_so_comp_stays_a_prefix():
    cache, allocator, pool, _ = make_cache()
    ids = pool.alloc(2)
    cache.insert([1, 2], take(allocator, 2), ids[:1])  # older node, lower id
    cache.insert([1, 2, 3, 4], torch.cat([t([2, 3]), take(allocator, 2)]), ids)  # same access time now
    assert cache.evict_compressed(1) == 1
    assert handles(cache, [1, 2, 3, 4]) == ([2, 3, 4, 5], [1], 2)


def test_single_evict_compressed_call_reaches_parents_through_the_heap():
    cache, allocator, pool, _ = make_cache()
    two_branches(cache, allocator, pool)
    assert cache.evict_compressed(3) == 4  # both leaves (1 + 1), then their parent (2)
    assert pool.available_chunks() == NUM_CHUNKS


def test_exact_eviction_takes_the_comp_along():
    cache, allocator, pool, _ = make_cache()
    two_branches(cache, allocator, pool)
    assert cache.evict(2) == 2  # [5, 6] with its chunk 3
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5], [1, 2], 4)
    assert pool.available_chunks() == NUM_CHUNKS - 3
    assert cache.evict(100) == 6
    assert (allocator.available_size(), pool.available_chunks()) == (NUM_PAGES * P, NUM_CHUNKS)
    assert sizes(cache) == (0, 0, 0, 0)
    assert cache.total_size() == 0


# ----------------------------------------------------------------- request hooks


@dataclass
class FakeReq:
    req_pool_idx: int | None
    fill_ids: list[int]
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: object = None
    comp_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    comp_prefix_len: int = 0


def admit(cache: TwoTierRadixCache, req_pool: ReqToTokenPool, prompt: list[int]) -> FakeReq:
    """Match, lock both tiers on last_node, take the tree's handles."""
    m = cache.match_prefix(prompt)
    cache.inc_lock_ref(m.last_node)
    cache.inc_comp_lock_ref(m.last_node)
    req = FakeReq(req_pool.alloc(), list(prompt), prefix_indices=m.device_indices, last_node=m.last_node,
                  comp_indices=m.comp_indices, comp_prefix_len=m.comp_len)
    req_pool.write(req.req_pool_idx, 0, m.device_indices)
    req.kv_allocated_len = req.kv_committed_len = len(m.device_indices)
    return req


def extend(allocator: PagedTokenAllocator, req_pool: ReqToTokenPool, req: FakeReq, n: int) -> torch.Tensor:
    cur = req.kv_allocated_len
    last = int(req_pool.req_to_token[req.req_pool_idx, cur - 1]) if cur else 0
    new = allocator.alloc_extend(last_slot=last, cur_len=cur, num_new=n)
    req_pool.write(req.req_pool_idx, cur, new)
    req.kv_allocated_len += n
    req.kv_committed_len += n
    return new


def fold(pool: CompressedKVPool, req: FakeReq, n_pages: int) -> torch.Tensor:
    """The request compresses its next n_pages whole pages into chunks it owns."""
    ids = pool.alloc(n_pages)
    req.comp_indices = torch.cat([req.comp_indices, ids])
    return ids


def test_finished_req_caches_both_tiers_and_frees_its_tails():
    cache, allocator, pool, req_pool = make_cache()
    a = admit(cache, req_pool, [1, 2, 3, 4, 5, 6, 7])
    assert extend(allocator, req_pool, a, 7).tolist() == [2, 3, 4, 5, 6, 7, 8]  # pages 1..4
    assert fold(pool, a, 2).tolist() == [1, 2]  # page 3 is still an exact tail
    a.fill_ids.append(99)
    cache.cache_finished_req(a)
    assert a.req_pool_idx is None and req_pool.available_size() == 4
    assert (allocator.available_size(), pool.available_chunks()) == (16 - 6, NUM_CHUNKS - 2)
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5, 6, 7], [1, 2], 4)
    assert sizes(cache) == (6, 0, 2, 0)


def test_second_request_hits_both_tiers_and_extends_them():
    cache, allocator, pool, req_pool = make_cache()
    a = admit(cache, req_pool, [1, 2, 3, 4, 5])
    extend(allocator, req_pool, a, 5)
    fold(pool, a, 2)
    cache.cache_finished_req(a)
    b = admit(cache, req_pool, [1, 2, 3, 4, 8, 9, 10])
    assert (b.prefix_indices.tolist(), b.comp_indices.tolist()) == ([2, 3, 4, 5], [1, 2])
    assert b.comp_prefix_len == 4
    assert sizes(cache) == (0, 4, 0, 2)
    extend(allocator, req_pool, b, 3)
    assert fold(pool, b, 1).tolist() == [3]
    b.fill_ids.append(99)
    cache.cache_finished_req(b)
    assert handles(cache, [1, 2, 3, 4, 8, 9]) == ([2, 3, 4, 5, 6, 7], [1, 2, 3], 6)
    assert sizes(cache) == (6, 0, 3, 0)
    assert cache.evict(100) == 6
    assert (allocator.available_size(), pool.available_chunks()) == (16, NUM_CHUNKS)


def test_concurrent_identical_prompts_compress_the_prefix_once():
    cache, allocator, pool, req_pool = make_cache()
    prompt = [1, 2, 3, 4, 5]
    a, b = admit(cache, req_pool, prompt), admit(cache, req_pool, prompt)
    extend(allocator, req_pool, a, 5)
    extend(allocator, req_pool, b, 5)
    assert (fold(pool, a, 2).tolist(), fold(pool, b, 2).tolist()) == ([1, 2], [3, 4])
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)  # its chunks 3, 4 duplicate the tree's
    assert handles(cache, prompt) == ([2, 3, 4, 5], [1, 2], 4)
    assert pool.available_chunks() == NUM_CHUNKS - 2
    assert sorted(pool.free_ids.tolist()) == [3, 4, 5, 6, 7, 8]
    assert cache.evict(100) == 4
    assert (allocator.available_size(), pool.available_chunks()) == (16, NUM_CHUNKS)


def test_unfinished_req_moves_to_the_trees_chunks_and_locks_in_both_tiers():
    cache, allocator, pool, req_pool = make_cache()
    prompt = [1, 2, 3, 4, 5]
    e, f = admit(cache, req_pool, prompt), admit(cache, req_pool, prompt)
    extend(allocator, req_pool, e, 5)
    extend(allocator, req_pool, f, 5)
    fold(pool, e, 2)  # 1, 2
    fold(pool, f, 1)  # 3: f compressed only its first page so far
    cache.cache_unfinished_req(e)
    cache.cache_unfinished_req(f)
    assert (f.comp_indices.tolist(), f.comp_prefix_len) == ([1], 2)  # same coverage, the tree's id
    assert (f.prefix_indices.tolist(), e.prefix_indices.tolist()) == ([2, 3, 4, 5], [2, 3, 4, 5])
    assert f.last_node is e.last_node
    assert (e.last_node.lock_ref, e.last_node.comp_lock_ref) == (2, 2)
    assert pool.available_chunks() == NUM_CHUNKS - 2  # f's chunk 3 went back
    assert sizes(cache) == (0, 4, 0, 2)

    cache.cache_finished_req(e)
    cache.cache_finished_req(f)
    assert sizes(cache) == (4, 0, 2, 0)
    assert cache.evict(100) == 4
    assert (allocator.available_size(), pool.available_chunks()) == (16, NUM_CHUNKS)
    assert req_pool.available_size() == 4


def test_request_rebuilds_evicted_comp_and_attaches_it_for_the_next():
    cache, allocator, pool, req_pool = make_cache()
    a = admit(cache, req_pool, [1, 2, 3, 4, 5])
    extend(allocator, req_pool, a, 5)
    fold(pool, a, 2)
    cache.cache_finished_req(a)
    assert cache.evict_compressed(100) == 2
    b = admit(cache, req_pool, [1, 2, 3, 4, 5])
    assert (len(b.prefix_indices), b.comp_prefix_len) == (4, 0)  # exact hit only
    ids = pool.alloc(2)  # rebuilt from the exact KV (compress_pages)
    assert cache.set_comp(b.last_node, ids).tolist() == []
    b.comp_indices, b.comp_prefix_len = ids, 4
    assert sizes(cache) == (0, 4, 0, 2)  # b's comp lock covers the attached chunks
    extend(allocator, req_pool, b, 1)
    cache.cache_finished_req(b)
    assert handles(cache, [1, 2, 3, 4]) == ([2, 3, 4, 5], ids.tolist(), 4)
    assert sizes(cache) == (4, 0, 2, 0)
    cache.evict(100)
    assert (allocator.available_size(), pool.available_chunks()) == (16, NUM_CHUNKS)


def test_disabled_cache_frees_both_tiers_of_a_finished_request():
    cache, allocator, pool, req_pool = make_cache(disable=True)
    a = admit(cache, req_pool, [1, 2, 3, 4, 5])
    extend(allocator, req_pool, a, 5)
    fold(pool, a, 2)
    cache.cache_finished_req(a)
    assert cache.total_size() == 0
    assert (allocator.available_size(), pool.available_chunks()) == (16, NUM_CHUNKS)


def test_unfinished_req_twice_moves_both_locks_down_the_path():
    cache, allocator, pool, req_pool = make_cache()
    c = admit(cache, req_pool, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    extend(allocator, req_pool, c, 5)  # first prefill chunk: positions 0..4
    fold(pool, c, 2)
    cache.cache_unfinished_req(c)
    upper = c.last_node
    assert (upper.key, upper.lock_ref, upper.comp_lock_ref) == ([1, 2, 3, 4], 1, 1)
    extend(allocator, req_pool, c, 4)  # second chunk: positions 5..8
    fold(pool, c, 2)
    cache.cache_unfinished_req(c)
    assert (c.last_node.key, c.last_node.parent is upper) == ([5, 6, 7, 8], True)
    assert (upper.lock_ref, upper.comp_lock_ref) == (1, 1)
    assert (c.last_node.lock_ref, c.last_node.comp_lock_ref) == (1, 1)
    assert (c.comp_indices.tolist(), c.comp_prefix_len) == ([1, 2, 3, 4], 8)
    assert sizes(cache) == (0, 8, 0, 4)
    c.fill_ids.append(99)
    cache.cache_finished_req(c)
    assert sizes(cache) == (8, 0, 4, 0)


def test_finished_req_frees_chunks_past_its_cached_pages():
    cache, allocator, pool, req_pool = make_cache()
    a = admit(cache, req_pool, [1, 2, 3, 4, 5, 6])
    extend(allocator, req_pool, a, 6)
    fold(pool, a, 3)  # 1, 2, 3
    a.kv_committed_len = 5  # e.g. a rollback: only pages 0 and 1 are whole and committed
    cache.cache_finished_req(a)
    assert handles(cache, [1, 2, 3, 4, 5, 6]) == ([2, 3, 4, 5], [1, 2], 4)
    assert pool.available_chunks() == NUM_CHUNKS - 2
    assert pool.free_ids.tolist()[-1] == 3


# ----------------------------------------------------------------- many requests


def own_counts(reqs: list[FakeReq]) -> tuple[int, int]:
    """(exact slots, chunk ids) the running requests own: whole pages past their tree prefix."""
    slots = sum(-(-(r.kv_allocated_len - len(r.prefix_indices)) // P) * P for r in reqs)
    return slots, sum(len(r.comp_indices) - r.comp_prefix_len // P for r in reqs)


def test_random_requests_keep_the_invariants_and_give_everything_back():
    rng = random.Random(0)
    cache, allocator, pool, req_pool = make_cache()
    bases = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20]]
    running: list[FakeReq] = []
    for _ in range(1500):
        op = rng.choices(range(7), weights=[2, 3, 3, 2, 1, 1, 2])[0]
        r = rng.choice(running) if running else None
        if op == 0 and req_pool.available_size() > 0:
            running.append(admit(cache, req_pool, rng.choice(bases)[: rng.randint(1, 10)]))
        elif op == 1 and r is not None and r.kv_committed_len < len(r.fill_ids):
            n = rng.randint(1, len(r.fill_ids) - r.kv_committed_len)
            short = allocator.pages_needed(r.kv_allocated_len, n) * P - allocator.available_size()
            if short <= 0 or cache.evict(short) >= short:
                extend(allocator, req_pool, r, n)
        elif op == 2 and r is not None and len(r.comp_indices) < r.kv_committed_len // P:
            n = rng.randint(1, r.kv_committed_len // P - len(r.comp_indices))
            short = n - pool.available_chunks()
            if short <= 0 or cache.evict_compressed(short) >= short:
                fold(pool, r, n)
        elif op == 3 and r is not None and len(r.comp_indices) == r.comp_prefix_len // P < len(r.prefix_indices) // P:
            ids = pool.alloc(len(r.prefix_indices) // P - len(r.comp_indices))  # rebuild the missing chunks
            if ids is not None:
                pool.free(cache.set_comp(r.last_node, torch.cat([r.comp_indices, ids])))
                r.comp_indices = cache.path_comp(r.last_node)
                r.comp_prefix_len = len(r.comp_indices) * P
        elif op == 4 and r is not None:
            cache.cache_unfinished_req(r)
        elif op == 5 and r is not None:
            cache.cache_finished_req(r)
            running.remove(r)
        elif op == 6:
            cache.evict(rng.randint(0, 6)) if rng.random() < 0.5 else cache.evict_compressed(rng.randint(0, 3))
        check_invariants(cache)
        own_slots, own_chunks = own_counts(running)
        assert allocator.available_size() + cache.total_size() + own_slots == NUM_PAGES * P
        assert pool.available_chunks() + cache.comp_total_chunks() + own_chunks == NUM_CHUNKS
    for r in running:
        cache.cache_finished_req(r)
    check_invariants(cache)
    assert sizes(cache)[1::2] == (0, 0)  # nothing is locked any more
    cache.evict(100)
    assert (allocator.available_size(), pool.available_chunks()) == (NUM_PAGES * P, NUM_CHUNKS)
    assert sorted(pool.free_ids.tolist()) == list(range(1, NUM_CHUNKS + 1))
