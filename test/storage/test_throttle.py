"""Bandwidth limits: a transfer of n bytes takes at least n / rate, transfers queue on one link."""

from __future__ import annotations

import time

import pytest

from sglang_vericache.mem_cache.storage.file_backend import FileStore
from sglang_vericache.mem_cache.storage.throttle import LinkThrottle, ThrottledStore


def fake_link(rate: float):
    now, slept = [0.0], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    return LinkThrottle(rate, clock=lambda: now[0], sleep=sleep), now, slept


def test_a_transfer_ends_size_over_rate_after_it_started():
    link, now, slept = fake_link(1000.0)
    now[0] = 0.1  # the backend took 0.1 s of the transfer's 0.5 s
    assert link.charge(500, started=0.0) == pytest.approx(0.4)
    assert now[0] == pytest.approx(0.5)


def test_transfers_queue_behind_each_other():
    link, now, slept = fake_link(1000.0)
    link.charge(500, started=0.0)
    link.charge(500, started=0.2)  # began while the first still held the link
    assert now[0] == pytest.approx(1.0) and slept == pytest.approx([0.5, 0.5])


def test_nothing_moved_costs_nothing():
    link, now, slept = fake_link(1000.0)
    assert link.charge(0, started=0.0) == 0.0 and slept == []


def test_throttled_store_put_and_get_each_take_at_least_size_over_rate(tmp_path):
    s = ThrottledStore(FileStore(str(tmp_path)), 200_000)
    data = b"k" * 30_000  # 0.15 s at 200 kB/s
    start = time.perf_counter()
    s.put("a", data)
    mid = time.perf_counter()
    assert s.get(["a", "missing"]) == [data]
    end = time.perf_counter()
    assert mid - start >= 0.15 and end - mid >= 0.15
    assert s.stats.throttle_seconds > 0


def test_bandwidth_must_be_positive():
    with pytest.raises(ValueError, match="bandwidth"):
        LinkThrottle(0)
