"""Page-aligned prefix hash chains: the keys any instance computes for a token prefix."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest
import torch

from sglang_vericache.mem_cache.storage.hash_chain import StoreNamespace, page_hashes, page_keys

P = 4
NS = StoreNamespace(model="tiny-llama@r1", tier="exact", page_size=P, dtype="bfloat16")


def test_key_is_blake2b_of_previous_digest_and_int32_le_tokens():
    tokens = [1, 2, 300, 70000, 5, 6, 7, 8]
    h0 = hashlib.blake2b(NS.digest() + struct.pack("<4i", 1, 2, 300, 70000), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<4i", 5, 6, 7, 8), digest_size=16).digest()
    assert page_keys(tokens, NS) == [h0.hex(), h1.hex()]


def test_same_prefix_gives_same_keys_and_extension_keeps_them():
    a = list(range(100, 112))  # 3 pages
    assert page_keys(a, NS) == page_keys(list(a), NS)
    assert page_keys(a + [7, 8, 9, 10], NS)[:3] == page_keys(a, NS)


def test_one_different_token_diverges_from_its_page_on():
    a = list(range(20))  # 5 pages
    b = list(a)
    b[9] = 999  # page 2
    ka, kb = page_keys(a, NS), page_keys(b, NS)
    assert ka[:2] == kb[:2]
    assert all(x != y for x, y in zip(ka[2:], kb[2:]))
    assert len(set(ka) | set(kb)) == 5 + 3


def test_partial_last_page_gets_no_key():
    assert len(page_keys(list(range(2 * P + 3)), NS)) == 2
    assert page_keys(list(range(P - 1)), NS) == []


def test_chain_continues_from_a_start_digest():
    tokens = list(range(3 * P))
    full = page_hashes(tokens, NS)
    assert page_hashes(tokens[P:], NS, start=full[0]) == full[1:]


def test_tensor_tokens_give_the_same_keys_as_a_list():
    tokens = list(range(50, 50 + 2 * P))
    assert page_keys(torch.tensor(tokens, dtype=torch.int64), NS) == page_keys(tokens, NS)


@pytest.mark.parametrize(
    "other",
    [
        StoreNamespace(model="tiny-llama@r2", tier="exact", page_size=P, dtype="bfloat16"),
        StoreNamespace(model="tiny-llama@r1", tier="exact", page_size=P, dtype="float32"),
        StoreNamespace(model="tiny-llama@r1", tier="compressed", page_size=P, dtype="bfloat16",
                       compressor="kivi2", ratio=4.0),
    ],
)
def test_namespaces_never_share_a_key(other):
    tokens = list(range(4 * P))
    assert not set(page_keys(tokens, NS)) & set(page_keys(tokens, other))


def test_compression_ratio_is_part_of_the_namespace():
    a = StoreNamespace("m", "compressed", P, "bfloat16", compressor="snapkv", ratio=4.0)
    b = StoreNamespace("m", "compressed", P, "bfloat16", compressor="snapkv", ratio=8.0)
    assert page_keys(range(P), a) != page_keys(range(P), b)


def test_keys_are_the_same_in_another_process_with_another_hash_seed():
    code = ("from sglang_vericache.mem_cache.storage.hash_chain import StoreNamespace, page_keys;"
            "print(page_keys(range(12), StoreNamespace('tiny-llama@r1', 'exact', 4, 'bfloat16')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == str(page_keys(range(12), NS))


@pytest.mark.parametrize("bad", [-1, 2**31])
def test_token_ids_outside_int32_are_rejected(bad):
    with pytest.raises(ValueError, match="token ids"):
        page_keys([1, 2, 3, bad], NS)


def test_namespace_requires_a_compressor_exactly_for_the_compressed_tier():
    with pytest.raises(ValueError, match="compressor"):
        StoreNamespace("m", "compressed", P, "bfloat16")
    with pytest.raises(ValueError, match="compressor"):
        StoreNamespace("m", "exact", P, "bfloat16", compressor="kivi2")
