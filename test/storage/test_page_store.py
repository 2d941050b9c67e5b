"""PageStore: pages of the runtime's pools through a store and back, bit-identical, per tier."""

from __future__ import annotations

import logging
import os
import socket

import pytest
import torch

from sglang_vericache.compress import CompressorConfig, get_compressor
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool, compress_pages
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
from sglang_vericache.mem_cache.storage import create_store
from sglang_vericache.mem_cache.storage.file_backend import FileStore
from sglang_vericache.mem_cache.storage.hash_chain import StoreNamespace
from sglang_vericache.mem_cache.storage.page_store import (
    PageStore, read_compressed_pages, read_exact_pages, write_compressed_pages, write_exact_pages,
)
from sglang_vericache.mem_cache.storage.serialize import compressed_page_spec, exact_page_spec

P, H, D, LAYERS = 4, 2, 8, 2
TOKENS = list(range(1000, 1000 + 3 * P + 2))  # 3 whole pages and a partial one


def exact_pool(seed: int = 0, dtype=torch.bfloat16) -> MHATokenToKVPool:
    pool = MHATokenToKVPool(num_slots=8 * P, num_layers=LAYERS, num_kv_heads=H, head_dim=D, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    for l in range(LAYERS):
        pool.k_buffer[l].copy_(torch.randn(8 * P, H, D, generator=g))
        pool.v_buffer[l].copy_(torch.randn(8 * P, H, D, generator=g))
    return pool


def exact_store(root: str, dtype=torch.bfloat16) -> PageStore:
    ns = StoreNamespace("tiny@r1", "exact", P, str(dtype).removeprefix("torch."))
    return PageStore(FileStore(root), ns, exact_page_spec(LAYERS, P, H, D, dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_exact_pages_round_trip_into_other_slots_bit_identically(tmp_path):
    src, dst = exact_pool(0), exact_pool(1)
    ps = exact_store(str(tmp_path))
    keys = ps.keys(TOKENS)
    src_slots = torch.arange(2 * P, 5 * P)  # pages 2..4 of the source pool
    assert ps.put_pages(keys, read_exact_pages(src, src_slots, P)) == 3
    pages = ps.get_pages(keys)
    dst_slots = torch.cat([torch.arange(5 * P, 6 * P), torch.arange(P, 3 * P)])  # any page-aligned slots
    write_exact_pages(dst, dst_slots, pages)
    for l in range(LAYERS):
        assert torch.equal(bits(dst.k_buffer[l][dst_slots]), bits(src.k_buffer[l][src_slots]))
        assert torch.equal(bits(dst.v_buffer[l][dst_slots]), bits(src.v_buffer[l][src_slots]))


def test_write_through_stores_only_the_missing_pages_and_lookup_loads_the_stored_prefix(tmp_path):
    ps = exact_store(str(tmp_path))
    pool = exact_pool(0)
    keys = ps.keys(TOKENS[: 2 * P])
    ps.put_pages(keys, read_exact_pages(pool, torch.arange(P, 3 * P), P))
    longer = ps.keys(TOKENS)
    have = ps.match_prefix(longer)
    assert have == 2
    assert ps.put_pages(longer[have:], read_exact_pages(pool, torch.arange(3 * P, 4 * P), P)) == 1
    assert ps.store.stats.bytes_in == ps.store.size_bytes()  # no page was written twice
    assert len(ps.get_pages(longer)) == 3


@pytest.mark.parametrize("name", ["kivi2", "int8", "streamingllm", "fp8"])
def test_compressed_chunks_round_trip_into_other_ids_bit_identically(tmp_path, name):
    if name == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8")
    cfg = CompressorConfig(name, ratio=2, chunk_size=P, num_layers=LAYERS, num_kv_heads=H, num_q_heads=H,
                           head_dim=D, dtype=torch.bfloat16, num_sink_tokens=1, group_size=4)
    comp = get_compressor(name, cfg)
    src, dst = (CompressedKVPool(comp, LAYERS, num_chunks=6) for _ in range(2))
    ids = src.alloc(3)
    compress_pages(comp, exact_pool(0), src, torch.arange(P, 4 * P), ids, positions=torch.arange(3 * P))
    ns = StoreNamespace("tiny@r1", "compressed", P, "bfloat16", compressor=name, ratio=2.0)
    ps = PageStore(FileStore(str(tmp_path)), ns, compressed_page_spec(src.layouts))
    keys = ps.keys(TOKENS)
    assert ps.put_pages(keys, read_compressed_pages(src, ids)) == 3
    new_ids = torch.tensor([5, 2, 4])
    write_compressed_pages(dst, new_ids, ps.get_pages(keys))
    for l in range(LAYERS):
        a, b = src.read(l, ids).tensors, dst.read(l, new_ids).tensors
        assert a.keys() == b.keys()
        assert all(torch.equal(bits(a[n]), bits(b[n])) for n in a)


def test_a_corrupted_page_ends_the_prefix_is_deleted_and_logged(tmp_path, caplog):
    ps = exact_store(str(tmp_path))
    keys = ps.keys(TOKENS)
    ps.put_pages(keys, read_exact_pages(exact_pool(0), torch.arange(P, 4 * P), P))
    path = os.path.join(str(tmp_path), "data", keys[1][:2], keys[1])
    blob = bytearray(open(path, "rb").read())
    blob[-3] ^= 0xFF
    open(path, "wb").write(bytes(blob))
    with caplog.at_level(logging.WARNING):
        assert len(ps.get_pages(keys)) == 1
    assert "CRC32" in caplog.text and keys[1] in caplog.text
    assert ps.match_prefix(keys) == 1 and ps.corrupt_pages == 1


def test_a_page_of_another_spec_is_not_loaded(tmp_path, caplog):
    ps = exact_store(str(tmp_path))
    keys = ps.keys(TOKENS)
    ps.put_pages(keys, read_exact_pages(exact_pool(0), torch.arange(P, 4 * P), P))
    wrong = PageStore(ps.store, ps.namespace, exact_page_spec(LAYERS, P, H, D // 2, torch.bfloat16))
    with caplog.at_level(logging.WARNING):
        assert wrong.get_pages(keys) == []
    assert "expected k:bfloat16[4, 2, 4]" in caplog.text


def test_put_pages_rejects_a_payload_off_spec_before_writing(tmp_path):
    ps = exact_store(str(tmp_path))
    keys = ps.keys(TOKENS)
    pages = read_exact_pages(exact_pool(0, dtype=torch.float32), torch.arange(P, 4 * P), P)
    with pytest.raises(ValueError, match="expected k:bfloat16"):
        ps.put_pages(keys, pages)
    assert ps.match_prefix(keys) == 0


def test_tiers_in_one_store_never_see_each_other(tmp_path):
    exact = exact_store(str(tmp_path))
    exact.put_pages(exact.keys(TOKENS), read_exact_pages(exact_pool(0), torch.arange(P, 4 * P), P))
    ns = StoreNamespace("tiny@r1", "compressed", P, "bfloat16", compressor="kivi2", ratio=2.0)
    comp = PageStore(exact.store, ns, exact.spec)
    assert comp.match_prefix(comp.keys(TOKENS)) == 0


def test_create_store_builds_the_flagged_stack(tmp_path):
    assert create_store("none") is None
    with pytest.raises(ValueError, match="--kv-store-path"):
        create_store("file")
    s = create_store("file", path=str(tmp_path), capacity="1KB", bandwidth="1GB")
    assert repr(s).startswith("ThrottledStore(DegradingStore(FileStore(")
    assert s.capacity_bytes == 1000 and s.put("a", b"x" * 1001) is False


def test_create_store_redis_that_is_down_serves_misses(caplog):
    with socket.socket() as sock:  # a loopback port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = create_store("redis", url=f"redis://127.0.0.1:{port}/0", timeout_s=0.2)
    with caplog.at_level(logging.WARNING):
        assert s.put("a", b"x") is False
        assert s.get(["a"]) == [] and s.match_prefix(["a"]) == 0
    assert caplog.text.count("is unavailable") == 1
