"""The scheduler with a KV store (--kv-store): a fresh instance reuses prefixes another one stored,
with exactly the output it would have computed itself; a store that dies or holds a corrupted page
degrades to recomputation, never to a failed or different request.

Prompts share a 33-token prefix (4 pages of 8) and have distinct tails, so page counts are exact:
a prompt p is looked up for its whole pages before its last token, (len(p) - 1) // 8 of them, and
write-through stores its len(p) // 8 whole prompt pages.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

from sglang_vericache.managers.scheduler import Scheduler
from sglang_vericache.server_args import ServerArgs, default_kv_store_path
from sglang_vericache.testing.random_checkpoints import make_random_checkpoint
from sglang_vericache.testing.scheduler_harness import make_request, run_to_completion
from sglang_vericache.testing.tree_invariants import check_invariants

P = 8
NEW = 16
TAILS = [40, 71, 9, 100, 23]
SHARED = 33


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("llama")))


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 400, (SHARED,), generator=g).tolist()
    return [shared + torch.randint(3, 400, (n,), generator=g).tolist() for n in TAILS]


def scheduler(path, **server) -> Scheduler:
    return Scheduler(ServerArgs(model_path=path, dtype="float32", skip_tokenizer_init=True, page_size=P, **server))


def requests(batch, tag="r"):
    return [make_request(f"{tag}{i}", ids, max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
            for i, ids in enumerate(batch)]


def run(sched, batch, tag="r"):
    res = run_to_completion(sched, requests(batch, tag))
    return [res[f"{tag}{i}"] for i in range(len(batch))]


def drive(sched, reqs, after_first_step=None) -> list[dict]:
    """Submits reqs, steps until all finish (calling after_first_step once after the first step)."""
    out = {r.rid: {"output_ids": [], "cached_tokens": None, "finished_reason": None} for r in reqs}
    for r in reqs:
        assert sched.handle_message(r) is None
    for step in range(10_000):
        if all(o["finished_reason"] for o in out.values()):
            return [out[r.rid] for r in reqs]
        sched.step()
        if step == 0 and after_first_step is not None:
            after_first_step()
        emitted, sched.outbox = sched.outbox, []
        for e in emitted:
            out[e.rid]["output_ids"] += e.new_output_ids
            out[e.rid]["cached_tokens"] = e.cached_tokens
            out[e.rid]["finished_reason"] = e.finished_reason or out[e.rid]["finished_reason"]
    raise AssertionError("requests did not finish")


def assert_pool_accounted(sched) -> None:
    """Idle: every exact slot is free or in the radix tree, unlocked (none leaked by loads)."""
    tree = sched.tree_cache
    assert tree.protected_size() == 0
    assert sched.allocator.available_size() + tree.evictable_size() == sched.allocator.size


def distinct_pages(prompts, lengths) -> int:
    """Distinct page-aligned prefixes among the first lengths[i] tokens of each prompt."""
    return len({tuple(p[: (k + 1) * P]) for p, n in zip(prompts, lengths) for k in range(n // P)})


def looked_up(batch):
    return [len(p) - 1 for p in batch]


@pytest.fixture(scope="module")
def no_store(llama, batch):
    return [r.output_ids for r in run(scheduler(llama), batch)]


def store_stats(sched) -> dict:
    return sched.get_stats().extra


# ---------------------------------------------------------------- full mode, file store


def test_fresh_instance_loads_the_stored_prefixes_and_emits_the_same_tokens(llama, batch, no_store, tmp_path):
    store = dict(kv_store="file", kv_store_path=str(tmp_path / "kv"))
    writer = scheduler(llama, **store)
    assert [r.output_ids for r in run(writer, batch)] == no_store
    w = store_stats(writer)
    assert w["kv_store_exact_pages_written_total"] == distinct_pages(batch, [len(p) for p in batch]) == 34
    assert w["kv_store_exact_pages_hit_total"] == 0
    assert w["kv_store_exact_pages_missed_total"] == sum(n // P for n in looked_up(batch)) == 48

    reader = scheduler(llama, **store)  # new pools, new radix tree, new store connection
    out = run(reader, batch)
    assert [r.output_ids for r in out] == no_store
    # Every whole page before the last token comes from the prefix cache, loaded from the store.
    assert [r.cached_tokens for r in out] == [n // P * P for n in looked_up(batch)] == [72, 96, 40, 128, 48]
    # The first request loads the shared pages; the others find them in the tree.
    assert [r.meta["kv_store_loaded_tokens"] for r in out] == [72, 96 - 32, 40 - 32, 128 - 32, 48 - 32]
    s = store_stats(reader)
    assert s["kv_store_exact_pages_hit_total"] == distinct_pages(batch, looked_up(batch)) == 32
    assert s["kv_store_loaded_tokens_total"] == 32 * P
    assert s["kv_store_exact_pages_missed_total"] == 0
    # Pages holding a prompt's last token were stored by the writer's write-through already.
    assert s["kv_store_exact_pages_written_total"] == 0
    assert s["kv_store_exact_bytes_read_total"] > 32 * P * reader.model_runner.token_to_kv_pool.bytes_per_token()
    assert reader.get_stats().num_cached_tokens_total == 72 + 96 + 40 + 128 + 48
    assert_pool_accounted(reader)


def test_loaded_prefixes_count_against_a_small_pool(llama, batch, no_store, tmp_path):
    """A pool of 24 pages cannot hold every loaded prefix at once: admission counts them as
    matched (locked) prefixes, and each request still gets exactly its no-store output."""
    store = dict(kv_store="file", kv_store_path=str(tmp_path / "kv"))
    run(scheduler(llama, **store), batch)
    reader = scheduler(llama, max_total_tokens=24 * P, **store)
    out = run(reader, batch)
    assert [r.output_ids for r in out] == no_store
    assert all(r.finished_reason == {"type": "length", "length": NEW} for r in out)
    s = store_stats(reader)
    assert sum(r.meta.get("kv_store_loaded_tokens", 0) for r in out) == s["kv_store_exact_pages_hit_total"] * P > 0
    assert s["kv_store_exact_pages_skipped_total"] > 0  # some stored pages waited for room
    assert_pool_accounted(reader)


# ---------------------------------------------------------------- vericache, both tiers


@pytest.mark.parametrize("schedule", ["lockstep", "auto"])  # auto: adaptive, which then folds every prompt
def test_vericache_fresh_instance_loads_both_tiers(llama, batch, no_store, tmp_path, schedule):
    vc = dict(kv_compressor="snapkv", kv_compression_ratio=4.0, speculative_algorithm="VERICACHE",
              vericache_schedule=schedule, speculative_num_draft_tokens="4", kv_store="file",
              kv_store_path=str(tmp_path / "kv"))
    writer = scheduler(llama, **vc)
    assert [r.output_ids for r in run(writer, batch)] == no_store
    w = store_stats(writer)
    assert w["kv_store_exact_pages_written_total"] == w["kv_store_compressed_pages_written_total"] == 34

    reader = scheduler(llama, **vc)
    out = run(reader, batch)
    assert [r.output_ids for r in out] == no_store
    assert [r.cached_tokens for r in out] == [72, 96, 40, 128, 48]
    assert [r.meta["kv_store_loaded_compressed_tokens"] for r in out] == [72, 64, 8, 96, 16]
    s = store_stats(reader)
    assert s["kv_store_exact_pages_hit_total"] == s["kv_store_compressed_pages_hit_total"] == 32
    assert s["kv_store_exact_pages_written_total"] == s["kv_store_compressed_pages_written_total"] == 0
    assert reader.tree_cache.comp_hit_rate() > 0
    check_invariants(reader.tree_cache)
    assert_pool_accounted(reader)
    assert reader.two_tier.pool.available_chunks() + reader.tree_cache.comp_evictable_chunks() \
        == reader.two_tier.pool.num_chunks


def test_lossy_fresh_instance_loads_both_tiers_and_emits_the_lossy_tokens(llama, batch, tmp_path):
    """Lossy output is not full-KV output, but loading its pages must not change it either."""
    lossy = dict(kv_compressor="snapkv", kv_compress_scope="page")  # with a KV store compressed pages are per page
    expected = [r.output_ids for r in run(scheduler(llama, **lossy), batch)]
    store = dict(kv_store="file", kv_store_path=str(tmp_path / "kv"), **lossy)
    run(scheduler(llama, **store), batch)
    reader = scheduler(llama, **store)
    out = run(reader, batch)
    assert [r.output_ids for r in out] == expected
    assert [r.cached_tokens for r in out] == [72, 96, 40, 128, 48]
    s = store_stats(reader)
    assert s["kv_store_exact_pages_hit_total"] == s["kv_store_compressed_pages_hit_total"] == 32
    assert reader.ready_message().server_info["kv_store"]["tiers"] == ["exact", "compressed"]


# ---------------------------------------------------------------- faults


def _redis_server_class():
    path = os.path.join(os.path.dirname(__file__), "storage", "conftest.py")
    spec = importlib.util.spec_from_file_location("storage_conftest", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if mod.REDIS_BIN is None:
        pytest.skip(mod.NO_REDIS)
    return mod.RedisServer


def test_redis_killed_mid_run_degrades_to_recompute(llama, batch, no_store, tmp_path, caplog):
    server = _redis_server_class()(str(tmp_path))
    server.start()
    try:
        store = dict(kv_store="redis", kv_store_url=server.url, kv_store_timeout=0.5)
        run(scheduler(llama, **store), batch)
        reader = scheduler(llama, max_running_requests=2, **store)
        caplog.set_level(logging.WARNING)
        out = drive(reader, requests(batch), after_first_step=server.kill)  # r0, r1 admitted, then the kill
    finally:
        server.stop()
    assert [o["output_ids"] for o in out] == no_store
    assert all(o["finished_reason"] == {"type": "length", "length": NEW} for o in out)
    # r0 and r1 loaded their prefixes; the rest find only the shared 4 pages, in the tree.
    assert [o["cached_tokens"] for o in out] == [72, 96, 32, 32, 32]
    s = store_stats(reader)
    assert s["kv_store_exact_pages_hit_total"] == 9 + 8
    assert s["kv_store_errors_total"] >= 1 and s["kv_store_down"] == 1
    assert "is unavailable" in caplog.text and "prefixes are recomputed" in caplog.text
    assert_pool_accounted(reader)


def test_corrupted_page_is_recomputed_from_there(llama, batch, no_store, tmp_path, caplog):
    store = dict(kv_store="file", kv_store_path=str(tmp_path / "kv"))
    writer = scheduler(llama, **store)
    run(writer, batch[:1])
    key = writer.prefix_store.exact.keys(batch[0])[5]
    page = tmp_path / "kv" / "data" / key[:2] / key
    data = bytearray(page.read_bytes())
    data[-100] ^= 0x01  # one bit of page 5's KV
    page.write_bytes(bytes(data))

    reader = scheduler(llama, **store)
    caplog.set_level(logging.WARNING)
    out = run(reader, batch[:1])
    assert out[0].output_ids == no_store[0]
    assert out[0].cached_tokens == 5 * P  # pages 0-4 loaded, 5.. recomputed
    s = store_stats(reader)
    assert (s["kv_store_exact_pages_hit_total"], s["kv_store_corrupt_pages_total"]) == (5, 1)
    assert s["kv_store_exact_pages_written_total"] == len(batch[0]) // P - 5  # page 5 on, stored again
    assert "unusable and was deleted" in caplog.text


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("kwargs, message", [
    (dict(kv_store="s3"), "--kv-store must be one of none, file, redis"),
    (dict(kv_store="redis", kv_store_url="http://localhost:6379"), "--kv-store-url must look like redis://"),
    (dict(kv_store="redis", kv_store_url="redis://host:99999/0"), "--kv-store-url 'redis://host:99999/0' is not"),
    (dict(kv_store="redis", kv_store_url="redis://host/zero"), "--kv-store-url must look like"),
    (dict(kv_store="file", kv_store_capacity="lots"), "--kv-store-capacity must be a size"),
    (dict(kv_store="file", kv_store_bandwidth="0"), "--kv-store-bandwidth must be > 0"),
    (dict(kv_store="file", kv_store_timeout=0.0), "--kv-store-timeout must be > 0"),
    (dict(kv_store="file", kv_store_tiers="compressed"), "needs a compressed tier"),
    (dict(kv_store="file", kv_store_tiers="all"), "--kv-store-tiers must be one of"),
    (dict(kv_store_path="/tmp/x"), "--kv-store-path is for --kv-store file"),
])
def test_bad_store_flags_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


def test_store_flag_defaults_and_tiers(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ServerArgs(kv_store="file").kv_store_path == str(tmp_path / "sglang-vericache" / "kv-store")
    assert default_kv_store_path() == str(tmp_path / "sglang-vericache" / "kv-store")
    assert ServerArgs().kv_store_tier_set == ()
    assert ServerArgs(kv_store="redis").kv_store_tier_set == ("exact",)
    assert ServerArgs(kv_store="redis", kv_compressor="kivi4").kv_store_tier_set == ("exact", "compressed")
    assert ServerArgs(kv_store="redis", kv_compressor="kivi4", kv_store_tiers="compressed").kv_store_tier_set \
        == ("compressed",)
