"""(d) multi-token causal verify attention over paged exact KV vs verify_attention_ref."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import paged_kv, requires_gpu, to_device
from sgl_kernel_ext.ref import verify_attention_ref
from sgl_kernel_ext.verify_attention import verify_attention

ATOL_F32 = 2e-5  # float32: online softmax vs one softmax
ATOL_BF16 = 2e-2  # bf16; the interpreter computes in f32, a GPU in bf16 tensor-core dots


def _run(seq_lens, q_lens, page_size, hkv, group, d, dtype, gen):
    k, v, r2t, rpi = paged_kv(seq_lens, page_size, hkv, d, dtype, gen)
    q = torch.randn((len(seq_lens), max(q_lens), hkv * group, d), generator=gen).to(dtype)
    lens, qlens = torch.tensor(seq_lens), torch.tensor(q_lens)
    want = verify_attention_ref(q, qlens, k, v, r2t, rpi, lens, d**-0.5)
    got = verify_attention(*to_device(q, qlens, k, v, r2t, rpi, lens), sm_scale=d**-0.5)
    assert got.dtype == dtype and got.shape == q.shape
    return got.float().cpu(), want


def test_ragged_draft_lengths_and_partly_filled_pages(gen):
    """T = 5, 1, 3 new tokens; 70 keys span two key blocks; padding query rows come back 0."""
    got, want = _run([70, 6, 3], [5, 1, 3], page_size=4, hkv=2, group=2, d=16, dtype=torch.float32, gen=gen)
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)
    assert got[1, 1:].abs().max() == 0


def test_query_rows_span_several_programs(gen):
    """T * G = 9 * 4 = 36 > 16 rows: three row blocks, a block boundary inside a token's heads."""
    got, want = _run([20, 12], [9, 2], page_size=8, hkv=1, group=4, d=32, dtype=torch.float32, gen=gen)
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_bf16_inputs(gen):
    got, want = _run([11, 8], [4, 2], page_size=4, hkv=2, group=2, d=64, dtype=torch.bfloat16, gen=gen)
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)


@pytest.mark.gpu
@requires_gpu
def test_real_shape_8b_on_gpu(gen):
    got, want = _run(
        [4097, 1000, 300], [8, 5, 1], page_size=16, hkv=8, group=4, d=128, dtype=torch.bfloat16, gen=gen
    )
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)
