"""TransferEngine: FIFO copies on a worker thread, throttled to a link bandwidth.

Most tests inject a fake clock: time advances only when the engine sleeps (or a copy says it took
time), so busy intervals are exact. One test uses the real clock to show the throttle really
spends wall time off the caller's thread.
"""

from __future__ import annotations

import time

import pytest
import torch

from sglang_vericache.mem_cache.transfer_engine import TransferEngine
from sglang_vericache.server_args import ServerArgs


class FakeClock:
    def __init__(self):
        self.t = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


@pytest.fixture
def fake():
    return FakeClock()


def make_engine(bandwidth, fake: FakeClock) -> TransferEngine:
    return TransferEngine(bandwidth, "cpu", clock=fake.clock, sleep=fake.sleep)


def test_busy_intervals_are_back_to_back_link_times(fake):
    eng = make_engine(1000.0, fake)  # 1000 B/s
    handles = [eng.submit(lambda: None, n, tag=t) for n, t in ((500, "a"), (250, "b"), (1000, "c"))]
    handles[-1].wait()
    assert list(eng.busy_intervals) == [(0.0, 0.5, 500, "a"), (0.5, 0.75, 250, "b"), (0.75, 1.75, 1000, "c")]
    assert eng.bytes_total == 1750
    assert eng.busy_seconds == 1.75
    assert all(h.done() for h in handles)
    eng.shutdown()


def test_copy_time_counts_toward_the_link_time(fake):
    eng = make_engine(1000.0, fake)

    def copy_taking(seconds):
        def fn():
            fake.t += seconds  # the copy itself took this long
        return fn

    eng.submit(copy_taking(0.2), 500, "fast copy")  # link time 0.5: sleeps the remaining 0.3
    eng.submit(copy_taking(0.8), 500, "slow copy").wait()  # copy slower than the link: no sleep
    assert list(eng.busy_intervals) == [(0.0, 0.5, 500, "fast copy"), (0.5, 1.3, 500, "slow copy")]
    assert fake.sleeps == [pytest.approx(0.3)]
    eng.shutdown()


def test_jobs_run_in_submission_order_and_really_copy(fake):
    eng = make_engine(1e6, fake)
    src = [torch.full((4, 3), float(i)) for i in range(5)]
    dst = torch.zeros(5, 4, 3)
    order: list[int] = []

    def job(i):
        def fn():
            dst[i].copy_(src[i])
            order.append(i)
        return fn

    handles = [eng.submit(job(i), 48, tag=f"j{i}") for i in range(5)]
    for h in reversed(handles):
        h.wait()
    assert order == [0, 1, 2, 3, 4]
    assert [iv[3] for iv in eng.busy_intervals] == ["j0", "j1", "j2", "j3", "j4"]
    assert torch.equal(dst, torch.stack(src))
    eng.shutdown()


def test_unthrottled_engine_copies_without_sleeping(fake):
    eng = make_engine(None, fake)
    dst = torch.zeros(3)
    eng.submit(lambda: dst.copy_(torch.tensor([1.0, 2.0, 3.0])), 12, "x").wait()
    assert torch.equal(dst, torch.tensor([1.0, 2.0, 3.0]))
    assert fake.sleeps == []
    assert list(eng.busy_intervals) == [(0.0, 0.0, 12, "x")]
    assert eng.bandwidth is None
    eng.shutdown()


def test_copy_error_surfaces_on_wait_and_later_jobs_still_run(fake):
    eng = make_engine(1000.0, fake)

    def bad():
        raise ValueError("boom")

    h_bad = eng.submit(bad, 100, "bad")
    ran = []
    h_ok = eng.submit(lambda: ran.append(1), 100, "ok")
    with pytest.raises(RuntimeError, match="transfer 'bad' failed") as info:
        h_bad.wait()
    assert isinstance(info.value.__cause__, ValueError)
    h_ok.wait()
    assert ran == [1]
    # the failed job still spent its link time
    assert list(eng.busy_intervals) == [(0.0, 0.1, 100, "bad"), (0.1, 0.2, 100, "ok")]
    eng.shutdown()


def test_reset_stats_and_shutdown(fake):
    eng = make_engine(1000.0, fake)
    eng.submit(lambda: None, 500).wait()
    eng.reset_stats()
    assert (list(eng.busy_intervals), eng.bytes_total, eng.busy_seconds) == ([], 0, 0.0)
    eng.submit(lambda: None, 250, "after").wait()
    assert list(eng.busy_intervals) == [(0.5, 0.75, 250, "after")]
    eng.shutdown()
    eng.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        eng.submit(lambda: None, 1)


def test_bandwidth_must_be_positive():
    with pytest.raises(ValueError, match="bandwidth"):
        TransferEngine(0.0)


def test_real_throttle_runs_off_the_callers_thread():
    eng = TransferEngine(10_000.0)  # 1000 bytes take 0.1 s of real time
    t0 = time.perf_counter()
    h = eng.submit(lambda: None, 1000, "slow")
    assert time.perf_counter() - t0 < 0.05  # submit does not wait for the link
    assert not h.done()
    h.wait()
    assert time.perf_counter() - t0 >= 0.1
    start, end, nbytes, _ = eng.busy_intervals[0]
    assert end - start >= 0.1 and nbytes == 1000
    t1 = time.perf_counter()
    h.wait()  # already done: returns at once
    assert time.perf_counter() - t1 < 0.01
    eng.shutdown()


@pytest.mark.parametrize("bad", ["0", "fast", "-1GB"])
def test_link_bandwidth_flag_must_be_a_positive_size(bad):
    with pytest.raises(ValueError, match="--link-bandwidth"):
        ServerArgs(model_path="unused", link_bandwidth=bad)
