"""sgl_kernel_ext.fixed_split_attention (the triton backend's deterministic attention): a query row's
bits depend on its query and its keys only. A verify row equals the decode row at its position,
a request's rows are the same alone or batched with another request, in the fused and the split
form, and through the masked interface the torch-path layouts use (padding inside the context
included); float32 and bfloat16. Close to the float32 reference elsewhere. TRITON_INTERPRET=1 on a CPU."""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, paged_kv, requires_gpu, to_device
from sgl_kernel_ext.cpu_attention import fixed_chunk_attention_ref
from sgl_kernel_ext.fixed_split_attention import fixed_split_attention, fixed_split_attention_masked

DTYPES = [torch.float32, torch.bfloat16]
SCALE = 0.25


def _rows(rpi, positions):
    """(row_table, row_len) of query rows at `positions` of requests `rpi` (one list per request)."""
    row_table = torch.cat([torch.full((len(p),), int(r)) for r, p in zip(rpi, positions)])
    return row_table, torch.cat([torch.tensor(p) + 1 for p in positions])


def _attend(q, k, v, r2t, rpi, positions, form=None, runs=True):
    row_table, row_len = _rows(rpi, positions)
    dev = to_device(q, k, v, r2t, row_table, row_len)
    out = fixed_split_attention(*dev, SCALE, [len(p) for p in positions] if runs else None, form)
    return out.cpu()


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bfloat16"])
def inputs(request):
    gen = torch.Generator().manual_seed(0)
    dtype = request.param
    # request 0: 150 keys (3 chunks, the last partial); request 1: 40 keys; pages of 8, NaN in unused slots
    k, v, r2t, rpi = paged_kv([150, 40], 8, num_kv_heads=2, head_dim=16, dtype=dtype, gen=gen)
    q = torch.randn((150, 4, 16), generator=gen).to(dtype)
    return dtype, q, k, v, r2t, rpi


def test_prefill_rows_match_the_float32_reference(inputs):
    _, q, k, v, r2t, rpi = inputs
    got = _attend(q, k, v, r2t, rpi[:1], [list(range(150))])
    allowed = (torch.arange(150)[None, :] <= torch.arange(150)[:, None])[None]
    want = fixed_chunk_attention_ref(q[None], k, v, r2t[rpi[:1], :150], allowed, SCALE)[0]
    assert got.dtype == torch.float32 and got.shape == (150, 4, 16)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


def test_verify_rows_equal_decode_rows_alone_or_batched(inputs):
    """Request 0's rows at positions 61..66 (across the chunk boundary at 64): as one verify run, as
    decode rows one per call, batched after request 1's verify rows; in the three forms of the kernel
    (gather: the interpreter's default; fused: a GPU's; split: a GPU's decode)."""
    _, q, k, v, r2t, rpi = inputs
    pos = list(range(61, 67))
    verify = _attend(q[61:67], k, v, r2t, rpi[:1], [pos])
    assert torch.equal(_attend(q[61:67], k, v, r2t, rpi[:1], [pos], form="fused"), verify)
    for i, p in enumerate(pos[1:4], 1):
        assert torch.equal(_attend(q[p : p + 1], k, v, r2t, rpi[:1], [[p]], runs=False)[0], verify[i]), p
    other = torch.randn((5, 4, 16), generator=torch.Generator().manual_seed(1)).to(q.dtype)
    batched = _attend(torch.cat([other, q[61:67]]), k, v, r2t, rpi.flip(0), [list(range(35, 40)), pos])
    assert torch.equal(batched[5:], verify)
    fused = _attend(torch.cat([other, q[61:67]]), k, v, r2t, rpi.flip(0), [list(range(35, 40)), pos], "fused")
    assert torch.equal(fused[5:], verify)
    decode_batch = _attend(q[[149, 63, 64]], k, v, r2t, rpi[[0, 0, 0]], [[149], [63], [64]], form="split",
                           runs=False)
    assert torch.equal(decode_batch[1:], verify[2:4])
    prefill = _attend(q, k, v, r2t, rpi[:1], [list(range(150))])
    assert torch.equal(prefill[61:67], verify) and torch.equal(decode_batch[0], prefill[149])


def test_masked_interface_equals_direct_rows_whatever_the_padding(inputs):
    """The torch-path interface (index [B, S], allowed [B, Lq, S]): a padded causal layout (padded
    query rows see the whole request) and a draft-like context with masked columns inside it give
    the direct call's rows."""
    _, q, k, v, r2t, rpi = inputs
    direct = _attend(q[[69, 149]], k, v, r2t, rpi[:1].repeat(2), [[69], [149]], runs=False)
    # padded verify layout: 2 requests x Lq 3 over S = 150 columns; request 1 (40 keys) padded
    index = r2t[rpi, :150].clone()
    index[1, 40:] = 0
    qp = torch.stack([q[67:70], q[:3]])
    i, j = torch.arange(3)[:, None], torch.arange(150)[None, :]
    allowed = torch.stack([j <= 67 + i, (j <= 37 + i) & (j < 40)])
    out = fixed_split_attention_masked(*to_device(qp, k, v, index, allowed), SCALE).cpu()
    assert torch.equal(out[0, 2], direct[0])
    # a draft context: request 0's 150 keys with 30 masked padding columns inserted after key 50
    ctx = torch.cat([r2t[rpi[0], :50], torch.zeros(30, dtype=torch.int64), r2t[rpi[0], 50:150]])[None]
    vis = torch.ones(1, 1, 180, dtype=torch.bool)
    vis[0, 0, 50:80] = False
    out = fixed_split_attention_masked(*to_device(q[149][None, None], k, v, ctx, vis), SCALE).cpu()
    assert torch.equal(out[0, 0], direct[1])


def test_a_mask_that_is_not_a_prefix_is_refused(inputs):
    _, q, k, v, r2t, rpi = inputs
    allowed = torch.ones(1, 2, 8, dtype=torch.bool)
    allowed[0, 0, 3] = False  # row 0 skips key 3 but sees key 4: chunking it would move its keys
    with pytest.raises(ValueError, match="not a prefix"):
        fixed_split_attention_masked(q[None, :2], k, v, r2t[rpi[:1], :8], allowed, SCALE)


def test_head_dim_not_a_power_of_two(gen):
    k, v, r2t, rpi = paged_kv([70], 8, num_kv_heads=1, head_dim=24, dtype=torch.float32, gen=gen)
    q = torch.randn((2, 3, 24), generator=gen)
    got = _attend(q, k, v, r2t, rpi, [[68, 69]])
    allowed = (torch.arange(70)[None, :] <= torch.tensor([68, 69])[:, None])[None]
    want = fixed_chunk_attention_ref(q[None], k, v, r2t[rpi, :70], allowed, SCALE)[0]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_rows_equal_decode_rows_on_gpu_at_8b_shape(dtype):
    """Llama-3-8B's attention shape (32 / 8 heads, head_dim 128): verify rows (fused form, 16-row
    tiles) == decode rows (split form, chunks in parallel) bitwise on the GPU's tl.dot."""
    assert DEVICE == "cuda"
    gen = torch.Generator().manual_seed(0)
    k, v, r2t, rpi = paged_kv([3000, 700], 16, num_kv_heads=8, head_dim=128, dtype=dtype, gen=gen)
    q = torch.randn((40, 32, 128), generator=gen).to(dtype)
    pos = list(range(2960, 3000))
    verify = _attend(q, k, v, r2t, rpi[:1], [pos])
    decode = _attend(q, k, v, r2t, rpi[[0] * 40], [[p] for p in pos], form="split", runs=False)
    assert torch.equal(verify, decode)
    batched = _attend(torch.cat([q[:7], q]), k, v, r2t, rpi[[1, 0]], [list(range(693, 700)), pos])
    assert torch.equal(batched[7:], verify)
