"""The draft-pool rows part (VeriCache's third context part) of the compressed decode kernels:
context = [compressed rows | exact tail | draft_table[b, :draft_lens[b]] of the draft pool]."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import compressed_kv, make_compressor, to_device
from sgl_kernel_ext.decode_quantized import quantized_decode_attention
from sgl_kernel_ext.decode_token_drop import token_drop_decode_attention
from sgl_kernel_ext.ref import compressed_decode_ref

from sglang_vericache.compress.base import CompressedChunk

ATOL_F32 = 2e-5  # as the other decode kernels: online softmax + split merge vs one softmax


def _draft_pool(draft_lens: list[int], hkv: int, d: int, gen: torch.Generator):
    """Draft buffers with NaN in every slot no request names (a stray read shows up), and a padded
    table whose padding entries point at NaN slots too (they must not be read either)."""
    n = sum(draft_lens)
    k = torch.full((n + 4, hkv, d), float("nan"))
    v = torch.full((n + 4, hkv, d), float("nan"))
    slots = (torch.randperm(n, generator=gen) + 2).tolist()  # slots 0, 1 and the last two stay NaN
    table = torch.ones((len(draft_lens), max(draft_lens)), dtype=torch.int64)
    for b, m in enumerate(draft_lens):
        own = torch.tensor([slots.pop() for _ in range(m)], dtype=torch.int64)
        table[b, :m] = own
        k[own] = torch.randn((m, hkv, d), generator=gen)
        v[own] = torch.randn((m, hkv, d), generator=gen)
    return k, v, table, torch.tensor(draft_lens)


def _args(x):
    return (x["chunk_ids"], x["num_chunks"], x["k"], x["v"], x["req_to_token"], x["req_pool_indices"],
            x["tail_starts"], x["tail_lens"])


@pytest.mark.parametrize("splits", [1, 2])
def test_token_drop_with_draft_rows_matches_reference(splits, gen):
    """Ragged drafts (1..4 rows); request 1 has no chunks and an empty tail: only its draft rows."""
    hkv, group, d = 2, 2, 16
    comp = make_compressor("knorm", 8, hkv, group, d, torch.float32, ratio=2.0)
    x = compressed_kv(comp, [19, 8, 24], [2, 1, 3], gen)
    x["num_chunks"][1] = 0  # request 1: no chunks, empty tail, drafts only
    x["tail_lens"][1] = 0
    dk, dv, table, lens = _draft_pool([3, 1, 4], hkv, d, gen)
    q = torch.randn((3, hkv * group, d), generator=gen)
    bufs = x["pool"].buffers[0]
    base = (bufs["k"], bufs["v"], *_args(x))
    want = compressed_decode_ref(q, *base, d**-0.5, dk, dv, table, lens)
    got = token_drop_decode_attention(
        *to_device(q, *base), sm_scale=d**-0.5, num_kv_splits=splits,
        draft_k_buffer=dk, draft_v_buffer=dv, draft_table=table, draft_lens=lens,
    )
    assert not got.isnan().any()
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL_F32, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "kivi4"])
def test_quantized_with_draft_rows_matches_reference(kind, gen):
    hkv, group, d = 2, 2, 16
    comp = make_compressor(kind, 8, hkv, group, d, torch.float32, group_size=8)
    x = compressed_kv(comp, [21, 30], [2, 3], gen)
    dk, dv, table, lens = _draft_pool([2, 5], hkv, d, gen)
    q = torch.randn((2, hkv * group, d), generator=gen)
    pool = x["pool"]
    ck, cv = comp.decompress(0, CompressedChunk(dict(pool.buffers[0])))  # [num_chunks + 1, T, H, D]
    want = compressed_decode_ref(q, ck, cv, *_args(x), d**-0.5, dk, dv, table, lens)
    got = quantized_decode_attention(
        q, kind, pool.buffers[0], *_args(x), sm_scale=d**-0.5,
        draft_k_buffer=dk, draft_v_buffer=dv, draft_table=table, draft_lens=lens,
    )
    torch.testing.assert_close(got.float().cpu(), want, atol=ATOL_F32, rtol=0)


def test_draft_rows_change_the_result(gen):
    """The draft part is really attended: dropping it gives a different output."""
    hkv, group, d = 1, 2, 16
    comp = make_compressor("knorm", 8, hkv, group, d, torch.float32, ratio=2.0)
    x = compressed_kv(comp, [12], [1], gen)
    dk, dv, table, lens = _draft_pool([2], hkv, d, gen)
    q = torch.randn((1, hkv * group, d), generator=gen)
    bufs = x["pool"].buffers[0]
    base = (q, bufs["k"], bufs["v"], *_args(x))
    with_drafts = token_drop_decode_attention(*base, draft_k_buffer=dk, draft_v_buffer=dv, draft_table=table,
                                              draft_lens=lens)
    without = token_drop_decode_attention(*base)
    assert (with_drafts - without).abs().max() > 1e-3
