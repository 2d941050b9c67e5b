"""DegradingStore: a down or slow store turns into misses, one warning per outage, and recovers."""

from __future__ import annotations

import logging
import time

import pytest
import redis

from sglang_vericache.mem_cache.storage.base import StoreError
from sglang_vericache.mem_cache.storage.degrade import DegradingStore
from sglang_vericache.mem_cache.storage.file_backend import FileStore
from sglang_vericache.mem_cache.storage.redis_backend import RedisStore

LOGGER = "sglang_vericache.mem_cache.storage.degrade"


class FlakyStore(FileStore):
    """A FileStore that raises StoreError from every primitive while `failing`; counts calls."""

    failing = False
    calls = 0

    def _get_prefix(self, keys):
        self.calls += 1
        if self.failing:
            raise StoreError("injected outage")
        return super()._get_prefix(keys)

    def _put(self, key, data):
        self.calls += 1
        if self.failing:
            raise StoreError("injected outage")
        return super()._put(key, data)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_outage_gives_misses_one_warning_and_no_backend_calls_during_backoff(tmp_path, caplog):
    now = [0.0]
    inner = FlakyStore(str(tmp_path))
    s = DegradingStore(inner, backoff_s=5.0, clock=lambda: now[0])
    s.put("a", b"1")
    inner.failing = True
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert s.get(["a"]) == []
        assert s.put("b", b"2") is False
        calls = inner.calls
        now[0] = 4.9
        assert s.get(["a"]) == [] and inner.calls == calls  # within backoff: the backend is skipped
        now[0] = 5.1
        assert s.get(["a"]) == [] and inner.calls == calls + 1  # a probe, still down: no new warning
        assert len(warnings_of(caplog)) == 1 and "injected outage" in warnings_of(caplog)[0]
        inner.failing = False
        now[0] = 10.2
        assert s.get(["a"]) == [b"1"]
    assert (s.down, s.outages, s.stats.errors, s.stats.misses) == (False, 1, 2, 3)  # put was skipped


def test_each_outage_warns_once(tmp_path, caplog):
    now = [0.0]
    inner = FlakyStore(str(tmp_path))
    s = DegradingStore(inner, backoff_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for outage in range(2):
            inner.failing = True
            s.get(["a"])
            inner.failing = False
            now[0] += 2
            s.get(["a"])
    assert len(warnings_of(caplog)) == 2 and s.outages == 2


def test_malformed_keys_still_raise(tmp_path):
    s = DegradingStore(FileStore(str(tmp_path)))
    with pytest.raises(ValueError, match="store keys"):
        s.get(["bad key"])


def test_killed_redis_degrades_to_misses_then_recovers_on_restart(own_redis, caplog):
    s = DegradingStore(RedisStore(own_redis.url, timeout_s=0.5), backoff_s=0.2)
    assert s.put("a", b"x" * 100) and s.get(["a"]) == [b"x" * 100]
    own_redis.kill()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            assert s.get(["a"]) == []
            assert s.put("b", b"y") is False
            assert s.match_prefix(["a"]) == 0
            time.sleep(0.1)
    assert len(warnings_of(caplog)) == 1 and s.down
    own_redis.start()  # same port; persistence is off, so the store comes back empty
    time.sleep(0.25)
    assert s.put("c", b"z" * 10) is True
    assert s.get(["c"]) == [b"z" * 10]
    assert not s.down and s.outages == 1


def test_slow_redis_times_out_into_a_miss(own_redis, caplog):
    s = DegradingStore(RedisStore(own_redis.url, timeout_s=0.2), backoff_s=0.0)
    s.put("a", b"x")
    admin = redis.Redis(port=own_redis.port)
    admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # the server stalls every other client
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        start = time.monotonic()
        assert s.get(["a"]) == []
        assert 0.2 <= time.monotonic() - start < 2.0  # the timeout, not the end of the pause
    assert len(warnings_of(caplog)) == 1 and "Timeout" in warnings_of(caplog)[0]
    admin.execute_command("CLIENT", "UNPAUSE")
    assert s.get(["a"]) == [b"x"]
    admin.close()
