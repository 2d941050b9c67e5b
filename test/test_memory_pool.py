"""Specification of mem_cache/memory_pool.py: the paged slot allocator and the pools."""

from __future__ import annotations

import torch

from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool, PagedTokenAllocator, ReqToTokenPool


def slots(t: torch.Tensor) -> list[int]:
    return t.tolist()


# ----------------------------------------------------------------- PagedTokenAllocator


def test_allocator_capacity_excludes_padding_page():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    assert alloc.size == 16
    assert alloc.available_size() == 16


def test_alloc_extend_from_empty_takes_lowest_pages_first():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    out = alloc.alloc_extend(last_slot=0, cur_len=0, num_new=6)
    assert out.dtype == torch.int64
    assert slots(out) == [4, 5, 6, 7, 8, 9]  # pages 1 and 2; page 0 is padding
    assert alloc.available_size() == 8


def test_alloc_extend_continues_inside_last_page_then_new_pages():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    alloc.alloc_extend(last_slot=0, cur_len=0, num_new=6)  # slots 4..9, last page 2 half used
    out = alloc.alloc_extend(last_slot=9, cur_len=6, num_new=3)
    assert slots(out) == [10, 11, 12]  # 2 left in page 2, then page 3
    assert alloc.available_size() == 4


def test_alloc_extend_within_last_page_takes_no_new_page():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    alloc.alloc_extend(last_slot=0, cur_len=0, num_new=1)  # slot 4
    out = alloc.alloc_extend(last_slot=4, cur_len=1, num_new=2)
    assert slots(out) == [5, 6]
    assert alloc.available_size() == 12


def test_alloc_extend_at_page_boundary_starts_new_page():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    alloc.alloc_extend(last_slot=0, cur_len=0, num_new=4)  # page 1 full
    out = alloc.alloc_extend(last_slot=7, cur_len=4, num_new=1)
    assert slots(out) == [8]
    assert alloc.available_size() == 8


def test_alloc_extend_zero_tokens_is_empty():
    alloc = PagedTokenAllocator(num_pages=2, page_size=4)
    out = alloc.alloc_extend(last_slot=0, cur_len=0, num_new=0)
    assert slots(out) == []
    assert alloc.available_size() == 8


def test_alloc_extend_page_size_one():
    alloc = PagedTokenAllocator(num_pages=5, page_size=1)
    assert slots(alloc.alloc_extend(last_slot=0, cur_len=0, num_new=3)) == [1, 2, 3]
    assert slots(alloc.alloc_extend(last_slot=3, cur_len=3, num_new=1)) == [4]
    assert alloc.available_size() == 1


def test_pages_needed():
    alloc = PagedTokenAllocator(num_pages=8, page_size=4)
    assert alloc.pages_needed(cur_len=0, num_new=0) == 0
    assert alloc.pages_needed(cur_len=0, num_new=1) == 1
    assert alloc.pages_needed(cur_len=0, num_new=4) == 1
    assert alloc.pages_needed(cur_len=0, num_new=5) == 2
    assert alloc.pages_needed(cur_len=6, num_new=2) == 0  # fits in the last page
    assert alloc.pages_needed(cur_len=6, num_new=3) == 1
    assert alloc.pages_needed(cur_len=4, num_new=1) == 1
    assert alloc.pages_needed(cur_len=6, num_new=11) == 3


def test_pages_needed_agrees_with_alloc_extend():
    alloc = PagedTokenAllocator(num_pages=8, page_size=4)
    alloc.alloc_extend(last_slot=0, cur_len=0, num_new=6)  # slots 4..9
    before = alloc.available_size()
    need = alloc.pages_needed(cur_len=6, num_new=11)
    alloc.alloc_extend(last_slot=9, cur_len=6, num_new=11)
    assert before - alloc.available_size() == need * 4


def test_running_out_returns_none_without_leaking():
    alloc = PagedTokenAllocator(num_pages=2, page_size=4)
    alloc.alloc_extend(last_slot=0, cur_len=0, num_new=3)  # page 1: slots 4,5,6
    assert alloc.alloc_extend(last_slot=6, cur_len=3, num_new=10) is None  # needs 3 more pages
    assert alloc.available_size() == 4
    # What remains is still allocatable: the free slot in page 1, then page 2.
    assert slots(alloc.alloc_extend(last_slot=6, cur_len=3, num_new=5)) == [7, 8, 9, 10, 11]
    assert alloc.available_size() == 0
    assert alloc.alloc_extend(last_slot=11, cur_len=8, num_new=1) is None


def test_free_returns_whole_pages():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    out = alloc.alloc_extend(last_slot=0, cur_len=0, num_new=6)  # pages 1, 2
    alloc.free(out)
    assert alloc.available_size() == 16
    assert sorted(alloc.free_pages) == [1, 2, 3, 4]


def test_free_of_a_page_aligned_suffix_frees_only_its_pages():
    alloc = PagedTokenAllocator(num_pages=4, page_size=4)
    out = alloc.alloc_extend(last_slot=0, cur_len=0, num_new=10)  # pages 1, 2, 3
    alloc.free(out[4:])  # pages 2 and 3 (page 3 partly used)
    assert sorted(alloc.free_pages) == [2, 3, 4]
    assert alloc.available_size() == 12


def test_freed_pages_are_reused():
    alloc = PagedTokenAllocator(num_pages=2, page_size=4)
    out = alloc.alloc_extend(last_slot=0, cur_len=0, num_new=8)
    alloc.free(out[:4])  # page 1
    assert slots(alloc.alloc_extend(last_slot=0, cur_len=0, num_new=2)) == [4, 5]


def test_free_empty_is_noop():
    alloc = PagedTokenAllocator(num_pages=2, page_size=4)
    alloc.free(torch.empty(0, dtype=torch.int64))
    assert alloc.available_size() == 8


def test_clear_restores_all_pages():
    alloc = PagedTokenAllocator(num_pages=3, page_size=2)
    alloc.alloc_extend(last_slot=0, cur_len=0, num_new=5)
    alloc.clear()
    assert alloc.available_size() == 6
    assert slots(alloc.alloc_extend(last_slot=0, cur_len=0, num_new=1)) == [2]


# ----------------------------------------------------------------- MHATokenToKVPool


def test_kv_pool_shapes_and_set_get():
    pool = MHATokenToKVPool(num_slots=8, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    assert pool.get_key_buffer(0).shape == (8, 3, 4)
    assert pool.get_value_buffer(1).shape == (8, 3, 4)
    loc = torch.tensor([2, 5])
    k = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    v = -k
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc], k)
    assert torch.equal(pool.get_value_buffer(1)[loc], v)
    assert torch.count_nonzero(pool.get_key_buffer(0)) == 0  # other layers untouched
    assert torch.count_nonzero(pool.get_key_buffer(1)[[0, 1, 3, 4, 6, 7]]) == 0  # other slots untouched


def test_kv_pool_casts_to_its_dtype():
    pool = MHATokenToKVPool(num_slots=4, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.bfloat16)
    pool.set_kv_buffer(0, torch.tensor([1]), torch.ones(1, 1, 2, dtype=torch.float32), torch.zeros(1, 1, 2))
    assert pool.get_key_buffer(0).dtype == torch.bfloat16
    assert pool.get_key_buffer(0)[1].tolist() == [[1.0, 1.0]]


def test_bytes_per_token():
    f32 = MHATokenToKVPool(num_slots=4, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32)
    assert f32.bytes_per_token() == 2 * 3 * (4 + 4) * 4  # 192
    bf16 = MHATokenToKVPool(num_slots=4, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.bfloat16)
    assert bf16.bytes_per_token() == 96
    mla_like = MHATokenToKVPool(
        num_slots=4, num_layers=2, num_kv_heads=3, head_dim=4, dtype=torch.float32, v_head_dim=2
    )
    assert mla_like.bytes_per_token() == 2 * 3 * (4 + 2) * 4  # 144
    assert mla_like.get_value_buffer(0).shape == (4, 3, 2)


# ----------------------------------------------------------------- ReqToTokenPool


def test_req_to_token_pool_alloc_until_empty_then_free():
    pool = ReqToTokenPool(size=3, max_context_len=8)
    got = [pool.alloc(), pool.alloc(), pool.alloc()]
    assert sorted(got) == [0, 1, 2]
    assert pool.available_size() == 0
    assert pool.alloc() is None
    pool.free(got[1])
    assert pool.available_size() == 1
    assert pool.alloc() == got[1]


def test_req_to_token_pool_write():
    pool = ReqToTokenPool(size=2, max_context_len=8)
    idx = pool.alloc()
    pool.write(idx, 2, torch.tensor([9, 10, 11]))
    assert pool.req_to_token[idx].tolist() == [0, 0, 9, 10, 11, 0, 0, 0]
    assert pool.req_to_token.dtype == torch.int64
    assert pool.req_to_token[1 - idx].tolist() == [0] * 8
