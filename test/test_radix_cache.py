"""Specification of mem_cache/radix_cache.py: page-aligned prefix sharing, locks, LRU eviction."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from sglang_vericache.mem_cache.memory_pool import PagedTokenAllocator, ReqToTokenPool
from sglang_vericache.mem_cache.radix_cache import RadixCache, TreeNode


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_cache(page_size: int, num_pages: int = 8, disable: bool = False):
    req_pool = ReqToTokenPool(size=4, max_context_len=32)
    allocator = PagedTokenAllocator(num_pages=num_pages, page_size=page_size)
    return RadixCache(req_pool, allocator, page_size=page_size, disable=disable), allocator, req_pool


def take(allocator: PagedTokenAllocator, n: int) -> torch.Tensor:
    """n fresh slots starting on a page boundary (as a request's new pages would be)."""
    return allocator.alloc_extend(last_slot=0, cur_len=0, num_new=n)


def assert_sizes(cache: RadixCache, evictable: int, protected: int) -> None:
    assert (cache.evictable_size(), cache.protected_size()) == (evictable, protected)


# ----------------------------------------------------------------- match / insert


def test_match_on_empty_tree_returns_root_and_no_slots():
    cache, _, _ = make_cache(page_size=1)
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.tolist() == []
    assert m.device_indices.dtype == torch.int64
    assert m.last_node is cache.root_node
    assert cache.total_size() == 0


def test_insert_then_exact_and_longer_match():
    cache, _, _ = make_cache(page_size=1)
    assert cache.insert([1, 2, 3], t([10, 11, 12])) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == [10, 11, 12]
    m = cache.match_prefix([1, 2, 3, 4])
    assert m.device_indices.tolist() == [10, 11, 12]
    assert m.last_node.key == [1, 2, 3]
    assert cache.match_prefix([2, 3]).device_indices.tolist() == []
    assert cache.total_size() == 3
    assert_sizes(cache, evictable=3, protected=0)


def test_partial_match_splits_node_and_both_halves_keep_their_slots():
    cache, _, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    m = cache.match_prefix([1, 2, 9])
    assert m.device_indices.tolist() == [10, 11]
    upper = m.last_node
    assert (upper.key, upper.value.tolist()) == ([1, 2], [10, 11])
    assert upper.parent is cache.root_node
    assert list(cache.root_node.children.values()) == [upper]
    (lower,) = upper.children.values()
    assert (lower.key, lower.value.tolist()) == ([3, 4], [12, 13])
    assert lower.parent is upper
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [10, 11, 12, 13]
    assert cache.total_size() == 4
    assert_sizes(cache, evictable=4, protected=0)


def test_partial_match_with_pages_splits_only_at_page_boundaries():
    cache, _, _ = make_cache(page_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], t(list(range(4, 12))))
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 9, 9])  # diverges inside the second page
    assert m.device_indices.tolist() == [4, 5, 6, 7]
    assert (m.last_node.key, m.last_node.value.tolist()) == ([1, 2, 3, 4], [4, 5, 6, 7])
    (lower,) = m.last_node.children.values()
    assert (lower.key, lower.value.tolist()) == ([5, 6, 7, 8], [8, 9, 10, 11])
    assert list(m.last_node.children) == [(5, 6, 7, 8)]  # children keyed by their first page


def test_insert_returns_length_already_present():
    cache, _, _ = make_cache(page_size=1)
    assert cache.insert([1, 2, 3], t([10, 11, 12])) == 0
    assert cache.insert([1, 2, 3, 4, 5], t([20, 21, 22, 23, 24])) == 3
    assert cache.match_prefix([1, 2, 3, 4, 5]).device_indices.tolist() == [10, 11, 12, 23, 24]
    assert cache.insert([1, 2], t([30, 31])) == 2  # fully present (splits, adds nothing)
    assert cache.insert([1, 2, 3, 4, 5], t([40, 41, 42, 43, 44])) == 5
    assert cache.total_size() == 5
    assert_sizes(cache, evictable=5, protected=0)


def test_two_branches_share_a_prefix():
    cache, _, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3, 4], t([10, 11, 12, 13]))
    assert cache.insert([1, 2, 5, 6], t([20, 21, 22, 23])) == 2
    assert cache.match_prefix([1, 2, 5, 6]).device_indices.tolist() == [10, 11, 22, 23]
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [10, 11, 12, 13]
    (shared,) = cache.root_node.children.values()
    assert shared.key == [1, 2]
    assert sorted(c.key for c in shared.children.values()) == [[3, 4], [5, 6]]
    assert cache.total_size() == 6


def test_page_alignment_matches_and_inserts_whole_pages_only():
    cache, _, _ = make_cache(page_size=4)
    key = [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(AssertionError):
        cache.insert(key, t(list(range(4, 11))))
    assert cache.insert(key[:4], t([4, 5, 6, 7])) == 0
    assert cache.match_prefix(key).device_indices.tolist() == [4, 5, 6, 7]
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == []  # shorter than a page
    assert cache.total_size() == 4


def test_divergence_inside_a_page_branches_at_the_page_start():
    cache, _, _ = make_cache(page_size=4)
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], t(list(range(4, 12))))
    assert cache.insert([1, 2, 3, 4, 5, 6, 0, 0], t(list(range(12, 20)))) == 4
    (shared,) = cache.root_node.children.values()
    assert shared.key == [1, 2, 3, 4]
    assert sorted(shared.children) == [(5, 6, 0, 0), (5, 6, 7, 8)]
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 0, 0])
    assert m.device_indices.tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


def test_hit_rate_counts_matched_over_queried_tokens():
    cache, _, _ = make_cache(page_size=4)
    assert cache.hit_rate() == 0.0
    cache.insert([1, 2, 3, 4, 5, 6, 7, 8], t(list(range(4, 12))))
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 8 of 10
    cache.match_prefix([5, 6, 7, 8])  # 0 of 4
    cache.match_prefix([1, 2, 3, 4], record_stats=False)
    assert (cache.num_matched_tokens, cache.num_queried_tokens) == (8, 14)
    assert cache.hit_rate() == 8 / 14


def test_pretty_print_lists_nodes_depth_first():
    cache, _, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3], t([10, 11, 12]))
    cache.insert([1, 2, 4], t([20, 21, 22]))
    lines = cache.pretty_print().splitlines()
    assert [line.split(" r=")[0] for line in lines] == ["2 [1, 2]", "  1 [3]", "  1 [4]", "#tokens: 4"]


# ----------------------------------------------------------------- locks and eviction


def test_lock_ref_protects_from_eviction_and_sizes_are_exact():
    cache, allocator, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3], take(allocator, 3))
    node = cache.match_prefix([1, 2, 3]).last_node
    assert cache.inc_lock_ref(node) == -3
    assert_sizes(cache, evictable=0, protected=3)
    assert cache.evict(10) == 0
    assert cache.inc_lock_ref(node) == 0  # second locker: already protected
    assert node.lock_ref == 2
    assert cache.dec_lock_ref(node) == 0
    assert_sizes(cache, evictable=0, protected=3)
    assert cache.evict(10) == 0
    assert cache.dec_lock_ref(node) == 3
    assert_sizes(cache, evictable=3, protected=0)
    assert cache.evict(10) == 3
    assert_sizes(cache, evictable=0, protected=0)
    assert cache.total_size() == 0


def test_lock_on_inner_node_leaves_other_branches_evictable():
    cache, allocator, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3], take(allocator, 3))
    assert cache.insert([1, 2, 4, 5], torch.cat([t([0, 0]), take(allocator, 2)])) == 2
    inner = cache.match_prefix([1, 2]).last_node
    assert inner.key == [1, 2]
    assert cache.inc_lock_ref(inner) == -2
    assert_sizes(cache, evictable=3, protected=2)
    assert cache.evict(100) == 3  # [3] and [4, 5]; [1, 2] stays
    assert_sizes(cache, evictable=0, protected=2)
    assert cache.match_prefix([1, 2, 4, 5]).last_node is inner
    cache.dec_lock_ref(inner)
    assert_sizes(cache, evictable=2, protected=0)


def test_split_of_locked_node_keeps_both_halves_locked():
    cache, allocator, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3, 4], take(allocator, 4))
    locked = cache.match_prefix([1, 2, 3, 4]).last_node
    cache.inc_lock_ref(locked)
    upper = cache.match_prefix([1, 2, 9]).last_node  # splits the locked node
    assert (upper.key, upper.lock_ref, locked.key, locked.lock_ref) == ([1, 2], 1, [3, 4], 1)
    assert_sizes(cache, evictable=0, protected=4)
    assert cache.evict(10) == 0
    assert cache.dec_lock_ref(locked) == 4  # unlocks both halves
    assert (upper.lock_ref, locked.lock_ref) == (0, 0)
    assert_sizes(cache, evictable=4, protected=0)


def test_evict_least_recently_used_leaf_first_and_parents_after_children():
    cache, allocator, _ = make_cache(page_size=1, num_pages=8)
    cache.insert([1, 2, 3], take(allocator, 3))  # slots 1, 2, 3
    cache.insert([1, 2, 4], torch.cat([t([0, 0]), take(allocator, 1)]))  # [4] gets slot 4
    cache.insert([9], take(allocator, 1))  # slot 5; tree: [1,2] -> {[3], [4]}, and [9]
    cache.match_prefix([1, 2, 4])
    cache.match_prefix([9])
    cache.match_prefix([1, 2, 3])  # recency now: [4] < [9] < [3] <= [1,2]
    assert allocator.available_size() == 3
    assert cache.evict(1) == 1
    assert cache.match_prefix([1, 2, 4]).device_indices.tolist() == [1, 2]  # [4] went first
    assert allocator.free_pages[-1] == 4
    cache.match_prefix([1, 2, 3])  # keep [3] newer than [9]
    assert cache.evict(1) == 1
    assert cache.match_prefix([9]).device_indices.tolist() == []
    assert allocator.free_pages[-1] == 5
    assert cache.evict(1) == 1  # [3]; its parent [1, 2] becomes a leaf but is not needed yet
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == [1, 2]
    assert cache.evict(1) == 2  # the parent goes whole
    assert cache.total_size() == 0
    assert allocator.available_size() == 8


def test_single_evict_call_reaches_parents_through_the_heap():
    cache, allocator, _ = make_cache(page_size=1)
    cache.insert([1, 2, 3], take(allocator, 3))
    cache.insert([1, 2, 4], torch.cat([t([0, 0]), take(allocator, 1)]))
    assert cache.evict(3) == 4  # both leaves (2 tokens), then their parent [1, 2]
    assert cache.total_size() == 0
    assert allocator.available_size() == 8


def test_evict_frees_whole_pages_back_to_the_allocator():
    cache, allocator, _ = make_cache(page_size=4, num_pages=4)
    s1 = take(allocator, 8)  # pages 1, 2
    assert cache.insert([1, 2, 3, 4, 5, 6, 7, 8], s1) == 0
    s2 = take(allocator, 8)  # pages 3, 4
    assert s2.tolist() == list(range(12, 20))
    assert cache.insert([1, 2, 3, 4, 9, 9, 9, 9], s2) == 4
    allocator.free(s2[:4])  # the inserter frees its duplicate page 3
    assert allocator.available_size() == 4
    cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])  # [9, 9, 9, 9] is now the LRU leaf
    assert cache.evict(1) == 4
    assert allocator.available_size() == 8
    assert sorted(allocator.free_pages) == [3, 4]
    assert cache.evict(100) == 8
    assert allocator.available_size() == 16
    assert sorted(allocator.free_pages) == [1, 2, 3, 4]
    assert_sizes(cache, evictable=0, protected=0)


def test_reset_forgets_the_tree():
    cache, _, _ = make_cache(page_size=1)
    cache.insert([1, 2], t([1, 2]))
    cache.inc_lock_ref(cache.match_prefix([1, 2]).last_node)
    cache.reset()
    assert cache.total_size() == 0
    assert_sizes(cache, evictable=0, protected=0)
    assert cache.match_prefix([1, 2]).device_indices.tolist() == []


# ----------------------------------------------------------------- request hooks


@dataclass
class FakeReq:
    req_pool_idx: int | None
    fill_ids: list[int]
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: TreeNode | None = None


def admit(cache: RadixCache, allocator: PagedTokenAllocator, req_pool: ReqToTokenPool, prompt: list[int]):
    """What the scheduler does for a new request: match, lock, allocate the rest of the prompt."""
    m = cache.match_prefix(prompt)
    cache.inc_lock_ref(m.last_node)
    req = FakeReq(req_pool.alloc(), list(prompt), prefix_indices=m.device_indices, last_node=m.last_node)
    req_pool.write(req.req_pool_idx, 0, m.device_indices)
    req.kv_allocated_len = len(m.device_indices)
    req.kv_committed_len = len(m.device_indices)
    return req


def extend(allocator: PagedTokenAllocator, req_pool: ReqToTokenPool, req: FakeReq, n: int) -> torch.Tensor:
    """Allocates and 'computes' KV for the next n positions."""
    cur = req.kv_allocated_len
    last = int(req_pool.req_to_token[req.req_pool_idx, cur - 1]) if cur else 0
    new = allocator.alloc_extend(last_slot=last, cur_len=cur, num_new=n)
    req_pool.write(req.req_pool_idx, cur, new)
    req.kv_allocated_len += n
    req.kv_committed_len += n
    return new


def row(req_pool: ReqToTokenPool, req: FakeReq, n: int) -> list[int]:
    return req_pool.req_to_token[req.req_pool_idx, :n].tolist()


def test_finished_req_caches_whole_pages_and_frees_its_tail():
    cache, allocator, req_pool = make_cache(page_size=4)
    a = admit(cache, allocator, req_pool, list(range(1, 11)))
    assert extend(allocator, req_pool, a, 10).tolist() == list(range(4, 14))  # pages 1, 2, 3
    a.fill_ids.append(99)  # one sampled token whose KV is not computed
    cache.cache_finished_req(a)
    assert a.req_pool_idx is None
    assert req_pool.available_size() == 4
    assert allocator.available_size() == 32 - 8  # page 3 (slots 12, 13) went back
    assert cache.match_prefix(list(range(1, 11))).device_indices.tolist() == list(range(4, 12))
    assert_sizes(cache, evictable=8, protected=0)


def test_next_request_reuses_prefix_and_extends_the_tree():
    cache, allocator, req_pool = make_cache(page_size=4)
    a = admit(cache, allocator, req_pool, list(range(1, 11)))
    extend(allocator, req_pool, a, 10)
    cache.cache_finished_req(a)
    b = admit(cache, allocator, req_pool, list(range(1, 9)) + [20, 21, 22, 23, 24])
    assert b.prefix_indices.tolist() == list(range(4, 12))
    assert_sizes(cache, evictable=0, protected=8)
    assert extend(allocator, req_pool, b, 5).tolist() == [12, 13, 14, 15, 16]  # pages 3, 4
    b.fill_ids.append(99)
    cache.cache_finished_req(b)
    assert allocator.available_size() == 32 - 12  # page 4 (slot 16) went back
    assert cache.total_size() == 12
    assert_sizes(cache, evictable=12, protected=0)
    assert cache.evict(100) == 12
    assert allocator.available_size() == 32


def test_concurrent_identical_prompts_free_the_duplicate_pages():
    cache, allocator, req_pool = make_cache(page_size=4)
    prompt = list(range(1, 10))
    a = admit(cache, allocator, req_pool, prompt)
    b = admit(cache, allocator, req_pool, prompt)
    assert extend(allocator, req_pool, a, 9).tolist() == list(range(4, 13))  # pages 1, 2, 3
    assert extend(allocator, req_pool, b, 9).tolist() == list(range(16, 25))  # pages 4, 5, 6
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)  # its pages 4, 5 duplicate the tree's; page 6 is its tail
    assert allocator.available_size() == 32 - 8
    assert sorted(allocator.free_pages) == [3, 4, 5, 6, 7, 8]
    assert cache.match_prefix(prompt).device_indices.tolist() == list(range(4, 12))
    cache.evict(100)
    assert sorted(allocator.free_pages) == list(range(1, 9))  # every page back exactly once


def test_unfinished_req_shares_chunks_while_running():
    cache, allocator, req_pool = make_cache(page_size=4)
    prompt = list(range(1, 11))
    c = admit(cache, allocator, req_pool, prompt)
    extend(allocator, req_pool, c, 6)  # first chunk: slots 4..9
    cache.cache_unfinished_req(c)  # caches [1..4]
    assert c.prefix_indices.tolist() == [4, 5, 6, 7]
    assert c.last_node.key == [1, 2, 3, 4]
    assert c.last_node.lock_ref == 1
    assert_sizes(cache, evictable=0, protected=4)
    assert row(req_pool, c, 6) == [4, 5, 6, 7, 8, 9]
    assert allocator.available_size() == 32 - 8  # the request keeps its page 2

    d = admit(cache, allocator, req_pool, [1, 2, 3, 4, 50, 51, 52, 53])
    assert d.prefix_indices.tolist() == [4, 5, 6, 7]  # shared while c still runs
    assert d.last_node is c.last_node and c.last_node.lock_ref == 2

    assert extend(allocator, req_pool, c, 4).tolist() == [10, 11, 12, 13]  # second chunk
    cache.cache_unfinished_req(c)  # caches [1..8]
    assert c.prefix_indices.tolist() == list(range(4, 12))
    assert c.last_node.key == [5, 6, 7, 8]
    assert_sizes(cache, evictable=0, protected=8)

    c.fill_ids.append(99)
    cache.cache_finished_req(c)
    cache.cache_finished_req(d)  # d computed nothing: only its lock and row go
    assert allocator.available_size() == 32 - 8
    assert_sizes(cache, evictable=8, protected=0)
    assert req_pool.available_size() == 4
    assert cache.evict(100) == 8
    assert allocator.available_size() == 32


def test_unfinished_req_switches_to_tree_slots_and_frees_its_duplicates():
    cache, allocator, req_pool = make_cache(page_size=4)
    prompt = list(range(1, 10))
    e = admit(cache, allocator, req_pool, prompt)
    f = admit(cache, allocator, req_pool, prompt)
    extend(allocator, req_pool, e, 9)  # pages 1, 2, 3
    extend(allocator, req_pool, f, 9)  # pages 4, 5, 6
    cache.cache_unfinished_req(e)
    cache.cache_unfinished_req(f)
    assert row(req_pool, f, 9) == [4, 5, 6, 7, 8, 9, 10, 11, 24]  # tree slots, then its own
    assert f.prefix_indices.tolist() == list(range(4, 12))
    assert f.last_node is e.last_node and e.last_node.lock_ref == 2
    assert allocator.available_size() == 32 - 16  # pages 4, 5 went back
    assert_sizes(cache, evictable=0, protected=8)

    cache.cache_finished_req(e)
    cache.cache_finished_req(f)
    assert allocator.available_size() == 32 - 8
    assert_sizes(cache, evictable=8, protected=0)
    assert cache.evict(100) == 8
    assert sorted(allocator.free_pages) == list(range(1, 9))


def test_many_requests_leave_no_leak():
    cache, allocator, req_pool = make_cache(page_size=4, num_pages=16)
    initial = allocator.available_size()
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9, 9], [7, 7]]
    for prompt in prompts:
        r = admit(cache, allocator, req_pool, prompt)
        extend(allocator, req_pool, r, len(prompt) - r.kv_allocated_len)
        cache.cache_unfinished_req(r)
        extend(allocator, req_pool, r, 2)  # two decode steps
        r.fill_ids += [100, 101, 102]
        cache.cache_finished_req(r)
    assert_sizes(cache, evictable=cache.total_size(), protected=0)
    assert req_pool.available_size() == 4
    cache.evict(10**6)
    assert allocator.available_size() == initial
    assert sorted(allocator.free_pages) == list(range(1, 17))


def test_disabled_cache_matches_nothing_and_frees_everything():
    cache, allocator, req_pool = make_cache(page_size=4, disable=True)
    assert cache.insert([1, 2, 3, 4], t([4, 5, 6, 7])) == 0
    assert cache.total_size() == 0
    r = admit(cache, allocator, req_pool, list(range(1, 11)))
    assert r.prefix_indices.tolist() == [] and r.last_node is cache.root_node
    extend(allocator, req_pool, r, 10)
    cache.cache_unfinished_req(r)  # no-op
    assert r.prefix_indices.tolist() == []
    assert allocator.available_size() == 32 - 12
    cache.cache_finished_req(r)
    assert allocator.available_size() == 32
    assert req_pool.available_size() == 4
    assert cache.match_prefix(list(range(1, 11))).device_indices.tolist() == []
    assert cache.evict(100) == 0
    assert_sizes(cache, evictable=0, protected=0)
