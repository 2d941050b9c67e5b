"""CacheReq: what the caches read and write of a request.

The scheduler's Req (managers/schedule_batch.py) is this and more; the caches sit below the
scheduler, so they name the request by the fields they use, not by the scheduler's class.
"""

from __future__ import annotations

from typing import Protocol

import torch


class DraftingState(Protocol):
    decode_only: bool  # never drafts (speculative/round_state.py's VeriCacheState)


class CacheReq(Protocol):
    rid: str
    origin_input_ids: list[int]
    req_pool_idx: int | None
    kv_committed_len: int  # positions with computed KV in req_to_token[req_pool_idx]
    comp_indices: torch.Tensor  # compressed chunk ids of pages [0, C) (mem_cache/two_tier.py)
    comp_layer_chunks: list[torch.Tensor] | None  # global budgets: each layer's flat chunks of those ids
    q_hist: dict  # per layer, queries awaiting a fold
    meta: dict  # counters reported in meta_info
    spec: DraftingState

    @property
    def fill_ids(self) -> list[int]: ...

    def prefill_target_len(self) -> int: ...

    def max_prefix_len(self) -> int: ...
