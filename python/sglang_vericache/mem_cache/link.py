"""The link between the host (exact) tier and the accelerator: verification and naive offload
stream exact KV over it layer by layer (mem_cache/kv_stager.py), through a throttled transfer
engine, so link time is real on a CPU too.

Staged batches are split so each fits the staging area: a group's committed prefixes sum to at
most `max_tokens` rows (a request longer than that alone is an error caught at admission).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from sglang_vericache.mem_cache.kv_stager import LayerwiseKVStager
from sglang_vericache.mem_cache.transfer_engine import TransferEngine
from sglang_vericache.model_executor.forward_batch import StagedVerify
from sglang_vericache.server_args import parse_bytes

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.cache_req import CacheReq
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang_vericache.server_args import ServerArgs

T = TypeVar("T")


class Link:
    def __init__(self, args: ServerArgs, exact_pool: MHATokenToKVPool, req_to_token_pool: ReqToTokenPool, device):
        bw = None if args.link_bandwidth is None else float(parse_bytes(args.link_bandwidth, "--link-bandwidth"))
        self.req_to_token_pool = req_to_token_pool
        self.bandwidth = bw
        self.engine = TransferEngine(bw, device)
        self.stager = LayerwiseKVStager(exact_pool, self.engine, args.verify_staging_tokens)
        self.max_tokens = args.verify_staging_tokens

    def bytes_for(self, n_tokens: int) -> int:
        return self.stager.transfer_bytes(n_tokens)

    def staged(self, group: list[CacheReq]) -> StagedVerify:
        """Starts streaming the committed exact KV of each request in group (positions [0, n-1))."""
        r2t = self.req_to_token_pool.req_to_token
        lens = [r.kv_committed_len for r in group]
        slots = torch.cat([r2t[r.req_pool_idx, :n] for r, n in zip(group, lens)])
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        return StagedVerify(kv=self.stager.begin(slots), offsets=offsets, prefix_lens=lens)

    def split(self, group: list[CacheReq]) -> list[list[CacheReq]]:
        """Consecutive sub-groups whose committed prefixes each fit the staging area."""
        return split_by_budget(group, lambda r: r.kv_committed_len, self.max_tokens)

    def reset_stats(self) -> None:
        self.engine.reset_stats()
        self.stager.stalls.clear()


def split_by_budget(items: list[T], size: Callable[[T], int], budget: int) -> list[list[T]]:
    """Consecutive groups whose sizes sum to at most budget (an item alone may exceed it)."""
    out: list[list[T]] = []
    cur: list[T] = []
    used = 0
    for item in items:
        if cur and used + size(item) > budget:
            out.append(cur)
            cur, used = [], 0
        cur.append(item)
        used += size(item)
    if cur:
        out.append(cur)
    return out
