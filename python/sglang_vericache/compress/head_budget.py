"""Head-adaptive budgets (AdaKV, Feng et al. 2024; kvpress AdaKVPress): one layer's kept tokens chosen by
one top-k over every (KV head, token) score, so a head whose attention is spread keeps more tokens and a
head whose attention is peaked keeps fewer, within the layer's total budget (H_kv * kept per head).

Selection (`adaptive_keep`), kvpress's rule: each head first keeps its top n_safe = max(1, floor(kept *
alpha_safeguard)) tokens (they are scored the maximum), then the H_kv * kept highest scores over all heads
are kept; ties go to the lower (head, token) index.

Storage (`deal_cells`): a token-drop chunk stores k, v [R, H_kv, D] and idx [R, H_kv], cell (j, c) being
KV head c's j-th kept token. With adaptive budgets a head may keep more tokens than its column has cells
over the segment, so each cell also names its head: `head` [R, H_kv] int8, and cell (j, c) holds the K / V
of token idx[j, c] of KV head head[j, c] (its column is only where it is stored). The kept cells are laid
out in (token, head) order, R * H_kv to a chunk. Draft attention of KV head h reads the cells whose head is
h (a softmax over rows whose RoPE is applied: their place does not matter): the fused CPU kernel
(sgl_kernel_ext cpu_draft_attention) and the torch path (torch_backend._forward_draft) both do, the
Triton kernel hands such layers to the torch path. Page-scope compress() of an adaptive compressor keeps
every head's own uniform selection (head[j, c] = c).

Global budgets (config.head_budget == "global"; kvpress KVzipPress's default, KVzap's one threshold over
the model): one top-k over every layer's (head, token) scores, so a layer whose scores are high keeps more
cells and another fewer, within the segment's total (`global_keep`). Storage stays the pool's: a segment of
n pages owns n chunk ids, each naming a chunk in every layer's buffer, L * n chunks of R * H_kv cells in all;
they are dealt to the layers by their budgets (layer l gets c_l of them, sum c_l = L * n), so a layer's
cells may sit in another layer's buffer (CompressedKVPool.layer_chunks). A layer's count is its share of the
top-k rounded to whole chunks (largest remainder, at most its tokens), then its own top c_l * R * H_kv cells.
"""

from __future__ import annotations

from fractions import Fraction

import torch


def adaptive_keep(scores: torch.Tensor, kept: int, alpha_safeguard: float) -> torch.Tensor:
    """scores [H, S] (float; +inf: always kept) -> kept mask [H, S] bool with H * kept True: each head's
    top max(1, floor(kept * alpha_safeguard)) first, then the highest over all heads (ties: lower index)."""
    num_heads, num_tokens = scores.shape
    if not 0 < kept <= num_tokens:
        raise ValueError(f"adaptive_keep: kept {kept} must be in [1, {num_tokens}]")
    scores = scores.float().clone()
    n_safe = max(1, int(kept * alpha_safeguard)) if alpha_safeguard > 0 else 0
    if n_safe:
        safe = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :n_safe]
        top = torch.finfo(torch.float32).max
        scores.scatter_(-1, safe, torch.where(scores.gather(-1, safe) == float("inf"), float("inf"), top))
    order = torch.sort(scores.flatten(), descending=True, stable=True).indices[: num_heads * kept]
    mask = torch.zeros(num_heads * num_tokens, dtype=torch.bool, device=scores.device)
    mask[order] = True
    return mask.view(num_heads, num_tokens)


def deal_cells(mask: torch.Tensor, n: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """mask [H, S] with n * rows * H kept cells -> (token [n, rows, H], head [n, rows, H]) int64: the kept
    (token, head) pairs in (token, head) order, rows * H to a chunk."""
    num_heads = mask.shape[0]
    token, head = mask.T.nonzero(as_tuple=True)  # row-major over [S, H]: token order, then head
    assert len(token) == n * rows * num_heads, f"{len(token)} kept cells are not {n} chunks of {rows} x {num_heads}"
    return token.view(n, rows, num_heads), head.view(n, rows, num_heads)


def own_heads(shape: tuple[int, ...], num_heads: int, device) -> torch.Tensor:
    """head [..., R, H] int8 for a uniform selection: cell (j, c) is head c's."""
    return torch.arange(num_heads, dtype=torch.int8, device=device).expand(*shape, num_heads).contiguous()


def global_keep(scores: list[torch.Tensor], n: int, rows: int) -> tuple[list[torch.Tensor], list[int]]:
    """scores: per layer [H, S] (float; +inf: always kept) of one segment of n pages, every layer's uniform
    budget rows per page -> (masks [H, S] bool, chunks c_l): one top-k of L * n * rows * H over every layer's
    cells (ties: lower layer, head, token), each layer's count rounded to whole chunks of rows * H cells
    (largest remainder, ties: lower layer; at most S // rows chunks) so that sum c_l = L * n; mask l keeps
    layer l's own top c_l * rows * H cells (the same order)."""
    num_layers, (num_heads, num_tokens) = len(scores), scores[0].shape
    flat = torch.cat([s.float().flatten() for s in scores])
    order = torch.sort(flat, descending=True, stable=True).indices[: num_layers * n * rows * num_heads]
    counts = torch.bincount(order // (num_heads * num_tokens), minlength=num_layers).tolist()
    per_chunk = rows * num_heads
    chunks = whole_chunks([Fraction(c, per_chunk) for c in counts], num_layers * n, num_tokens // rows)
    masks = [adaptive_keep(s, c * rows, 0.0) if c else torch.zeros(s.shape, dtype=torch.bool, device=s.device)
             for s, c in zip(scores, chunks)]
    return masks, chunks


def whole_chunks(shares: list[Fraction], total: int, cap: int) -> list[int]:
    """Each layer's real share of a segment's chunks -> whole chunks summing to total: the floors, then one
    more to the layers with the largest remainders (ties: lower layer), none past cap (its tokens)."""
    chunks = [min(int(s), cap) for s in shares]
    by_remainder = sorted(range(len(shares)), key=lambda layer: (-(shares[layer] - int(shares[layer])), layer))
    assert sum(chunks) <= total <= cap * len(shares), f"{total} chunks do not fit {len(shares)} layers of {cap}"
    while sum(chunks) < total:
        for layer in by_remainder:
            if sum(chunks) < total and chunks[layer] < cap:
                chunks[layer] += 1
    return chunks
