"""PageStore: one tier's KV pages of one model in a KVStore, keyed by token prefixes.

What the scheduler calls (P = page_size; only whole pages are ever stored or loaded):
  write-through after prefill:   keys = ps.keys(tokens); have = ps.match_prefix(keys)
                                 ps.put_pages(keys[have:], read_exact_pages(pool, slots[have*P:len(keys)*P], P))
  lookup on a radix-cache miss:  n = ps.match_prefix(keys[cached:]); allocate n pages;
                                 pages = ps.get_pages(keys[cached:cached+n])   # may return fewer
                                 write_exact_pages(pool, new_slots[:len(pages)*P], pages)
and the same with read/write_compressed_pages for the compressed tier (one chunk = one page).
Invariants: get_pages returns pages of the prefix in order, stopping at the first page that is
missing, unreadable (PayloadError: it is deleted and logged) or does not match this store's spec,
so whatever it returns is exactly the KV those tokens produced; it never raises for store trouble
when the store is a DegradingStore (create_store's default).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Iterable, Sequence

import torch

from sglang_vericache.compress.base import CompressedChunk
from sglang_vericache.mem_cache.storage.base import KVStore
from sglang_vericache.mem_cache.storage.hash_chain import StoreNamespace, page_keys
from sglang_vericache.mem_cache.storage.serialize import (
    PagePayload, PageSpec, PayloadError, check_payload, deserialize_page, serialize_page,
)

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool

logger = logging.getLogger(__name__)


class PageStore:
    def __init__(self, store: KVStore, namespace: StoreNamespace, spec: PageSpec):
        self.store, self.namespace, self.spec = store, namespace, spec
        self.page_size = namespace.page_size
        self.corrupt_pages = 0

    def keys(self, tokens: Iterable[int]) -> list[str]:
        """Keys of every whole page of tokens (from position 0)."""
        return page_keys(tokens, self.namespace)

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading pages are stored."""
        return self.store.match_prefix(keys)

    def put_pages(self, keys: Sequence[str], payloads: Sequence[PagePayload]) -> int:
        """Stores payloads[i] under keys[i]; -> how many were stored. ValueError if a payload
        does not match the spec (a caller bug, checked before anything is written)."""
        if len(keys) != len(payloads):
            raise ValueError(f"{len(keys)} keys for {len(payloads)} pages")
        for p in payloads:
            check_payload(p, self.spec)
        return sum(self.store.put(k, serialize_page(p)) for k, p in zip(keys, payloads))

    def get_pages(self, keys: Sequence[str]) -> list[PagePayload]:
        """Pages of the leading stored keys, stopping at the first missing or unreadable one."""
        out: list[PagePayload] = []
        for key, blob in zip(keys, self.store.get(keys)):
            try:
                out.append(deserialize_page(blob, self.spec))
            except PayloadError as e:
                self.corrupt_pages += 1
                logger.warning("KV store page %s is unusable and was deleted: %s", key, e)
                self.store.delete(key)
                break
        return out


# ---- pool adapters: pages of the runtime's pools <-> payloads -----------------------------------


def read_exact_pages(kv_pool: MHATokenToKVPool, slots: torch.Tensor, page_size: int) -> list[PagePayload]:
    """Payloads of the exact KV at slots ([n * page_size], page i = slots[i*P:(i+1)*P]), copied."""
    n = len(slots) // page_size
    assert len(slots) == n * page_size, f"{len(slots)} slots are not whole pages of {page_size}"
    slots = slots.to(kv_pool.device)
    per_layer = [
        (kv_pool.get_key_buffer(l)[slots].unflatten(0, (n, page_size)).cpu(),
         kv_pool.get_value_buffer(l)[slots].unflatten(0, (n, page_size)).cpu())
        for l in range(kv_pool.num_layers)
    ]
    return [[{"k": k[i], "v": v[i]} for k, v in per_layer] for i in range(n)]


def write_exact_pages(kv_pool: MHATokenToKVPool, slots: torch.Tensor, payloads: Sequence[PagePayload]) -> None:
    """Writes payload i into slots[i*P:(i+1)*P] of every layer (bit-exact: same dtype)."""
    if not payloads:
        return
    slots = slots.to(kv_pool.device)
    for l in range(kv_pool.num_layers):
        k = torch.cat([p[l]["k"] for p in payloads]).to(kv_pool.device)
        v = torch.cat([p[l]["v"] for p in payloads]).to(kv_pool.device)
        assert len(k) == len(slots), f"{len(payloads)} pages of KV for {len(slots)} slots"
        kv_pool.set_kv_buffer(l, slots, k, v)


def read_compressed_pages(pool: CompressedKVPool, ids: torch.Tensor) -> list[PagePayload]:
    """Payloads of compressed chunks ids (one chunk = one page), copied."""
    per_layer = [pool.read(l, ids).to("cpu").tensors for l in range(pool.num_layers)]
    return [[{name: t[i] for name, t in layer.items()} for layer in per_layer] for i in range(len(ids))]


def write_compressed_pages(pool: CompressedKVPool, ids: torch.Tensor, payloads: Sequence[PagePayload]) -> None:
    """Writes payload i into chunk ids[i] of every layer."""
    if not payloads:
        return
    assert len(ids) == len(payloads), f"{len(payloads)} pages for {len(ids)} chunk ids"
    for l in range(pool.num_layers):
        names = payloads[0][l].keys()
        pool.write(l, ids, CompressedChunk({n: torch.stack([p[l][n] for p in payloads]) for n in names}))
