"""The torch backend's layouts (torch_backend.py): padded, ragged, and mixed batches.

- padded: every request's queries padded to Lq = max new tokens and its KV gathered to S = max seq_len,
  one batched matmul for the whole batch (DECODE, TARGET_VERIFY, and any EXTEND whose padding waste is small);
- ragged: one matmul per request (EXTEND with very uneven lengths), queries split into blocks so the score
  tensor stays below MAX_SCORE_BYTES;
- mixed: draft rows (DraftMetadata), then resident rows (the padded layout), then staged rows (StagedMetadata).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.draft_metadata import DraftMetadata, draft_metadata_for
from sglang_vericache.layers.attention.sliding_window import query_positions
from sglang_vericache.layers.attention.staged_metadata import StagedMetadata, build_staged_metadata

if TYPE_CHECKING:
    from sglang_vericache.model_executor.forward_batch import ForwardBatch

MAX_SCORE_BYTES = 256 * 1024 * 1024


@dataclass
class PaddedMetadata:
    batch_size: int
    q_len: int  # Lq
    kv_index: torch.Tensor  # [B, S] slots; 0 (the padding slot) beyond seq_len
    allowed: torch.Tensor | None  # [B, Lq, S] bool attention mask; None = every key visible
    q_index: torch.Tensor | None  # [B*Lq] token row of each padded query (None: identity)
    out_index: torch.Tensor | None  # [T] padded row of each real token (None: identity)
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # group size -> SDPA mask
    causal: bool = False  # allowed is exactly tril(Lq, S) with Lq == S: SDPA's is_causal kernel
    q_pos: torch.Tensor | None = None  # [B, Lq] position of each padded query (sliding-window layers)
    windows: dict = field(default_factory=dict)  # window -> this layout for that window (sliding_window.py)
    start: torch.Tensor | None = None  # [B, Lq] first visible key of each query (a windowed copy's)


@dataclass
class MixedMetadata:
    """Requests [0, num_draft) are draft rows (one token each), the next num_resident requests read
    their context from the pool (padded layout), the rest are staged rows."""

    num_draft: int
    draft: DraftMetadata | None
    staged: StagedMetadata | None
    resident: PaddedMetadata | None = None
    resident_tokens: int = 0  # token rows of the resident requests


@dataclass
class RaggedBlock:
    q_start: int  # first token row of this block
    q_len: int
    kv_index: torch.Tensor  # [1, S_block]
    allowed: torch.Tensor  # [1, q_len, S_block]
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)
    causal: bool = False  # as PaddedMetadata.causal
    q_pos: torch.Tensor | None = None  # as PaddedMetadata's
    windows: dict = field(default_factory=dict)
    start: torch.Tensor | None = None


@dataclass
class RaggedMetadata:
    blocks: list[RaggedBlock]


def causal_mask(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, q_len: int, kv_len: int) -> torch.Tensor:
    """[B, q_len, kv_len] bool: query i of request b (position prefix_b + i) sees keys j <= prefix_b + i,
    j < seq_len_b. Padded query rows (i >= extend len) see the whole request, so no row is empty."""
    dev = seq_lens.device
    i = torch.arange(q_len, device=dev)[None, :, None]
    j = torch.arange(kv_len, device=dev)[None, None, :]
    return (j <= prefix_lens[:, None, None] + i) & (j < seq_lens[:, None, None])


def padded_metadata(fb: ForwardBatch, req_to_token: torch.Tensor, ext_lens: list[int], max_q: int, max_s: int,
                    rows: slice = slice(None)) -> PaddedMetadata:
    """The padded layout of requests `rows` of fb (all of them by default)."""
    dev = fb.input_ids.device
    seq_lens = fb.seq_lens[rows].to(dev)
    seq_cpu = (fb.seq_lens_cpu or fb.seq_lens.tolist())[rows]
    prefix_lens = (fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist())[rows]
    kv_index = req_to_token[fb.req_pool_indices[rows], :max_s]
    in_range = torch.arange(max_s, device=dev)[None, :] < seq_lens[:, None]
    kv_index = torch.where(in_range, kv_index, torch.zeros_like(kv_index))
    if max_q == 1 and min(seq_cpu) == max_s:
        allowed = None  # one row per request, every request sees all max_s keys (a decode step)
    else:
        allowed = causal_mask(fb.extend_prefix_lens[rows].to(dev), seq_lens, max_q, max_s)
    q_index = out_index = None
    if any(e != max_q for e in ext_lens):
        ext = fb.extend_seq_lens[rows].to(dev)
        starts = torch.cumsum(ext, 0) - ext
        i = torch.arange(max_q, device=dev)[None, :]
        valid = i < ext[:, None]  # [B, Lq]
        q_index = torch.where(valid, starts[:, None] + i, torch.zeros_like(i)).flatten()
        out_index = valid.flatten().nonzero().squeeze(1)
    causal = (allowed is not None and q_index is None and max_q == max_s and not any(prefix_lens)
              and min(seq_cpu) == max_s)
    q_pos = query_positions(fb.extend_prefix_lens[rows].to(dev), seq_lens, max_q)
    return PaddedMetadata(len(seq_cpu), max_q, kv_index, allowed, q_index, out_index, causal=causal,
                          q_pos=q_pos)


def mixed_metadata(fb: ForwardBatch) -> MixedMetadata:
    """Draft rows first, then resident rows (the padded layout), then staged rows."""
    nd, bs, dev = fb.num_draft, fb.batch_size, fb.input_ids.device
    ext_lens = fb.extend_seq_lens_cpu or fb.extend_seq_lens.tolist()
    prefix_lens = fb.extend_prefix_lens_cpu or fb.extend_prefix_lens.tolist()
    if fb.forward_mode.is_mixed() and fb.draft_ctx is None and fb.staged is None and not fb.num_resident:
        raise ValueError("a MIXED ForwardBatch needs draft rows (draft_ctx), resident rows (num_resident) "
                         "and/or staged rows (staged)")
    if any(e != 1 for e in ext_lens[:nd]):
        raise ValueError("draft rows of a MIXED batch take exactly one new token each")
    n_staged = 0 if fb.staged is None else fb.staged.batch_size
    nr = fb.num_resident
    if nd + nr + n_staged != bs:
        raise ValueError(f"{nd} draft + {nr} resident + {n_staged} staged requests != batch size {bs}")
    r2t = fb.req_to_token_pool.req_to_token
    draft = None
    if nd:
        draft = draft_metadata_for(fb.draft_ctx, fb.req_pool_indices[:nd], r2t, dev)
    resident = None
    if nr:
        rows = slice(nd, nd + nr)
        seq = (fb.seq_lens_cpu or fb.seq_lens.tolist())[rows]
        resident = padded_metadata(fb, r2t, ext_lens[rows], max(ext_lens[rows]), max(seq), rows)
    staged = None
    if n_staged:
        staged = build_staged_metadata(fb.staged, ext_lens[nd + nr:], prefix_lens[nd + nr:], dev)
    return MixedMetadata(nd, draft, staged, resident, sum(ext_lens[nd : nd + nr]))


def ragged_metadata(fb: ForwardBatch, req_to_token: torch.Tensor, seq_lens: list[int], ext_lens: list[int],
                    prefix_lens: list[int], num_heads: int, max_score_bytes: int) -> RaggedMetadata:
    """One block a request, or query blocks of it whose float32 scores stay below max_score_bytes."""
    dev = fb.input_ids.device
    pool_idx = fb.req_pool_indices.tolist()
    blocks: list[RaggedBlock] = []
    q_start = 0
    for r, seq_len, ext, prefix in zip(pool_idx, seq_lens, ext_lens, prefix_lens):
        block = max(1, max_score_bytes // (4 * num_heads * seq_len))
        for b0 in range(0, ext, block):
            q_len = min(block, ext - b0)
            kv_len = prefix + b0 + q_len  # keys this block can see
            allowed = causal_mask(
                torch.tensor([prefix + b0], device=dev), torch.tensor([kv_len], device=dev), q_len, kv_len
            )
            q_pos = torch.arange(prefix + b0, kv_len, device=dev)[None, :]
            blocks.append(RaggedBlock(q_start + b0, q_len, req_to_token[r : r + 1, :kv_len], allowed,
                                      causal=prefix + b0 == 0, q_pos=q_pos))
        q_start += ext
    return RaggedMetadata(blocks)
