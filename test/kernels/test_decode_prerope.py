"""(c') decode attention over kvquant / rotatekv chunks (pre-RoPE keys, dequantized, rotated back and
RoPE'd in the kernel) + exact tail.

Inputs are built by the repo's own compressors (compress() at the tokens' positions); the kernel is
checked against attention over their decompress() rows, and ref.py's plain restatement of each layout
against decompress() itself.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import compressed_kv, make_compressor, requires_gpu, to_device
from sgl_kernel_ext.decode_prerope import prerope_decode_attention
from sgl_kernel_ext.ref import compressed_decode_ref, kvquant_dequant_ref, rotatekv_dequant_ref

from sglang_vericache.compress.base import CompressedChunk

ATOL_F32 = 2e-5  # as test_decode_quantized: in-kernel dequant equals decompress() up to f32 rounding
ATOL_BF16 = 2e-2  # bf16 exact tail and queries; on a GPU the rows are cast to bf16 for the dot
# ref.py's rotatekv rotates back with a Hadamard matmul, decompress() with butterflies: f32 rounding apart
REF_ATOL = 1e-5


def _quantizer(comp):
    return comp.stage(0) if hasattr(comp, "stage") else comp


def _run(kind, seq_lens, num_chunks, chunk_size, hkv, group, d, dtype, splits, gen, **options):
    comp = make_compressor(kind, chunk_size, hkv, group, d, dtype, **options)
    quant = _quantizer(comp)
    x = compressed_kv(comp, seq_lens, num_chunks, gen)
    q = torch.randn((len(seq_lens), hkv * group, d), generator=gen).to(dtype)
    bufs = x["pool"].buffers[0]
    chunk_k, chunk_v = comp.decompress(0, CompressedChunk(dict(bufs)))  # [num_chunks + 1, rows, H, D]
    cos, sin = quant.rope.table(torch.tensor([max(num_chunks) * chunk_size]))
    bits = quant.bits
    if quant.name.startswith("kvquant"):
        ref_k, ref_v = kvquant_dequant_ref(bufs, bits, cos, sin)
        assert torch.equal(ref_k, chunk_k) and torch.equal(ref_v, chunk_v)  # the same arithmetic, bitwise
    else:
        ref_k, ref_v = rotatekv_dequant_ref(bufs, bits, cos, sin, quant.key_heads)
        torch.testing.assert_close(ref_k, chunk_k, atol=REF_ATOL, rtol=0)
        torch.testing.assert_close(ref_v, chunk_v, atol=REF_ATOL, rtol=0)
    rest = (x["chunk_ids"], x["num_chunks"], x["k"], x["v"], x["req_to_token"], x["req_pool_indices"],
            x["tail_starts"], x["tail_lens"])
    want = compressed_decode_ref(q, chunk_k, chunk_v, *rest, d**-0.5)
    dev_bufs = {n: b for n, b in zip(bufs, to_device(*bufs.values()))}
    got = prerope_decode_attention(
        to_device(q)[0], quant.name, dev_bufs, to_device(cos, sin), *to_device(*rest), sm_scale=d**-0.5,
        num_kv_splits=splits, key_heads=getattr(quant, "key_heads", 1),
    )
    assert got.dtype == dtype and got.shape == q.shape
    return got.float().cpu(), want


@pytest.mark.parametrize("kind", ["kvquant3", "kvquant4", "rotatekv2", "rotatekv4"])
def test_ragged_gqa_matches_decompress_reference(kind, gen):
    """Ragged batch (a request with no chunks), 2 KV heads x 2 query heads (rotatekv: one key
    Hadamard group over both heads), 8-token chunks, 72 compressed rows over two key blocks and 2
    splits; kvquant keeps 5% outliers (rows with several, rows with none)."""
    got, want = _run(kind, [19, 5, 75], [2, 0, 9], chunk_size=8, hkv=2, group=2, d=16, dtype=torch.float32,
                     splits=2, gen=gen, group_size=8, outlier_fraction=0.05)
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


@pytest.mark.parametrize("kind", ["kvquant4", "rotatekv4"])
def test_bf16_head_dim_32(kind, gen):
    """bfloat16 model dtype (outlier values stored in it), D = 32, 4 query heads on 1 KV head."""
    got, want = _run(kind, [13, 9], [3, 1], chunk_size=4, hkv=1, group=4, d=32, dtype=torch.bfloat16,
                     splits=1, gen=gen, group_size=16, outlier_fraction=0.05)
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)


@pytest.mark.parametrize("kind", ["knorm+kvquant4", "knorm+rotatekv2"])
def test_after_a_dropper_per_head_positions(kind, gen):
    """DROP+QUANT: the quantizer's chunk holds each head's kept rows (4 of 8, knorm: its own per head)
    at their own positions [T, H]."""
    got, want = _run(kind, [20, 17], [2, 1], chunk_size=8, hkv=2, group=2, d=16, dtype=torch.float32,
                     splits=1, gen=gen, ratio=2.0, group_size=8, outlier_fraction=0.05)
    torch.testing.assert_close(got, want, atol=ATOL_F32, rtol=0)


def test_unknown_kind_is_a_clear_error(gen):
    with pytest.raises(ValueError, match="kind must be one of"):
        prerope_decode_attention(torch.zeros(1, 1, 16), "kivi4", {}, (None, None), *([None] * 8))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kind", ["kvquant3", "kvquant4", "rotatekv2", "rotatekv4"])
def test_real_shape_8b_on_gpu(kind, gen):
    got, want = _run(kind, [4096 + 17, 1000, 64], [256, 62, 4], chunk_size=16, hkv=8, group=4, d=128,
                     dtype=torch.bfloat16, splits=None, gen=gen)
    torch.testing.assert_close(got, want, atol=ATOL_BF16, rtol=0)
