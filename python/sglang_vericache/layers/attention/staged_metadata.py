"""Staged rows' metadata: verify / decode tokens over exact KV streamed in through a StagedKV.

Staged request i (see StagedVerify) reads rows [offsets[i], offsets[i] + prefix_lens[i]) of the
StagedKV's current layer, then its own new tokens' K/V. The torch backend assembles, per layer,
a padded [B, S] key block per request in exactly the pool layout's order ([prefix | new | pad],
S = max(prefix + new)) and uses the pool layout's mask rule, so a staged forward computes the
same SDPA as the forward over the pool. Built once per forward; index math only, no KV read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.sliding_window import query_positions

if TYPE_CHECKING:
    from sglang_vericache.model_executor.forward_batch import StagedVerify


@dataclass
class StagedMetadata:
    """Padded layout of the staged rows: request i's keys are row-major [B, S] =
    [StagedKV rows offsets[i] .. + prefix_lens[i] | its ext_lens[i] new tokens | zeros].
    Meant for few new tokens per request (decode, verify): scores are [B, H, Lq, S], unblocked."""

    batch_size: int
    q_len: int  # Lq = max new tokens
    kv_len: int  # S = max(prefix + new)
    offsets: list[int]
    prefix_lens: list[int]
    ext_lens: list[int]
    q_starts: list[int]  # first new-token row of request i within the staged group
    allowed: torch.Tensor | None  # [B, Lq, S] bool; None = every key visible
    q_index: torch.Tensor | None
    out_index: torch.Tensor | None
    masks: dict[int, torch.Tensor | None] = field(default_factory=dict)
    q_pos: torch.Tensor | None = None  # [B, Lq] position of each padded query (sliding-window layers)
    windows: dict = field(default_factory=dict)  # window -> this layout for that window (sliding_window.py)
    start: torch.Tensor | None = None  # [B, Lq] first visible key of each query (a windowed copy's)


def build_staged_metadata(
    staged: StagedVerify, ext_lens: list[int], prefix_lens: list[int], dev: torch.device
) -> StagedMetadata:
    """ext_lens / prefix_lens: the staged rows' extend_seq_lens / extend_prefix_lens."""
    if list(staged.prefix_lens) != list(prefix_lens):
        raise ValueError(
            f"staged.prefix_lens {staged.prefix_lens} != the rows' extend_prefix_lens {prefix_lens}"
        )
    if min(ext_lens) < 1:
        raise ValueError("every staged row needs at least one new token")
    bs = len(ext_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, ext_lens)]
    max_q, max_s = max(ext_lens), max(seq_lens)
    q_starts = [sum(ext_lens[:i]) for i in range(bs)]
    allowed = None
    if not (max_q == 1 and min(seq_lens) == max_s):  # as the pool layout: a decode batch of equal lengths
        i64 = dict(dtype=torch.int64, device=dev)
        prefix, seq = torch.tensor(prefix_lens, **i64), torch.tensor(seq_lens, **i64)
        i = torch.arange(max_q, device=dev)[None, :, None]
        j = torch.arange(max_s, device=dev)[None, None, :]
        allowed = (j <= prefix[:, None, None] + i) & (j < seq[:, None, None])  # as torch_metadata.causal_mask
    q_index = out_index = None
    if any(e != max_q for e in ext_lens):
        ext = torch.tensor(ext_lens, dtype=torch.int64, device=dev)
        i = torch.arange(max_q, device=dev)[None, :]
        valid = i < ext[:, None]
        starts = torch.tensor(q_starts, dtype=torch.int64, device=dev)
        q_index = torch.where(valid, starts[:, None] + i, torch.zeros_like(i)).flatten()
        out_index = valid.flatten().nonzero().squeeze(1)
    i64 = dict(dtype=torch.int64, device=dev)
    q_pos = query_positions(torch.tensor(prefix_lens, **i64), torch.tensor(seq_lens, **i64), max_q)
    return StagedMetadata(bs, max_q, max_s, list(staged.offsets), list(prefix_lens), list(ext_lens), q_starts,
                          allowed, q_index, out_index, q_pos=q_pos)


def staged_context(rows: torch.Tensor, new: torch.Tensor, md: StagedMetadata, dtype) -> torch.Tensor:
    """[B, S, Hkv, D]: request i = [rows[o_i : o_i + p_i] | new[q_i : q_i + e_i] | zeros (masked)]."""
    out = torch.empty((md.batch_size, md.kv_len, *new.shape[1:]), dtype=dtype, device=new.device)
    for i, (o, p, e, qs) in enumerate(zip(md.offsets, md.prefix_lens, md.ext_lens, md.q_starts)):
        out[i, :p] = rows[o : o + p]
        out[i, p : p + e] = new[qs : qs + e]
        if p + e < md.kv_len:
            out[i, p + e :] = 0
    return out
