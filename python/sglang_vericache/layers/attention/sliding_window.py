"""Sliding-window attention for the torch backend's layouts (padded, ragged blocks, staged rows).

A layer with RadixAttention.sliding_window = w lets a query at position p see the keys at positions
> p - w (Hugging Face's sliding_window_overlay on top of the causal mask). In every layout of the
torch backend column j of a request's keys holds position j, and each padded query row knows its
position (`q_pos`), so a layer's window is one more mask term: allowed & (j > q_pos - w). It is built
once per forward and window (the metadata caches it beside the layout) and shared by the window's
layers; global layers keep the layout as it is.

The batch-invariant kernel (--enable-deterministic-inference, and every DECODE step on a CPU) reduces
a query over its visible keys in chunks counted from its first visible key: it gets the window as
that first key (`window_start`, per query row), so it never scans or reads the keys before it. A
row's visible keys are the same in prefill, decode and verify, so those agree bitwise as before.
"""

from __future__ import annotations

import dataclasses

import torch


def query_positions(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, q_len: int) -> torch.Tensor:
    """[B, Lq] int64: the position of padded query row i of request b (prefix_b + i), padding rows
    clamped to the request's last position (they see the same keys as it; their outputs are dropped)."""
    i = torch.arange(q_len, device=seq_lens.device)[None, :]
    return torch.minimum(prefix_lens[:, None] + i, seq_lens[:, None] - 1)


def window_start(q_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, Lq] int64: the first key position a query at q_pos sees in a window of `window` keys."""
    return (q_pos - (window - 1)).clamp_min(0)


def windowed(md, window: int | None, kv_len: int):
    """md (PaddedMetadata, RaggedBlock or StagedMetadata: fields allowed, masks, q_pos, windows) for a
    layer with sliding window `window`: a copy whose mask also hides the keys before each query's window
    (cached in md.windows); md itself where the window hides nothing (every query's window starts at 0)."""
    if window is None or md.q_pos is None:
        return md
    if window not in md.windows:
        start = window_start(md.q_pos, window)
        if not bool(start.any()):
            md.windows[window] = md
        else:
            j = torch.arange(kv_len, device=start.device)[None, None, :]
            inside = j >= start[:, :, None]
            allowed = inside if md.allowed is None else md.allowed & inside
            changes = {"allowed": allowed, "masks": {}, "windows": {}, "start": start}
            if hasattr(md, "causal"):
                changes["causal"] = False
            md.windows[window] = dataclasses.replace(md, **changes)
    return md.windows[window]
