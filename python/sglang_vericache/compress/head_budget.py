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
"""

from __future__ import annotations

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
