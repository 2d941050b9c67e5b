"""One page of KV (all layers) <-> bytes: bit-exact round trips and clear errors on bad bytes."""

from __future__ import annotations

import pytest
import torch

from sglang_vericache.compress.base import TensorSpec
from sglang_vericache.mem_cache.storage.serialize import (
    PayloadError, deserialize_page, exact_page_spec, serialize_page,
)

SPEC = exact_page_spec(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def exact_page(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(4, 2, 8, generator=g).to(torch.bfloat16) for n in ("k", "v")} for _ in range(2)]


def assert_bit_identical(a, b):
    assert len(a) == len(b)
    for la, lb in zip(a, b):
        assert list(la) == list(lb)
        for n in la:
            assert la[n].dtype == lb[n].dtype and la[n].shape == lb[n].shape
            assert torch.equal(la[n].reshape(-1).view(torch.uint8), lb[n].reshape(-1).view(torch.uint8))


def test_exact_bf16_page_round_trips_bit_identically():
    page = exact_page()
    assert_bit_identical(deserialize_page(serialize_page(page), SPEC), page)


def test_mixed_dtype_compressed_page_round_trips_bit_identically():
    g = torch.Generator().manual_seed(1)
    layer = {
        "k": torch.randint(0, 256, (4, 2, 4), dtype=torch.uint8, generator=g),
        "k_scale": torch.rand(1, 2, 8, generator=g).to(torch.float16),
        "idx": torch.randint(0, 4, (2, 3), dtype=torch.int16, generator=g),
        "rows": torch.randn(2, 3, 8, generator=g).to(torch.bfloat16),
    }
    page = [layer, {n: t.clone() + (1 if t.dtype != torch.uint8 else 0) for n, t in layer.items()}]
    spec = [tuple(TensorSpec(n, tuple(t.shape), t.dtype) for n, t in lay.items()) for lay in page]
    assert_bit_identical(deserialize_page(serialize_page(page), spec), page)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8")
def test_fp8_codes_round_trip_as_raw_bytes():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(4, 8, 8)
    out = deserialize_page(serialize_page([{"k": codes}]))
    assert torch.equal(out[0]["k"].view(torch.uint8), codes.view(torch.uint8))


def test_non_contiguous_tensors_are_stored_by_value():
    page = exact_page()
    page[0]["k"] = page[0]["k"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, other strides
    assert_bit_identical(deserialize_page(serialize_page(page), SPEC), exact_page())


def test_flipped_data_bit_is_a_crc_error():
    blob = bytearray(serialize_page(exact_page()))
    blob[-5] ^= 0x10
    with pytest.raises(PayloadError, match="CRC32"):
        deserialize_page(bytes(blob), SPEC)


def test_truncated_page_is_rejected():
    blob = serialize_page(exact_page())
    with pytest.raises(PayloadError, match="truncated"):
        deserialize_page(blob[:-1], SPEC)
    with pytest.raises(PayloadError, match="shorter than"):
        deserialize_page(blob[:5], SPEC)


def test_foreign_bytes_and_other_versions_are_rejected():
    blob = serialize_page(exact_page())
    with pytest.raises(PayloadError, match="not a KV page"):
        deserialize_page(b"GARBAGE!" + blob[8:], SPEC)
    with pytest.raises(PayloadError, match="version 2"):
        deserialize_page(blob[:8] + (2).to_bytes(2, "little") + blob[10:], SPEC)


def test_page_of_another_shape_or_dtype_is_rejected_naming_the_layer():
    other = exact_page_spec(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    with pytest.raises(PayloadError, match=r"layer 0: page holds k:bfloat16\[4, 2, 8\].*expected k:float16"):
        deserialize_page(serialize_page(exact_page()), other)
    three_layers = exact_page_spec(3, 4, 2, 8, torch.bfloat16)
    with pytest.raises(PayloadError, match="2 layers, expected 3"):
        deserialize_page(serialize_page(exact_page()), three_layers)
