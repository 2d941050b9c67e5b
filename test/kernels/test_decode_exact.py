"""(a) paged decode attention over exact KV vs decode_attention_ref."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import paged_kv, requires_gpu, to_device
from sgl_kernel_ext import decode_attention
from sgl_kernel_ext.ref import decode_attention_ref

ATOL_F32 = 2e-5  # float32 KV: online softmax + split merge vs one softmax
ATOL_BF16 = 2e-2  # bf16 q/KV; the interpreter computes in f32, a GPU in bf16 tensor-core dots


def _run(seq_lens, page_size, hkv, group, d, dtype, splits, gen):
    k, v, r2t, rpi = paged_kv(seq_lens, page_size, hkv, d, dtype, gen)
    q = torch.randn((len(seq_lens), hkv * group, d), generator=gen).to(dtype)
    lens = torch.tensor(seq_lens)
    want = decode_attention_ref(q, k, v, r2t, rpi, lens, d**-0.5)
    got = decode_attention(*to_device(q, k, v, r2t, rpi, lens), sm_scale=d**-0.5, num_kv_splits=splits)
    assert got.dtype == dtype and got.shape == q.shape
    return got.float().cpu(), want


@pytest.mark.parametrize("splits", [1, 3])
def test_ragged_batch_with_partly_filled_pages_matches_reference(splits, gen):
    got, want = _run(
        [5, 70, 1], page_size=4, hkv=2, group=2, d=16, dtype=torch.float32, splits=splits, gen=gen
    )
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_gqa_group_of_four_head_dim_64(gen):
    got, want = _run([9, 16], page_size=8, hkv=1, group=4, d=64, dtype=torch.float32, splits=2, gen=gen)
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_bf16_inputs(gen):
    got, want = _run([7, 12], page_size=4, hkv=2, group=2, d=32, dtype=torch.bfloat16, splits=2, gen=gen)
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)


@pytest.mark.gpu
@requires_gpu
def test_real_shape_8b_on_gpu(gen):
    """Llama-3-8B attention shape: 32 q heads, 8 KV heads, head_dim 128, page size 16."""
    got, want = _run(
        [1000, 4097, 33, 2048],
        page_size=16,
        hkv=8,
        group=4,
        d=128,
        dtype=torch.bfloat16,
        splits=None,
        gen=gen,
    )
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)
