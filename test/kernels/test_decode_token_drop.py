"""(b) decode attention over token-dropped chunks (compress/token_drop.py layout) + exact tail."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import compressed_kv, make_compressor, requires_gpu, to_device
from sgl_kernel_ext.decode_token_drop import token_drop_decode_attention
from sgl_kernel_ext.ref import compressed_decode_ref

ATOL_F32 = 2e-5  # float32 rows: online softmax + split merge vs one softmax
ATOL_BF16 = 2e-2  # bf16; the interpreter computes in f32, a GPU in bf16 tensor-core dots


def _run(seq_lens, num_chunks, chunk_size, hkv, group, d, dtype, splits, gen, ratio=2.5):
    comp = make_compressor("knorm", chunk_size, hkv, group, d, dtype, ratio=ratio)
    x = compressed_kv(comp, seq_lens, num_chunks, gen)
    q = torch.randn((len(seq_lens), hkv * group, d), generator=gen).to(dtype)
    bufs = x["pool"].buffers[0]
    args = (
        bufs["k"],
        bufs["v"],
        x["chunk_ids"],
        x["num_chunks"],
        x["k"],
        x["v"],
        x["req_to_token"],
        x["req_pool_indices"],
        x["tail_starts"],
        x["tail_lens"],
    )
    want = compressed_decode_ref(q, *args, d**-0.5)
    got = token_drop_decode_attention(*to_device(q, *args), sm_scale=d**-0.5, num_kv_splits=splits)
    assert got.dtype == dtype and got.shape == q.shape
    return got.float().cpu(), want


@pytest.mark.parametrize("splits", [1, 2])
def test_ragged_chunks_and_tails_match_reference(splits, gen):
    """3 kept rows per head per chunk (not a power of 2); one request without chunks, one without
    tail, one over two key blocks (72 rows)."""
    got, want = _run(
        [19, 5, 24, 200],
        [2, 0, 3, 24],
        chunk_size=8,
        hkv=2,
        group=2,
        d=16,
        dtype=torch.float32,
        splits=splits,
        gen=gen,
    )
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_bf16_rows_head_dim_32(gen):
    got, want = _run(
        [13, 9],
        [2, 1],
        chunk_size=4,
        hkv=1,
        group=4,
        d=32,
        dtype=torch.bfloat16,
        splits=2,
        gen=gen,
        ratio=2.0,
    )
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)


@pytest.mark.gpu
@requires_gpu
def test_real_shape_8b_on_gpu(gen):
    got, want = _run(
        [4096 + 17, 1000, 64],
        [256, 62, 4],
        chunk_size=16,
        hkv=8,
        group=4,
        d=128,
        dtype=torch.bfloat16,
        splits=None,
        gen=gen,
        ratio=4.0,
    )
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)
