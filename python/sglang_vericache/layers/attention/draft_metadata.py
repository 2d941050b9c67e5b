"""DRAFT_DECODE metadata: padded per-request indices over the three parts of a draft context.

A request's context is [compressed rows | exact tail | draft rows] (see DraftContext). The
batch is padded part by part to [B, S_c + S_t + S_d] (S_x = the longest request's part x);
`valid` masks the padding. Padding indices point at real, finite rows (chunk 0, slot 0: the
pools' padding entries, or row 0 of the dequantized chunks), so masked scores stay finite.
Each index is also kept flattened position-major (`[S_x, B]` -> S_x * B), the order in which
the torch backend gathers each part straight into its slice of one [S, B, H, D] buffer.

Built once per forward (index math only, no KV read) and shared by every layer. The
compressed part depends on the layer's layout (token-drop methods may keep a different number
of rows per layer), so it is built lazily per (kind, rows) and cached. Backend-neutral: a fused
kernel can read the same index tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.nn.utils.rnn import pad_sequence

if TYPE_CHECKING:
    from sglang_vericache.compress.base import Layout
    from sglang_vericache.model_executor.forward_batch import DraftContext, ForwardBatch


@dataclass
class CompressedIndex:
    """The compressed part for layers whose layout is (kind, rows)."""

    rows: int  # context rows per chunk (= layout.rows)
    # token_drop: rows of the pool buffer viewed [(num_chunks+1)*rows, H, D] (row id*rows + j);
    # quantized: rows of decompress(chunk_ids) (each distinct chunk dequantized once per layer).
    row_index: torch.Tensor  # [B, C_max*rows]
    flat_index: torch.Tensor  # row_index position-major, [C_max*rows * B]
    chunk_ids: torch.Tensor | None  # quantized: [U] distinct ids, ascending
    valid: torch.Tensor  # [B, C_max*rows] bool


@dataclass
class DraftMetadata:
    batch_size: int
    new_kv: str  # "draft" / "exact": the pool out_cache_loc indexes
    chunk_ids: torch.Tensor  # [B, C_max] int64, 0 = padding
    chunk_valid: torch.Tensor  # [B, C_max] bool
    tail_index: torch.Tensor  # [B, S_t] exact-pool slots, 0 = padding
    tail_valid: torch.Tensor  # [B, S_t] bool
    draft_index: torch.Tensor | None  # [B, S_d] draft-pool slots, 0 = padding; None without drafts
    draft_valid: torch.Tensor | None
    chunk_lens: torch.Tensor  # [B] int64 chunks per request (the fused kernel reads lengths, not masks)
    tail_lens: torch.Tensor  # [B]
    draft_lens: torch.Tensor | None  # [B]; None without drafts
    tail_flat: torch.Tensor = field(init=False)  # position-major [S_t * B]
    draft_flat: torch.Tensor | None = field(init=False)
    compressed: dict[tuple[str, int], CompressedIndex] = field(default_factory=dict)
    masks: dict[tuple[str, int], torch.Tensor | None] = field(default_factory=dict)
    windows: dict[int, DraftMetadata] = field(default_factory=dict)  # sliding window -> windowed_draft's
    # Global budgets (DraftContext.layer_chunks): (layer_chunks, comp_ids, the compressed pool); at_layer()
    # gives each layer's metadata, whose chunk ids are flat chunks (`flat`: read compressed_pool.flat).
    layer_source: tuple | None = None
    flat: bool = False
    layers: dict[int, DraftMetadata] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tail_flat = self.tail_index.T.reshape(-1)
        self.draft_flat = None if self.draft_index is None else self.draft_index.T.reshape(-1)

    def at_layer(self, layer_id: int) -> DraftMetadata:
        """The metadata layer layer_id reads: itself, or under global budgets a copy whose chunks are the
        layer's flat chunks (a request without them: its ids in the layer's own buffer). Cached per layer."""
        if self.layer_source is None:
            return self
        if layer_id not in self.layers:
            layer_chunks, comp_ids, pool = self.layer_source
            dev = self.chunk_ids.device
            seqs = [(pool.layer_chunks(layer_id, ids) if mine is None else mine[layer_id]).to(dev)
                    for mine, ids in zip(layer_chunks, comp_ids)]
            chunk_ids, chunk_valid, chunk_lens = _pad(seqs, dev)
            self.layers[layer_id] = DraftMetadata(
                self.batch_size, self.new_kv, chunk_ids, chunk_valid, self.tail_index, self.tail_valid,
                self.draft_index, self.draft_valid, chunk_lens, self.tail_lens, self.draft_lens, flat=True)
        return self.layers[layer_id]

    def compressed_index(self, layout: Layout) -> CompressedIndex:
        key = (layout.kind, layout.rows)
        if key not in self.compressed:
            self.compressed[key] = _compressed_index(self.chunk_ids, self.chunk_valid, layout)
        return self.compressed[key]

    def mask(self, layout: Layout) -> torch.Tensor | None:
        """[B, 1, 1, S] bool (True = attend) over [compressed | tail | draft]; None if nothing is padding."""
        key = (layout.kind, layout.rows)
        if key not in self.masks:
            parts = [self.compressed_index(layout).valid, self.tail_valid]
            if self.draft_valid is not None:
                parts.append(self.draft_valid)
            valid = torch.cat(parts, 1)
            self.masks[key] = None if bool(valid.all()) else valid[:, None, None, :]
        return self.masks[key]


def windowed_draft(md: DraftMetadata, window: int | None, chunk_size: int) -> DraftMetadata:
    """md for a layer with a sliding window: each request's context without the rows before its window
    (the query at position p sees positions > p - window). Tail and draft rows are cut at their exact
    positions; compressed chunks whole (chunk c holds positions [c*T, (c+1)*T), a token-dropped chunk's
    kept rows are not position-indexed here): the chunks before the window's first chunk are skipped, the
    chunk the window starts in is kept. Chunks keep their ids (and stored positions), so the torch path
    and the fused kernel read them as before. Cached per window; md itself where the window hides nothing."""
    if window is None:
        return md
    if window not in md.windows:
        draft_lens = md.draft_lens if md.draft_lens is not None else torch.zeros_like(md.tail_lens)
        tail_start = md.chunk_lens * chunk_size
        q_pos = tail_start + md.tail_lens + draft_lens - 1
        start = (q_pos - (window - 1)).clamp_min(0)
        if not bool(start.any()):
            md.windows[window] = md
        else:
            skip_c = torch.minimum(start // chunk_size, md.chunk_lens)
            skip_t = torch.minimum((start - tail_start).clamp_min(0), md.tail_lens)
            skip_d = torch.minimum((start - tail_start - md.tail_lens).clamp_min(0), draft_lens)
            chunk_ids, chunk_valid, chunk_lens = _skip(md.chunk_ids, md.chunk_lens, skip_c)
            tail_index, tail_valid, tail_lens = _skip(md.tail_index, md.tail_lens, skip_t)
            draft_index = draft_valid = new_draft_lens = None
            if md.draft_index is not None:
                draft_index, draft_valid, new_draft_lens = _skip(md.draft_index, md.draft_lens, skip_d)
            md.windows[window] = DraftMetadata(md.batch_size, md.new_kv, chunk_ids, chunk_valid, tail_index,
                                               tail_valid, draft_index, draft_valid, chunk_lens, tail_lens,
                                               new_draft_lens, flat=md.flat)
    return md.windows[window]


def _skip(index: torch.Tensor, lens: torch.Tensor, skip: torch.Tensor):
    """Right-padded rows [B, X] (lengths lens) without the first skip[b] of row b ->
    (index [B, X] 0-padded, valid [B, X], lengths)."""
    x = index.shape[1]
    j = torch.arange(x, device=index.device)[None, :]
    new_lens = lens - skip
    valid = j < new_lens[:, None]
    src = (j + skip[:, None]).clamp_max(max(x - 1, 0))
    return torch.where(valid, index.gather(1, src), 0), valid, new_lens


def build_draft_metadata(fb: ForwardBatch) -> DraftMetadata:
    ctx: DraftContext = fb.draft_ctx
    assert ctx is not None, "a DRAFT_DECODE ForwardBatch needs draft_ctx"
    bs = fb.batch_size
    assert len(ctx.comp_ids) == bs and fb.num_tokens == bs, "DRAFT_DECODE: one new token per request"
    r2t = fb.req_to_token_pool.req_to_token
    return draft_metadata_for(ctx, fb.req_pool_indices, r2t, fb.input_ids.device)


def draft_metadata_for(
    ctx: DraftContext, req_pool_indices: torch.Tensor, r2t: torch.Tensor, dev: torch.device
) -> DraftMetadata:
    """The metadata of the draft rows described by ctx (request i = req_pool_indices[i])."""
    bs = len(ctx.comp_ids)
    chunk_ids, chunk_valid, chunk_lens = _pad([ids.to(dev, torch.int64) for ids in ctx.comp_ids], dev)

    # exact tail: req_to_token[req, start : start + len], gathered from the flattened table
    starts = torch.tensor(ctx.tail_starts(), dtype=torch.int64, device=dev)
    lens = torch.tensor(ctx.tail_lens, dtype=torch.int64, device=dev)
    max_t = max(ctx.tail_lens)
    j = torch.arange(max_t, device=dev)[None, :]
    tail_valid = j < lens[:, None]
    flat = req_pool_indices.to(dev)[:, None] * r2t.shape[1] + starts[:, None] + j
    tail_index = torch.where(tail_valid, r2t.view(-1)[torch.where(tail_valid, flat, 0)], 0)

    draft_index = draft_valid = draft_lens = None
    if ctx.new_kv == "draft":
        draft_index, draft_valid, draft_lens = _pad([s.to(dev, torch.int64) for s in ctx.draft_slots], dev)
    layer_source = None
    if ctx.layer_chunks is not None:
        layer_source = (ctx.layer_chunks, ctx.comp_ids, ctx.compressed_pool)
    return DraftMetadata(
        bs, ctx.new_kv, chunk_ids, chunk_valid, tail_index, tail_valid, draft_index, draft_valid,
        chunk_lens, lens, draft_lens, layer_source=layer_source,
    )


def _pad(seqs: list[torch.Tensor], dev) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad with 0 -> ([B, max_len] int64, [B, max_len] valid, [B] lengths)."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64, device=dev)
    padded = pad_sequence(seqs, batch_first=True, padding_value=0)
    valid = torch.arange(padded.shape[1], device=dev)[None, :] < lens[:, None]
    return padded, valid, lens


def _compressed_index(chunk_ids: torch.Tensor, chunk_valid: torch.Tensor, layout: Layout) -> CompressedIndex:
    bs, max_c = chunk_ids.shape
    r = layout.rows
    dev = chunk_ids.device
    valid = chunk_valid[:, :, None].expand(bs, max_c, r).reshape(bs, max_c * r)
    j = torch.arange(r, device=dev)
    if layout.kind == "token_drop":
        row_index = (chunk_ids[:, :, None] * r + j).reshape(bs, max_c * r)
        return CompressedIndex(r, row_index, row_index.T.reshape(-1), None, valid)
    # quantized: dequantize each distinct chunk once (a shared prefix's chunks repeat across requests)
    uniq, inverse = torch.unique(chunk_ids[chunk_valid], return_inverse=True)
    pos = torch.zeros_like(chunk_ids)  # padding -> row 0 of the first chunk (masked)
    pos[chunk_valid] = inverse
    row_index = (pos[:, :, None] * r + j).reshape(bs, max_c * r)
    return CompressedIndex(r, row_index, row_index.T.reshape(-1), uniq, valid)
