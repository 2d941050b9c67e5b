"""sgl_kernel_ext.cpu_attention.fixed_chunk_attention: the batch-invariant CPU attention kernel.

It matches the torch reference to float32 rounding, and a query row's output is bitwise the same
whatever else is computed with it: other requests, other query rows, padding columns, masked keys
between its keys, the number of threads.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_ext.cpu_attention import fixed_chunk_attention, fixed_chunk_attention_ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def case(dtype, b=3, lq=5, h=4, hkv=2, d=64, s=150, n=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, d, generator=g).to(dtype)
    k = torch.randn(n, hkv, d, generator=g).to(dtype)
    v = torch.randn(n, hkv, d, generator=g).to(dtype)
    index = torch.randint(0, n, (b, s), generator=g)
    allowed = torch.rand(b, lq, s, generator=g) < 0.7
    return q, k, v, index, allowed


@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_the_reference(dtype):
    q, k, v, index, allowed = case(dtype)
    out = fixed_chunk_attention(q, k, v, index, allowed, 0.125)
    ref = fixed_chunk_attention_ref(q, k, v, index, allowed, 0.125)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 4, 64)
    assert (out - ref).abs().max().item() < 2e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_is_the_same_alone_padded_and_among_others(dtype):
    q, k, v, index, allowed = case(dtype, s=300)
    out = fixed_chunk_attention(q, k, v, index, allowed, 0.125)
    for b, i in [(0, 0), (1, 2), (2, 4)]:
        cols = allowed[b, i].nonzero().squeeze(1)
        # alone, its keys after 7 padding columns and with masked junk keys between them
        width = 2 * len(cols) + 20
        idx = torch.randint(0, len(k), (1, width))
        mask = torch.zeros(1, 1, width, dtype=torch.bool)
        at = 7 + 2 * torch.arange(len(cols))
        idx[0, at], mask[0, 0, at] = index[b, cols], True
        alone = fixed_chunk_attention(q[b : b + 1, i : i + 1], k, v, idx, mask, 0.125)
        assert torch.equal(alone[0, 0], out[b, i])
        # as the 20th of 40 query rows of one request (another query block)
        many = q[b : b + 1, i : i + 1].expand(1, 40, *q.shape[2:]).contiguous()
        many_mask = mask.expand(1, 40, width).clone()
        many_mask[0, :19] = torch.rand(19, width) < 0.5
        assert torch.equal(fixed_chunk_attention(many, k, v, idx, many_mask, 0.125)[0, 19], out[b, i])


def test_causal_rows_equal_decode_rows_and_threads_do_not_matter():
    """A verify pass (9 causal rows over a 1000-key prefix) equals 9 one-row decode steps bitwise."""
    q, k, v, _, _ = case(torch.bfloat16, b=1, lq=9, n=1009)
    index = torch.arange(1009).view(1, 1009)
    causal = torch.arange(1009)[None, None, :] <= 1000 + torch.arange(9)[None, :, None]
    verify = fixed_chunk_attention(q, k, v, index, causal, 0.125)
    for i in range(9):
        step = fixed_chunk_attention(q[:, i : i + 1], k, v, index[:, : 1001 + i], None, 0.125)
        assert torch.equal(step[0, 0], verify[0, i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fixed_chunk_attention(q, k, v, index, causal, 0.125), verify)
    finally:
        torch.set_num_threads(threads)


def test_a_row_with_no_visible_key_is_zero_and_bad_shapes_are_refused():
    q, k, v, index, allowed = case(torch.float32)
    allowed[0, 0] = False
    assert torch.equal(fixed_chunk_attention(q, k, v, index, allowed, 0.1)[0, 0], torch.zeros(4, 64))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        fixed_chunk_attention(q, k[:, :, :32].contiguous(), v, index, allowed, 0.1)
    with pytest.raises(RuntimeError, match="allowed must be"):
        fixed_chunk_attention(q, k, v, index, allowed[:, :, :10], 0.1)


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(tmp_path):
    """torch.utils.cpp_extension waits forever on its lock: one older than STALE_LOCK_S is cleared."""
    import os
    import time

    from sgl_kernel_ext import cpu_attention

    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    old = time.time() - cpu_attention.STALE_LOCK_S - 1
    os.utime(stale, (old, old))
    cpu_attention._clear_stale_lock(stale)
    cpu_attention._clear_stale_lock(fresh)
    cpu_attention._clear_stale_lock(tmp_path / "absent")
    assert not stale.exists() and fresh.exists()


def test_a_built_library_loads_without_the_build_lock(tmp_path):
    """A library already built under its name is loaded directly; a cut-short one is removed."""
    from sgl_kernel_ext import cpu_attention

    assert cpu_attention._load_built(tmp_path / "absent.so") is False
    broken = tmp_path / "broken.so"
    broken.write_bytes(b"not an ELF file")
    assert cpu_attention._load_built(broken) is False and not broken.exists()


def test_an_edited_header_beside_or_below_the_source_renames_the_build(tmp_path):
    """The build's name hashes csrc/*.h and csrc/draft/*.h: editing a header the kernel includes rebuilds it."""
    from sgl_kernel_ext import cpu_attention

    source = tmp_path / "kernel.cpp"
    source.write_text('#include "draft/part.h"\n')
    (tmp_path / "draft").mkdir()
    (tmp_path / "common.h").write_text("// common\n")
    (tmp_path / "draft" / "part.h").write_text("// part\n")
    names = [cpu_attention.build_name(source, "k")]
    (tmp_path / "draft" / "part.h").write_text("// part, edited\n")
    names.append(cpu_attention.build_name(source, "k"))
    (tmp_path / "common.h").write_text("// common, edited\n")
    names.append(cpu_attention.build_name(source, "k"))
    assert len(set(names)) == 3 and all(n.startswith("k_") for n in names)
    assert cpu_attention.build_name(source, "k") == names[-1]  # unchanged files: the same name


@pytest.mark.parametrize("dtype", DTYPES)
def test_start_equals_the_window_as_a_mask(dtype):
    """A sliding window given as each query's first visible key (start) gives bitwise the result of the
    same keys masked out, with or without a mask beside it, and a decode row alone agrees with its verify row."""
    q, k, v, index, _ = case(dtype, b=3, lq=6, s=300)
    pos = torch.tensor([294, 200, 150])[:, None] + torch.arange(6)[None, :]  # query positions, keys at 0..S-1
    window = 70
    start = (pos - window + 1).clamp_min(0)
    j = torch.arange(300)[None, None, :]
    causal = j <= pos[:, :, None]
    windowed = causal & (j >= start[:, :, None])
    want = fixed_chunk_attention(q, k, v, index, windowed, 0.125)
    assert torch.equal(fixed_chunk_attention(q, k, v, index, windowed, 0.125, start), want)
    assert torch.equal(fixed_chunk_attention(q, k, v, index, causal, 0.125, start), want)
    ref = fixed_chunk_attention_ref(q, k, v, index, windowed, 0.125)
    assert torch.allclose(want, ref, atol=1e-2 if dtype != torch.float32 else 1e-5)
    for b in range(3):  # decode: one query over exactly its keys, no mask, the window as start
        p = int(pos[b, 0])
        alone = fixed_chunk_attention(q[b : b + 1, :1], k, v, index[b : b + 1, : p + 1], None, 0.125,
                                      start[b : b + 1, :1])
        assert torch.equal(alone[0, 0], want[b, 0])
