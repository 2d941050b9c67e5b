"""ExactPlacement (mem_cache/placement.py): which requests keep exact KV in device memory."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_vericache.mem_cache.placement import ExactPlacement
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


def placement(device_bytes, comp=None, engine=None, growth=0):
    return ExactPlacement(device_bytes, overhead_bytes=100, comp_pool=comp or FakeCompPool(),
                          kv_bytes_per_token=2, growth_tokens=growth, engine=engine)


def test_resident_in_admission_order_while_the_budget_holds():
    p = placement(1100)  # 1000 bytes left: 500 tokens of exact KV
    reqs = [FakeReq("a", 200), FakeReq("b", 200), FakeReq("c", 200), FakeReq("d", 50)]
    assert p.update(reqs) == [True, True, False, True]
    assert p.free_bytes() == 1000


def test_growth_is_reserved_per_resident_request():
    p = placement(1100, growth=51)
    assert p.update([FakeReq("a", 200), FakeReq("b", 200)]) == [True, False]  # 2 * 251 * 2 > 1000


def test_no_budget_means_everyone_is_resident():
    p = placement(None)
    assert p.update([FakeReq(str(i), 10**6) for i in range(4)]) == [True] * 4


def test_a_growing_compressed_tier_demotes_the_newest_first_and_promotion_copies_over_the_link():
    comp = FakeCompPool()
    engine = TransferEngine(2000.0, "cpu")  # 400 bytes take 0.2 s
    try:
        p = placement(1100, comp, engine)
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
    p = placement(1100)
    p.update([FakeReq("a", 200), FakeReq("b", 200)])
    p.update([FakeReq("b", 200)])
    assert set(p.state) == {"b"}
