"""(c) decode attention over int8 / kivi2 / kivi4 chunks (dequantized in the kernel) + exact tail.

Inputs are built by the repo's own compressors (compress()) and the reference attends over
their decompress() output, so the kernel is checked against the compressors' layouts themselves.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import compressed_kv, make_compressor, requires_gpu, to_device
from sgl_kernel_ext.decode_quantized import quantized_decode_attention
from sgl_kernel_ext.ref import compressed_decode_ref

from sglang_vericache.compress.base import CompressedChunk

ATOL_F32 = 2e-5  # float32 q / exact tail: in-kernel dequant equals decompress() up to f32 rounding
ATOL_BF16 = 2e-2  # bf16; on a GPU the dequantized rows are cast to bf16 for the tensor-core dot


def _run(kind, seq_lens, num_chunks, chunk_size, hkv, group, d, dtype, splits, gen, group_size=32):
    comp = make_compressor(kind, chunk_size, hkv, group, d, dtype, group_size=group_size)
    x = compressed_kv(comp, seq_lens, num_chunks, gen)
    q = torch.randn((len(seq_lens), hkv * group, d), generator=gen).to(dtype)
    bufs = x["pool"].buffers[0]
    chunk_k, chunk_v = comp.decompress(0, CompressedChunk(dict(bufs)))  # [num_chunks + 1, T, H, D]
    rest = (
        x["chunk_ids"],
        x["num_chunks"],
        x["k"],
        x["v"],
        x["req_to_token"],
        x["req_pool_indices"],
        x["tail_starts"],
        x["tail_lens"],
    )
    want = compressed_decode_ref(q, chunk_k, chunk_v, *rest, d**-0.5)
    dev_bufs = {n: b for n, b in zip(bufs, to_device(*bufs.values()))}
    got = quantized_decode_attention(
        to_device(q)[0], kind, dev_bufs, *to_device(*rest), sm_scale=d**-0.5, num_kv_splits=splits
    )
    assert got.dtype == dtype and got.shape == q.shape
    return got.float().cpu(), want


@pytest.mark.parametrize("kind", ["int8", "kivi2", "kivi4"])
def test_ragged_chunks_and_tails_match_decompress_reference(kind, gen):
    """Kivi groups of 4 tokens (keys) / 4 channels (values) inside 8-token chunks, D = 16;
    72 compressed rows span two key blocks."""
    got, want = _run(
        kind,
        [19, 5, 75],
        [2, 0, 9],
        chunk_size=8,
        hkv=2,
        group=2,
        d=16,
        dtype=torch.float32,
        splits=2,
        gen=gen,
        group_size=4,
    )
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_kivi2_default_groups_bf16_head_dim_32(gen):
    got, want = _run(
        "kivi2", [13, 9], [3, 1], chunk_size=4, hkv=1, group=4, d=32, dtype=torch.bfloat16, splits=1, gen=gen
    )
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kind", ["int8", "kivi2", "kivi4"])
def test_real_shape_8b_on_gpu(kind, gen):
    got, want = _run(
        kind,
        [4096 + 17, 1000, 64],
        [256, 62, 4],
        chunk_size=16,
        hkv=8,
        group=4,
        d=128,
        dtype=torch.bfloat16,
        splits=None,
        gen=gen,
    )
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)
