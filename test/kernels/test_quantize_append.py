"""(e) quantize-and-append: the kernel writes the same bytes as the repo's compressors.

Exact op, so every assertion is bit equality of every pool buffer (unused chunk ids included),
against a CompressedKVPool filled by Int8Compressor / KIVICompressor.compress. The references
in sgl_kernel_ext.ref are checked against the compressors the same way.
"""

from __future__ import annotations

import pytest
import torch
from kernel_inputs import DEVICE, compressed_kv, make_compressor, requires_gpu
from sgl_kernel_ext import ref
from sgl_kernel_ext.quantize_append import quantize_append

from sglang_vericache.compress.base import CompressedChunk
from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool

NUM_CHUNKS = [2, 1, 3]  # 6 chunks over 3 requests; each request also has a partly filled, uncompressed tail


def _spread(x: dict, gen: torch.Generator) -> None:
    """Magnitudes over ~8 orders (exercises every float16 exponent path), one all-zero token
    (scale floor), and one int8 row whose codes fall on exact halves (round half to even)."""
    for name in ("k", "v"):
        buf = x[name]
        real = ~buf.isnan().any(-1).any(-1)
        mag = torch.exp(torch.randn((int(real.sum()), buf.shape[1], 1), generator=gen) * 3).clamp(max=100)
        buf[real] = (buf[real].float() * mag).to(buf.dtype)
    slot = x["req_to_token"][1, 3]
    x["k"][slot, 0] = 0.0
    halves = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5]) * 0.25
    x["v"][slot, 0] = halves.repeat(x["v"].shape[-1] // 8).to(x["v"].dtype)


def _check(kind, chunk_size, hkv, d, dtype, gen, group_size=32):
    comp = make_compressor(kind, chunk_size, hkv, 1, d, dtype, group_size=group_size)
    seq_lens = [n * chunk_size + 3 for n in NUM_CHUNKS]
    x = compressed_kv(comp, seq_lens, NUM_CHUNKS, gen)
    _spread(x, gen)
    # recompress after _spread so the pool holds the compressors' bytes for the final inputs
    want = CompressedKVPool(comp, num_layers=1, num_chunks=x["pool"].num_chunks)
    slots = torch.cat([x["req_to_token"][b + 1, : n * chunk_size] for b, n in enumerate(NUM_CHUNKS)])
    slots = slots.view(-1, chunk_size)
    order = torch.cat([x["chunk_ids"][b, :n] for b, n in enumerate(NUM_CHUNKS)])
    want.write(0, order, comp.compress(0, x["k"][slots], x["v"][slots]))
    got = {n: torch.zeros_like(b).to(DEVICE) for n, b in want.buffers[0].items()}
    quantize_append(kind, x["k"].to(DEVICE), x["v"].to(DEVICE), slots.to(DEVICE), order.to(DEVICE), got)
    for name, buf in want.buffers[0].items():
        assert torch.equal(got[name].cpu().view(torch.uint8), buf.view(torch.uint8)), f"{kind} {name} differs"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_codes_and_scales_bit_identical_to_compressor(dtype, gen):
    _check("int8", chunk_size=8, hkv=2, d=32, dtype=dtype, gen=gen)


@pytest.mark.parametrize("kind,group_size", [("kivi2", 4), ("kivi4", 32)])
def test_kivi_codes_scales_zeros_bit_identical_to_compressor(kind, group_size, gen):
    """group 4: two key groups per 8-token chunk, 8 value groups of 4 channels; group 32: one of each."""
    _check(kind, chunk_size=8, hkv=2, d=32, dtype=torch.bfloat16, gen=gen, group_size=group_size)


@pytest.mark.parametrize("kind", ["int8", "kivi2", "kivi4"])
def test_reference_quantizers_and_dequantizers_equal_the_compressors(kind, gen):
    comp = make_compressor(kind, 8, 2, 1, 16, torch.float32, group_size=4)
    k, v = (torch.randn((3, 8, 2, 16), generator=gen) * 5 for _ in range(2))
    want = comp.compress(0, k, v)
    if kind == "int8":
        (kc, ks), (vc, vs) = ref.int8_quantize_ref(k), ref.int8_quantize_ref(v)
        got = {"k": kc, "k_scale": ks, "v": vc, "v_scale": vs}
        deq = (ref.int8_dequant_ref(kc, ks), ref.int8_dequant_ref(vc, vs))
    else:
        got = ref.kivi_quantize_ref(k, v, comp.bits, comp.key_group, comp.value_group)
        deq = ref.kivi_dequant_ref(got, comp.bits, comp.key_group, comp.value_group)
    assert want.tensors.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in got)
    for a, b in zip(deq, comp.decompress(0, CompressedChunk(got))):
        assert torch.equal(a, b)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("kind", ["int8", "kivi2", "kivi4"])
def test_real_shape_bit_identical_on_gpu(kind, gen):
    _check(kind, chunk_size=64, hkv=8, d=128, dtype=torch.bfloat16, gen=gen)
