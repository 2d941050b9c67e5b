"""ForwardBatch: everything one model forward pass needs, as flat tensors.

Layout invariant (all modes): the batch's new tokens are concatenated request by request.
Request i contributes `extend_seq_lens[i]` new tokens at positions
`extend_prefix_lens[i] .. seq_lens[i]-1`; its KV for positions `< extend_prefix_lens[i]` is
already in the pool at `req_to_token[req_pool_indices[i], :extend_prefix_lens[i]]`, and the
new tokens' KV is written to `out_cache_loc` (which the scheduler has also written into
`req_to_token` before the forward). The new tokens attend causally to everything before them.

DRAFT_DECODE (drafting over the compressed tier, and lossy mode) is the exception: one new token
per request, whose context is not `req_to_token[:, :seq_len]` but what `draft_ctx` describes.

Staged rows (`staged` set: streamed verification, the naive-offload baseline) are the other
exception: their context positions [0, extend_prefix_lens[i]) are read from a StagedKV (exact KV
streamed from the host pool layer by layer), not from the pool; their new tokens' KV is still
written to the pool at out_cache_loc. MIXED = DRAFT_DECODE rows first, then `num_resident`
requests whose context is in the pool (as TARGET_VERIFY: verify or decode rows of requests whose
exact KV is resident), then staged rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from sglang_vericache.mem_cache.compressed_pool import CompressedKVPool
    from sglang_vericache.mem_cache.kv_stager import StagedKV
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill / chunked prefill / prefix-cache extend: many new tokens per request
    DECODE = auto()  # exactly one new token per request
    TARGET_VERIFY = auto()  # speculative verify: [last token, drafts] per request, causal, exact KV
    # one new token per request over ForwardBatch.draft_ctx (compressed + exact tail + drafts);
    # not is_decode(): its context is not req_to_token[:, :seq_len]
    DRAFT_DECODE = auto()
    # staggering: the first num_draft requests are DRAFT_DECODE rows (draft_ctx), the rest are staged
    # rows (staged: any number of new tokens each, causal, over streamed exact KV); see ForwardBatch
    MIXED = auto()

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_draft_decode(self) -> bool:
        return self == ForwardMode.DRAFT_DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)


@dataclass
class DraftContext:
    """The attention context of a DRAFT_DECODE batch. Request i (row i of the batch, one new token
    at positions[i]) attends to, in this order:

      1. compressed rows: every row of chunks comp_ids[i] (in order) of compressed_pool; they cover
         positions [0, C_i * T), C_i = len(comp_ids[i]), T = compressed_pool.chunk_size
         (RoPE is already in them; their count per chunk is the layout's `rows`);
      2. exact tail: slots req_to_token[req_pool_indices[i], C_i*T : C_i*T + tail_lens[i]]
         of the exact pool (ForwardBatch.token_to_kv_pool);
      3. draft rows (new_kv == "draft"): slots draft_slots[i] of draft_pool, the previous draft
         steps' slots in position order, then this step's slot last.

    The new token's K/V are written first, to out_cache_loc of the pool `new_kv` names:
      - "draft" (VeriCache drafting): out_cache_loc[i] == draft_slots[i][-1];
      - "exact" (lossy mode, or drafts kept in the exact tail): draft_pool/draft_slots are None and
        out_cache_loc[i] == req_to_token[req_pool_indices[i], C_i*T + tail_lens[i] - 1], i.e. the
        tail includes the new token.
    In a DRAFT_DECODE ForwardBatch: extend_seq_lens = 1s, extend_prefix_lens = positions,
    seq_lens = positions + 1 (the logical lengths; the backend reads draft_ctx, not these).
    """

    compressed_pool: CompressedKVPool
    comp_ids: list[torch.Tensor]  # per request, int64 [C_i] chunk ids (may be empty)
    tail_lens: list[int]  # per request, exact-tail rows
    draft_pool: MHATokenToKVPool | None = None
    draft_slots: list[torch.Tensor] | None = None  # per request, int64 [D_i + 1]
    new_kv: Literal["draft", "exact"] = "draft"
    # Global budgets (mem_cache/compressed_pool.py): per request, None or each layer's flat chunks of
    # comp_ids[i], which layer l reads (from compressed_pool.flat) instead of comp_ids[i] of its own buffer.
    layer_chunks: list[list[torch.Tensor] | None] | None = None

    def __post_init__(self) -> None:
        bs = len(self.comp_ids)
        if len(self.tail_lens) != bs:
            raise ValueError(f"{len(self.tail_lens)} tail_lens for {bs} requests")
        if self.new_kv == "draft":
            if self.draft_pool is None or self.draft_slots is None or len(self.draft_slots) != bs:
                raise ValueError("new_kv='draft' needs draft_pool and one draft_slots tensor per request")
            if any(len(s) == 0 for s in self.draft_slots):
                raise ValueError("draft_slots[i] must end with this step's slot")
        elif self.new_kv == "exact":
            if self.draft_pool is not None or self.draft_slots is not None:
                raise ValueError("new_kv='exact' takes no draft pool (the tail holds the new token)")
            if any(t < 1 for t in self.tail_lens):
                raise ValueError("new_kv='exact': tail_lens[i] >= 1 (the tail includes the new token)")
        else:
            raise ValueError(f"new_kv must be 'draft' or 'exact', got {self.new_kv!r}")

    def tail_starts(self) -> list[int]:
        t = self.compressed_pool.chunk_size
        return [len(ids) * t for ids in self.comp_ids]


@dataclass
class StagedVerify:
    """The context of a batch's staged rows: requests whose committed exact KV streams from the host
    pool through a StagedKV instead of being read from the pool.

    Staged request i (batch row num_draft + i) has kv rows [offsets[i], offsets[i] + prefix_lens[i])
    = the exact KV of its positions [0, prefix_lens[i]) in position order (the caller begins the
    StagedKV with those requests' req_to_token[:prefix_len] slots concatenated request by request).
    Its new tokens (extend_seq_lens[row] >= 1, at positions prefix_lens[i]..) attend causally to
    [those rows, the new tokens' own K/V]; prefix_lens[i] must equal extend_prefix_lens[row].
    The backend calls kv.layer(l) right before layer l's staged attention and kv.release(l) as soon
    as it has copied the rows out (before the SDPA), so layer l+depth loads during the rest of layer
    l; every layer of kv is consumed by exactly one forward (ModelRunner.forward closes it on error).
    """

    kv: StagedKV
    offsets: list[int]
    prefix_lens: list[int]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.prefix_lens):
            raise ValueError(f"{len(self.offsets)} offsets for {len(self.prefix_lens)} prefix_lens")
        for o, p in zip(self.offsets, self.prefix_lens):
            if o < 0 or p < 0 or o + p > self.kv.num_tokens:
                n = self.kv.num_tokens
                raise ValueError(f"staged rows [{o}, {o + p}) outside the StagedKV's {n} rows")

    @property
    def batch_size(self) -> int:
        return len(self.offsets)


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
    # DRAFT_DECODE, and the draft rows of MIXED: what each request attends to (see DraftContext).
    draft_ctx: DraftContext | None = None
    # Staged rows (all rows of a DECODE / TARGET_VERIFY / EXTEND batch, or the rows after the draft
    # rows of MIXED): their context streams from a StagedKV (see StagedVerify).
    staged: StagedVerify | None = None
    # MIXED: requests after the draft rows whose context is read from the pool (resident exact KV).
    num_resident: int = 0
    # When a dict, each attention layer stores its post-RoPE queries [num_tokens, H_q*D] under its
    # layer id (query-scored compressors need them to compress a chunk).
    captured_q: dict | None = None
    # The same for the post-RoPE keys [num_tokens, H_kv*D] (KVzip's reconstruction pass).
    captured_k: dict | None = None
    # captured_q holds each layer's attention input [num_tokens, hidden_size] instead of its queries
    # (kvzap scores hidden states; set by the ModelRunner from its capture_hidden).
    capture_hidden: bool = False
    # Set by the ModelRunner before the forward.
    req_to_token_pool: object = None
    token_to_kv_pool: object = None
    attn_backend: object = None

    DEVICE_FIELDS = ("input_ids", "positions", "req_pool_indices", "seq_lens", "extend_prefix_lens",
                     "extend_seq_lens", "out_cache_loc", "logits_indices")

    def to(self, device: torch.device) -> ForwardBatch:
        """Moves the per-token / per-request tensors to the model's device (the scheduler builds them
        on the host); backends take their device from input_ids. In place; returns self."""
        for name in self.DEVICE_FIELDS:
            t = getattr(self, name)
            if t is not None and t.device != device:
                setattr(self, name, t.to(device, non_blocking=True))
        return self

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_draft(self) -> int:
        """Requests (= tokens) in rows [0, num_draft) that are DRAFT_DECODE rows."""
        if self.forward_mode.is_draft_decode():
            return self.batch_size
        if self.forward_mode.is_mixed() and self.draft_ctx is not None:
            return len(self.draft_ctx.comp_ids)
        return 0

    def last_token_indices(self) -> torch.Tensor:
        return torch.cumsum(self.extend_seq_lens, 0) - 1


def make_forward_batch(mode, batch, input_ids, positions, out_loc, prefix_lens=None) -> ForwardBatch:
    """The ForwardBatch of a scheduler batch (SGLang's ForwardBatch.init_new). batch: (req, new
    tokens) per request, req read for req_pool_idx and kv_committed_len (the scheduler's Req);
    prefix_lens: each request's context before its new tokens (default: a draft row's position,
    else the request's committed KV)."""
    if prefix_lens is not None:
        prefix = prefix_lens
    elif mode == ForwardMode.DRAFT_DECODE:  # logical lengths; the backend reads draft_ctx
        prefix = list(positions)
    else:
        prefix = [r.kv_committed_len for r, _ in batch]
    ext = [n for _, n in batch]
    seq = [p + n for p, n in zip(prefix, ext)]
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(
        forward_mode=mode,
        batch_size=len(batch),
        input_ids=t(input_ids),
        positions=t(positions),
        req_pool_indices=t([r.req_pool_idx for r, _ in batch]),
        seq_lens=t(seq),
        extend_prefix_lens=t(prefix),
        extend_seq_lens=t(ext),
        out_cache_loc=out_loc,
        seq_lens_cpu=seq,
        extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=ext,
    )
