"""ForwardBatch: everything one model forward pass needs, as flat tensors.

Layout invariant (all modes): the batch's new tokens are concatenated request by request.
Request i contributes `extend_seq_lens[i]` new tokens at positions
`extend_prefix_lens[i] .. seq_lens[i]-1`; its KV for positions `< extend_prefix_lens[i]` is
already in the pool at `req_to_token[req_pool_indices[i], :extend_prefix_lens[i]]`, and the
new tokens' KV is written to `out_cache_loc` (which the scheduler has also written into
`req_to_token` before the forward). The new tokens attend causally to everything before them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto

import torch


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill / chunked prefill / prefix-cache extend: many new tokens per request
    DECODE = auto()  # exactly one new token per request
    TARGET_VERIFY = auto()  # speculative verify: [last token, drafts] per request, causal, exact KV

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, length after this forward
    extend_prefix_lens: torch.Tensor  # [bs] int64
    extend_seq_lens: torch.Tensor  # [bs] int64 (all 1 in DECODE)
    out_cache_loc: torch.Tensor  # [num_tokens] int64 slots the new KV goes to
    # Python copies of the length tensors, so backends need no device syncs to loop.
    seq_lens_cpu: list[int] = field(default_factory=list)
    extend_prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_seq_lens_cpu: list[int] = field(default_factory=list)
    # Which rows of the flattened hidden states need logits (e.g. each request's last token,
    # or every token of a verify run, or input-logprob ranges). None = each request's last token.
    logits_indices: torch.Tensor | None = None
    # Set by the ModelRunner before the forward.
    req_to_token_pool: object = None
    token_to_kv_pool: object = None
    attn_backend: object = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def last_token_indices(self) -> torch.Tensor:
        return torch.cumsum(self.extend_seq_lens, 0) - 1
