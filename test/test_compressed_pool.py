"""Specification of mem_cache/compressed_pool.py: the compressed tier's chunk pool and compress_pages."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress import CompressorConfig, get_compressor
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool, compress_pages
from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool

T, H, D, LAYERS = 4, 2, 4, 2  # chunk (= page) size, KV heads, head dim, layers


def make_compressor(name: str, **kw):
    args = dict(ratio=2, chunk_size=T, num_layers=LAYERS, num_kv_heads=H, num_q_heads=H, head_dim=D,
                dtype=torch.float32, num_sink_tokens=1, group_size=4, window_size=1, kernel_size=1)
    return get_compressor(name, CompressorConfig(name, **(args | kw)))


def make_pool(name: str = "streamingllm", num_chunks: int = 4) -> CompressedKVPool:
    return CompressedKVPool(make_compressor(name), num_layers=LAYERS, num_chunks=num_chunks)


def random_kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, H, D, generator=g), torch.randn(n, T, H, D, generator=g)


def chunks(pool: CompressedKVPool, layer: int, n: int, seed: int = 0):
    k, v = random_kv(n, seed)
    pos = torch.arange(n * T).reshape(n, T)
    return pool.compressor.compress(layer, k, v, positions=pos)


# ----------------------------------------------------------------- buffers and sizes


@pytest.mark.parametrize("name", ["streamingllm", "kivi2"])
def test_buffers_follow_each_layers_layout_plus_a_padding_chunk(name):
    pool = make_pool(name, num_chunks=4)
    for layer in range(LAYERS):
        specs = pool.compressor.layout(layer).tensors
        assert list(pool.buffers[layer]) == [s.name for s in specs]
        for s in specs:
            buf = pool.buffers[layer][s.name]
            assert (tuple(buf.shape), buf.dtype) == ((5, *s.shape), s.dtype)


def test_bytes_per_chunk_sums_the_layouts_over_layers():
    # streamingllm, 2 kept rows: k, v float32 2*2*4*4 = 64 bytes each, idx int16 2*2*2 = 8 -> 136 per layer
    assert make_pool("streamingllm").bytes_per_chunk() == 2 * 136
    # kivi2, T=4, D=4, G=4: codes 4*2*1 uint8 = 8 (k and v); k scale/zero 1*2*4 f16 = 16 each;
    # v scale/zero 4*2*1 f16 = 16 each -> 80 per layer
    assert make_pool("kivi2").bytes_per_chunk() == 2 * 80
    assert make_pool("kivi2", num_chunks=4).size_bytes() == 5 * 2 * 80  # padding chunk included


def test_chunks_for_budget_floors_budget_over_bytes_per_chunk():
    comp = make_compressor("kivi2")
    assert CompressedKVPool.chunks_for_budget(comp, LAYERS, 160 * 7 + 159) == 7


# ----------------------------------------------------------------- allocator


def test_alloc_hands_out_lowest_ids_first_and_never_the_padding_id():
    pool = make_pool(num_chunks=4)
    assert pool.available_chunks() == 4
    ids = pool.alloc(3)
    assert (ids.tolist(), ids.dtype) == ([1, 2, 3], torch.int64)
    assert pool.available_chunks() == 1


def test_alloc_beyond_free_returns_none_and_takes_nothing():
    pool = make_pool(num_chunks=4)
    pool.alloc(3)
    assert pool.alloc(2) is None
    assert pool.available_chunks() == 1
    assert pool.alloc(1).tolist() == [4]


def test_freed_ids_go_to_the_back_and_come_back_later():
    pool = make_pool(num_chunks=4)
    a = pool.alloc(2)  # 1, 2
    pool.free(a[:1])
    assert pool.alloc(3).tolist() == [3, 4, 1]
    pool.free(torch.tensor([2, 3, 4, 1]))
    assert pool.available_chunks() == 4
    assert sorted(pool.alloc(4).tolist()) == [1, 2, 3, 4]  # every id exactly once: no leak


def test_double_free_and_padding_free_are_rejected():
    pool = make_pool(num_chunks=4)
    ids = pool.alloc(2)
    pool.free(ids)
    with pytest.raises(AssertionError):
        pool.free(ids[:1])
    with pytest.raises(AssertionError):
        pool.free(torch.tensor([0]))
    assert pool.available_chunks() == 4


def test_clear_frees_every_id():
    pool = make_pool(num_chunks=4)
    pool.alloc(4)
    pool.clear()
    assert pool.alloc(4).tolist() == [1, 2, 3, 4]


# ----------------------------------------------------------------- data


@pytest.mark.parametrize("name", ["streamingllm", "kivi2"])
def test_write_then_read_round_trips_exactly_in_the_order_of_ids(name):
    pool = make_pool(name)
    for layer in range(LAYERS):
        chunk = chunks(pool, layer, 2, seed=layer)
        pool.write(layer, torch.tensor([3, 1]), chunk)
        back = pool.read(layer, torch.tensor([1, 3]))
        for spec in pool.compressor.layout(layer).tensors:
            assert torch.equal(back[spec.name], chunk[spec.name].flip(0))


def test_write_of_one_layer_leaves_the_other_layer_and_other_ids_untouched():
    pool = make_pool("streamingllm")
    pool.write(0, torch.tensor([2]), chunks(pool, 0, 1))
    assert pool.read(1, torch.tensor([2]))["k"].abs().sum() == 0
    assert pool.read(0, torch.tensor([1, 3]))["k"].abs().sum() == 0


def test_write_rejects_a_batch_of_the_wrong_size():
    pool = make_pool("streamingllm")
    with pytest.raises(AssertionError):
        pool.write(0, torch.tensor([1, 2, 3]), chunks(pool, 0, 2))


@pytest.mark.parametrize("name", ["streamingllm", "kivi2"])
def test_decompress_concatenates_the_compressors_rows_chunk_by_chunk(name):
    pool = make_pool(name)
    chunk = chunks(pool, 1, 2, seed=7)
    pool.write(1, torch.tensor([4, 2]), chunk)
    k, v = pool.decompress(1, torch.tensor([2, 4]))
    ref_k, ref_v = pool.compressor.decompress(1, chunk)  # [2, rows, H, D] for ids 4, 2
    rows = pool.compressor.layout(1).rows
    assert (tuple(k.shape), k.dtype) == ((2 * rows, H, D), torch.float32)
    assert torch.equal(k, torch.cat([ref_k[1], ref_k[0]]))
    assert torch.equal(v, torch.cat([ref_v[1], ref_v[0]]))


def test_decompress_of_no_ids_is_empty():
    k, v = make_pool("kivi2").decompress(0, torch.empty(0, dtype=torch.int64))
    assert (tuple(k.shape), tuple(v.shape)) == ((0, H, D), (0, H, D))


# ----------------------------------------------------------------- compress_pages


def exact_pool(num_pages: int = 4) -> MHATokenToKVPool:
    """An exact pool whose K at (layer, slot, head, dim) is a distinct value (V is its negation)."""
    kv = MHATokenToKVPool((num_pages + 1) * T, LAYERS, H, D, torch.float32)
    for layer in range(LAYERS):
        k = torch.arange(kv.num_slots * H * D, dtype=torch.float32).reshape(kv.num_slots, H, D) + 1000 * layer
        kv.set_kv_buffer(layer, torch.arange(kv.num_slots), k / 100, -k / 100)
    return kv


def test_compress_pages_streamingllm_keeps_sink_and_latest_of_each_page():
    kv, pool = exact_pool(), make_pool("streamingllm")
    slots = torch.tensor([8, 9, 10, 11, 4, 5, 6, 7])  # page 2 holds positions 0..3, page 1 positions 4..7
    compress_pages(pool.compressor, kv, pool, slots, torch.tensor([1, 2]), positions=torch.arange(8))
    for layer in range(LAYERS):
        got = pool.read(layer, torch.tensor([1, 2]))
        # one sink (position 0) + latest token in chunk 1; two latest tokens in chunk 2; both heads
        assert got["idx"].tolist() == [[[0, 0], [3, 3]], [[2, 2], [3, 3]]]
        kept_slots = torch.tensor([[8, 11], [6, 7]])
        assert torch.equal(got["k"], kv.get_key_buffer(layer)[kept_slots])
        assert torch.equal(got["v"], kv.get_value_buffer(layer)[kept_slots])


@pytest.mark.parametrize("name", ["streamingllm", "kivi2"])
def test_compress_pages_gives_the_bytes_of_calling_the_compressor_directly(name):
    kv, pool = exact_pool(), make_pool(name)
    slots = torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])
    positions = torch.arange(8, 16)
    compress_pages(pool.compressor, kv, pool, slots, torch.tensor([3, 1]), positions=positions)
    for layer in range(LAYERS):
        k = kv.get_key_buffer(layer)[slots].reshape(2, T, H, D)
        v = kv.get_value_buffer(layer)[slots].reshape(2, T, H, D)
        ref = pool.compressor.compress(layer, k, v, positions=positions.reshape(2, T))
        got = pool.read(layer, torch.tensor([3, 1]))
        for spec in pool.compressor.layout(layer).tensors:
            assert torch.equal(got[spec.name], ref[spec.name])


def test_compress_pages_with_a_query_based_method_needs_each_layers_window_queries():
    kv, pool = exact_pool(), make_pool("snapkv")
    slots, ids = torch.arange(4, 12), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="needs queries"):
        compress_pages(pool.compressor, kv, pool, slots, ids)
    w = pool.compressor.query_window(0)
    g = torch.Generator().manual_seed(3)
    queries = [torch.randn(2, w, H, D, generator=g) for _ in range(LAYERS)]
    compress_pages(pool.compressor, kv, pool, slots, ids, queries=queries)
    for layer in range(LAYERS):
        k = kv.get_key_buffer(layer)[slots].reshape(2, T, H, D)
        v = kv.get_value_buffer(layer)[slots].reshape(2, T, H, D)
        ref = pool.compressor.compress(layer, k, v, q=queries[layer])
        got = pool.read(layer, ids)
        assert all(torch.equal(got[s.name], ref[s.name]) for s in pool.compressor.layout(layer).tensors)
