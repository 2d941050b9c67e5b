"""The KVStore contract, run against every backend: FileStore (a directory) and RedisStore."""

from __future__ import annotations

import pytest

from sglang_vericache.mem_cache.storage.file_backend import FileStore
from sglang_vericache.mem_cache.storage.redis_backend import RedisStore


@pytest.fixture(params=["file", "redis"])
def make_store(request, tmp_path):
    """make_store(capacity) -> a new store object; all objects of one test share one store."""
    made = []
    if request.param == "file":
        def make(capacity=None):
            made.append(FileStore(str(tmp_path / "kv"), capacity_bytes=capacity))
            return made[-1]
    else:
        server = request.getfixturevalue("redis_server")
        prefix = request.getfixturevalue("redis_prefix")

        def make(capacity=None):
            made.append(RedisStore(server.url, capacity_bytes=capacity, prefix=prefix))
            return made[-1]
    yield make
    made[0].clear()
    for s in made:
        s.close()


def val(tag: str, n: int = 100) -> bytes:
    return (tag.encode() * n)[:n]


def test_put_then_get_returns_the_bytes(make_store):
    s = make_store()
    assert s.put("a", val("a")) is True
    assert s.get(["a"]) == [val("a")]
    assert (s.stats.hits, s.stats.misses, s.stats.bytes_in, s.stats.bytes_out) == (1, 0, 100, 100)


def test_get_stops_at_the_first_miss(make_store):
    s = make_store()
    for k in ("a", "b", "d"):
        s.put(k, val(k))
    assert s.get(["a", "b", "c", "d"]) == [val("a"), val("b")]
    assert s.get(["c", "a"]) == []
    assert (s.stats.hits, s.stats.misses) == (2, 2)


def test_match_prefix_counts_leading_present_keys(make_store):
    s = make_store()
    for k in ("a", "b", "d"):
        s.put(k, val(k))
    assert s.match_prefix(["a", "b", "c", "d"]) == 2
    assert s.match_prefix(["c", "a"]) == 0
    assert s.match_prefix([]) == 0
    assert s.contains("d") and not s.contains("c")


def test_capacity_evicts_least_recently_used_first(make_store):
    s = make_store(capacity=300)
    for k in ("a", "b", "c"):
        s.put(k, val(k))
    s.get(["a"])  # a is now more recent than b and c
    assert s.put("d", val("d")) is True
    assert s.keys_lru() == ["c", "a", "d"]
    assert s.size_bytes() == 300
    assert s.stats.evictions == 1


def test_a_big_put_evicts_as_many_as_it_needs_oldest_first(make_store):
    s = make_store(capacity=300)
    for k in ("a", "b", "c"):
        s.put(k, val(k))
    s.put("e", val("e", 150))
    assert s.keys_lru() == ["c", "e"]
    assert s.size_bytes() == 250
    assert s.stats.evictions == 2


def test_match_prefix_does_not_count_as_use(make_store):
    s = make_store(capacity=300)
    for k in ("a", "b", "c"):
        s.put(k, val(k))
    assert s.match_prefix(["a"]) == 1
    s.put("d", val("d"))
    assert s.keys_lru() == ["b", "c", "d"]


def test_value_larger_than_capacity_is_refused(make_store):
    s = make_store(capacity=300)
    s.put("a", val("a"))
    assert s.put("big", val("x", 301)) is False
    assert s.keys_lru() == ["a"]
    assert (s.stats.rejected, s.stats.evictions) == (1, 0)


def test_overwrite_replaces_size_and_refreshes_use(make_store):
    s = make_store()
    s.put("a", val("a"))
    s.put("b", val("b"))
    s.put("a", val("A", 40))
    assert s.get(["a"]) == [val("A", 40)]
    assert s.size_bytes() == 140
    assert s.keys_lru() == ["b", "a"]


def test_delete_removes_the_key_and_its_bytes(make_store):
    s = make_store()
    s.put("a", val("a"))
    s.put("b", val("b"))
    assert s.delete("a") is True
    assert s.delete("a") is False
    assert s.match_prefix(["a"]) == 0
    assert (s.size_bytes(), s.keys_lru()) == (100, ["b"])


def test_two_store_objects_share_entries_and_lru(make_store):
    s1, s2 = make_store(capacity=300), make_store(capacity=300)
    s1.put("a", val("a"))
    assert s2.get(["a"]) == [val("a")]
    s2.put("b", val("b"))
    s1.put("c", val("c"))
    s2.get(["a"])
    s1.put("d", val("d"))  # b is the least recently used across both objects
    assert s2.keys_lru() == ["c", "a", "d"]
    assert s1.match_prefix(["a", "b"]) == 1
    s1.delete("a")
    assert s2.get(["a"]) == []


def test_clear_empties_the_store(make_store):
    s = make_store()
    s.put("a", val("a"))
    s.clear()
    assert (s.keys_lru(), s.size_bytes(), s.get(["a"])) == ([], 0, [])


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 129, "a:b"])
def test_malformed_keys_raise_value_error(make_store, bad):
    s = make_store()
    with pytest.raises(ValueError, match="store keys"):
        s.put(bad, b"x")
    with pytest.raises(ValueError, match="store keys"):
        s.get(["ok", bad])
