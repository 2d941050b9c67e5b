"""Builders of paged kernel inputs shared by the kernel tests (tiny shapes, NaN in unused slots)."""

from __future__ import annotations

import pytest
import torch

TRITON_MISSING = "triton is not installed: the sgl-kernel-ext kernels cannot run"
pytest.importorskip("triton", reason=TRITON_MISSING)  # skips the importing test module

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs an NVIDIA GPU (CUDA)")


def paged_kv(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_pages: int = 2,
):
    """Random exact KV in shuffled pages (page 0 = padding), SGLang's req_to_token layout.

    -> k_buffer, v_buffer [num_slots, Hkv, D]; req_to_token [B + 1, max_len] (row b + 1 belongs to
    request b, row 0 unused, so req_pool_indices is not the identity); req_pool_indices [B].
    Slots that hold no token (the rest of a partly filled last page, unused pages) are NaN: a
    kernel that reads past a request's length produces NaN.
    """
    pages = [(n + page_size - 1) // page_size for n in seq_lens]
    num_pages = sum(pages) + extra_pages
    order = (torch.randperm(num_pages, generator=gen) + 1).tolist()  # page ids 1..num_pages
    num_slots = (num_pages + 1) * page_size
    shape = (num_slots, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=dtype)
    v = torch.full(shape, float("nan"), dtype=dtype)
    k[:page_size] = 0  # the padding page is finite (padded table entries point at slot 0)
    v[:page_size] = 0
    max_len = max(seq_lens) + page_size
    req_to_token = torch.zeros((len(seq_lens) + 1, max_len), dtype=torch.int64)
    for b, n in enumerate(seq_lens):
        ids = torch.tensor([order.pop() for _ in range(pages[b])], dtype=torch.int64)
        slots = (ids[:, None] * page_size + torch.arange(page_size)).flatten()[:n]
        req_to_token[b + 1, :n] = slots
        k[slots] = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
        v[slots] = torch.randn((n, num_kv_heads, head_dim), generator=gen).to(dtype)
    req_pool_indices = torch.arange(1, len(seq_lens) + 1, dtype=torch.int64)
    return k, v, req_to_token, req_pool_indices


def to_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def compressed_kv(
    compressor, seq_lens: list[int], num_chunks: list[int], gen: torch.Generator, nan_unused=True
):
    """Exact paged KV (page size = chunk size) whose first num_chunks[b] pages of request b are also
    compressed, by compressor.compress, into a CompressedKVPool (layer 0) under shuffled chunk ids.

    -> dict: k, v, req_to_token, req_pool_indices (exact tier, see paged_kv); pool (the
    CompressedKVPool); chunk_ids [B, C_max] (0 = padding); num_chunks, tail_starts, tail_lens [B].
    """
    from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool

    c = compressor.config
    t = c.chunk_size
    k, v, r2t, rpi = paged_kv(seq_lens, t, c.num_kv_heads, c.head_dim, c.dtype, gen)
    total = sum(num_chunks)
    pool = CompressedKVPool(compressor, num_layers=1, num_chunks=total + 2)
    if nan_unused and compressor.layout(0).kind == "token_drop":
        for buf in pool.buffers[0].values():
            if buf.is_floating_point():
                buf.fill_(float("nan"))
    ids = torch.randperm(total + 2, generator=gen)[:total] + 1
    chunk_ids = torch.zeros((len(seq_lens), max(1, max(num_chunks))), dtype=torch.int64)
    pages, at = [], 0
    for b, n in enumerate(num_chunks):
        assert n * t <= seq_lens[b]
        chunk_ids[b, :n] = ids[at : at + n]
        pages.append(r2t[b + 1, : n * t])
        at += n
    if total:
        slots = torch.cat(pages)
        extra = {}
        if getattr(compressor, "takes_kept_rows_positions", False) or hasattr(compressor, "stage"):
            # pre-RoPE quantizers (kvquant, rotatekv; alone or after a dropper) need the tokens' positions
            extra["positions"] = torch.cat([torch.arange(n * t) for n in num_chunks]).view(total, t)
        chunk = compressor.compress(
            0, k[slots].unflatten(0, (total, t)), v[slots].unflatten(0, (total, t)), **extra
        )
        pool.write(0, ids, chunk)
    starts = torch.tensor(num_chunks) * t
    return {
        "k": k,
        "v": v,
        "req_to_token": r2t,
        "req_pool_indices": rpi,
        "pool": pool,
        "chunk_ids": chunk_ids,
        "num_chunks": torch.tensor(num_chunks),
        "tail_starts": starts,
        "tail_lens": torch.tensor(seq_lens) - starts,
    }


def make_compressor(
    name: str, chunk_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, **options
):
    from sglang_vericache.compress import CompressorConfig, get_compressor

    cfg = CompressorConfig(
        name,
        ratio=options.pop("ratio", 2.0),
        chunk_size=chunk_size,
        num_layers=1,
        num_kv_heads=num_kv_heads,
        num_q_heads=num_kv_heads * group,
        head_dim=head_dim,
        dtype=dtype,
        **options,
    )
    return get_compressor(name, cfg)
