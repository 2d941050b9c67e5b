"""The torch path's DRAFT_DECODE attention over head-tagged token-drop chunks (head-adaptive budgets,
compress/head_budget.py): a chunk's cell (j, c) holds the K / V of KV head head[j, c], so KV head h
attends to the cells tagged h, wherever they are stored.

The compressed part is read as cells, each cell one row shared by every KV head (like an MQA key) and
masked per head: KV head h sees the cells whose tag is h, then its tail and draft rows as usual. Under
deterministic inference each KV head is one call of the batch-invariant kernel over its own mask.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.torch_attend import gather_parts, grouped_sdpa, invariant_kernel

if TYPE_CHECKING:
    from sglang_vericache.layers.attention.draft_metadata import CompressedIndex, DraftMetadata


def tagged_draft_attention(q, layer, bufs: dict, ci: CompressedIndex, md: DraftMetadata, rest: list,
                           deterministic: bool, kernel=None) -> torch.Tensor:
    """q [B, H, D] over [the cells of ci's chunks, masked per head by bufs["head"] | rest's parts] ->
    [B, H*Dv]. rest: (K source, V source, position-major flat index) of the tail and draft parts."""
    bs, hkv, d, dv = md.batch_size, layer.num_kv_heads, layer.head_dim, layer.v_head_dim
    heads = torch.arange(hkv, device=q.device)
    cell = (ci.row_index[:, :, None] * hkv + heads).reshape(bs, -1)  # [B, S_c]: rows * H_kv cells
    cell_valid = ci.valid[:, :, None].expand(-1, -1, hkv).reshape(bs, -1)
    tags = bufs["head"].view(-1).index_select(0, cell.reshape(-1)).view(bs, -1).long()
    comp_allowed = cell_valid[:, None, :] & (tags[:, None, :] == heads[None, :, None])  # [B, H_kv, S_c]
    k_cells = bufs["k"].view(-1, 1, d).expand(-1, hkv, -1)  # cell i's row, seen by every head
    v_cells = bufs["v"].view(-1, 1, dv).expand(-1, hkv, -1)
    parts = [(k_cells, v_cells, cell.T.reshape(-1)), *rest]
    k_ctx, v_ctx, s = gather_parts(parts, bs, q)
    rest_valid = [md.tail_valid] + ([md.draft_valid] if md.draft_valid is not None else [])
    rest_allowed = torch.cat(rest_valid, 1)[:, None, :].expand(-1, hkv, -1)
    allowed = torch.cat([comp_allowed, rest_allowed], 2)  # [B, H_kv, S]
    if not deterministic:
        keys = k_ctx.view(s, bs, hkv, d).permute(1, 2, 0, 3)  # [B, H_kv, S, D]
        values = v_ctx.view(s, bs, hkv, dv).permute(1, 2, 0, 3)
        return grouped_sdpa(q, keys, values, allowed[:, :, None, :], bs, 1, layer)
    # key j of request b is row j * bs + b of the context; one batch-invariant call per KV head
    index = torch.arange(s * bs, device=q.device).view(s, bs).T
    g = q.shape[1] // hkv
    outs = []
    for h in range(hkv):
        qh = q[:, h * g : (h + 1) * g].reshape(bs, 1, g, d)
        outs.append(invariant_kernel(qh, k_ctx[:, h : h + 1].contiguous(), v_ctx[:, h : h + 1].contiguous(), index,
                                     allowed[:, h : h + 1], layer, kernel))
    return torch.cat(outs, dim=1)
