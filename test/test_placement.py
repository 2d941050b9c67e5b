"""ExactPlacement (mem_cache/placement.py): which requests keep exact KV in device memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_vericache.mem_cache.placement import ExactPlacement, residency
from sglang_vericache.mem_cache.transfer_engine import TransferEngine


@dataclass
class FakeCompPool:
    num_chunks: int = 100
    used: int = 0
    chunk_bytes: int = 10

    def available_chunks(self) -> int:
        return self.num_chunks - self.used

    def bytes_per_chunk(self) -> int:
        return self.chunk_bytes


@dataclass
class FakeReq:
    rid: str
    kv_committed_len: int
    output_ids: list = field(default_factory=lambda: [1])
    decode_only: bool = False

    @property
    def spec(self):  # a Req's round state holds decode_only
        return self


def placement(device_bytes, comp=None, engine=None, growth=0, scratch=0, staging=0):
    # 100 bytes of scratch for the one drafting request each test has besides decode-only ones
    return ExactPlacement(device_bytes, comp or FakeCompPool(), kv_bytes_per_token=2, growth_tokens=growth,
                          scratch_bytes_per_drafter=scratch, staging_bytes=staging, engine=engine)


def test_residency_keeps_admission_order_and_skips_what_does_not_fit():
    assert residency([10, 10, 10], 25) == [True, True, False]
    assert residency([10, 30, 5], 20) == [True, False, True]
    assert residency([], 0) == []


def test_staging_is_held_only_while_some_exact_kv_is_on_the_host_and_scratch_per_drafter():
    p = placement(1000, scratch=50, staging=300)
    both = [FakeReq("a", 200), FakeReq("b", 200)]  # 800 bytes + 2 drafters' scratch: fits, no staging
    assert p.update(both) == [True, True]
    three = both + [FakeReq("c", 200)]  # does not fit: staging (300) is held, then only one fits
    assert p.update(three) == [True, False, False]
    for r in three:
        r.decode_only = True  # no scratch: 1000 - 300 staging = 700 -> one request of 400 bytes
    assert p.update(three) == [True, False, False]
    assert p.update(three[:2]) == [True, True]


def test_resident_in_admission_order_while_the_budget_holds():
    p = placement(1000)  # 500 tokens of exact KV
    reqs = [FakeReq("a", 200), FakeReq("b", 200), FakeReq("c", 200), FakeReq("d", 50)]
    assert p.update(reqs) == [True, True, False, True]
    assert p.free_bytes() == 1000 and p.free_bytes(drafters=2) == 1000


def test_growth_is_reserved_per_resident_request():
    p = placement(1000, growth=51)
    assert p.update([FakeReq("a", 200), FakeReq("b", 200)]) == [True, False]  # 2 * 251 * 2 > 1000


def test_no_budget_means_everyone_is_resident():
    p = placement(None)
    assert p.update([FakeReq(str(i), 10**6) for i in range(4)]) == [True] * 4


def test_a_growing_compressed_tier_demotes_the_newest_first_and_promotion_copies_over_the_link():
    comp = FakeCompPool()
    engine = TransferEngine(2000.0, "cpu")  # 400 bytes take 0.2 s
    try:
        p = placement(1000, comp, engine)
        reqs = [FakeReq("a", 200), FakeReq("b", 200)]
        assert p.update(reqs) == [True, True]
        comp.used = 30  # 300 bytes of compressed chunks: 700 left, room for one
        assert p.update(reqs) == [True, False]
        assert p.stats["demotions"] == 1
        comp.used = 0
        assert p.update(reqs) == [True, False]  # b comes back: its exact KV crosses the link first
        p.state["b"].promoting.wait()
        assert p.update(reqs) == [True, True]
        assert p.stats == {"promotions": 1, "demotions": 1, "promoted_bytes": 400}
        assert engine.bytes_total == 400
    finally:
        engine.shutdown()


def test_finished_requests_leave_the_placement():
    p = placement(1000)
    p.update([FakeReq("a", 200), FakeReq("b", 200)])
    p.update([FakeReq("b", 200)])
    assert set(p.state) == {"b"}


@dataclass
class FakeTreeCache:
    comp: FakeCompPool
    cached: int  # evictable compressed chunks (finished requests' prefixes)

    def comp_evictable_chunks(self) -> int:
        return self.cached

    def evict_compressed(self, n: int) -> int:
        n = min(n, self.cached)
        self.cached -= n
        self.comp.used -= n
        return n


def test_cached_compressed_chunks_give_way_to_resident_exact_kv():
    """60 of 100 chunks (10 bytes each) are the radix cache's, evictable: they do not count against the
    budget, and are evicted (the fewest that make room) when resident exact KV needs their bytes."""
    comp = FakeCompPool(used=70)  # 10 held by running requests' tiers, 60 cached
    tree = FakeTreeCache(comp, cached=60)
    p = ExactPlacement(1000, comp, kv_bytes_per_token=2, growth_tokens=0, tree_cache=lambda: tree)
    assert p.free_bytes() == 900 and p.free_bytes(evictable=False) == 300
    assert p.update([FakeReq("a", 200), FakeReq("b", 200)]) == [True, True]  # 800 bytes: 50 chunks evicted
    assert (tree.cached, comp.used) == (10, 20)
    assert p.update([FakeReq("a", 200)]) == [True]  # fits already: nothing more is evicted
    assert tree.cached == 10
