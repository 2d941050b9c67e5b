"""Shared machinery of token-dropping compressors: layout, gather, and score helpers.

A token-drop chunk of layer l stores, per KV head, its own kept set of k_l chunk tokens:
  k, v: [k_l, H_kv, D] in the exact dtype; row j of head h = head h's j-th kept token
  idx:  [k_l, H_kv] int16, the chunk-relative index of that token (ascending per head)
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from sglang_vericache.compress.base import CompressedChunk, KVCompressor, Layout, TensorSpec


class TokenDropCompressor(KVCompressor):
    def __init__(self, config):
        super().__init__(config)
        if config.chunk_size > torch.iinfo(torch.int16).max:
            raise ValueError(f"chunk_size {config.chunk_size} does not fit int16 indices")

    def rows(self, layer_id: int) -> int:
        """k_l: kept rows per head for this layer."""
        return min(self.config.budget, self.config.chunk_size)

    def layout(self, layer_id: int) -> Layout:
        c, n = self.config, self.rows(layer_id)
        return Layout(
            kind="token_drop",
            chunk_size=c.chunk_size,
            rows=n,
            tensors=(
                TensorSpec("k", (n, c.num_kv_heads, c.head_dim), c.dtype),
                TensorSpec("v", (n, c.num_kv_heads, c.head_dim), c.dtype),
                TensorSpec("idx", (n, c.num_kv_heads), torch.int16),
            ),
        )

    @abstractmethod
    def select(
        self, layer_id: int, k: torch.Tensor, q: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        """[..., H_kv, k_l] int64 chunk-relative indices to keep, ascending per head."""

    def keep(self, layer_id: int, k: torch.Tensor, v: torch.Tensor, q, positions) -> torch.Tensor:
        """What compress() keeps: select()'s indices; methods that also score values override this."""
        return self.select(layer_id, k, q, positions)

    def compress(self, layer_id, k, v, q=None, positions=None) -> CompressedChunk:
        self._check_kv(k, v)
        rows = self.keep(layer_id, k, v, q, positions).transpose(-1, -2)  # [..., n, H]
        gather = rows[..., None].expand(*rows.shape, k.shape[-1])
        dtype = self.config.dtype
        return CompressedChunk(
            {
                "k": torch.gather(k, -3, gather).to(dtype),
                "v": torch.gather(v, -3, gather).to(dtype),
                "idx": rows.to(torch.int16).contiguous(),
            }
        )

    def decompress(self, layer_id, chunk):
        return chunk["k"].float(), chunk["v"].float()


def recent_indices(k: torch.Tensor, n: int) -> torch.Tensor:
    """[..., H_kv, n]: the chunk's last n token indices, for every head of k [..., T, H_kv, D]."""
    num_tokens = k.shape[-3]
    recent = torch.arange(num_tokens - n, num_tokens, device=k.device)
    return recent.expand(*k.shape[:-3], k.shape[-2], n)


def top_k_indices(scores: torch.Tensor, n: int) -> torch.Tensor:
    """[..., N] scores -> [..., n] indices of the n highest, ties to the lower index, ascending."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :n].sort(dim=-1).values


def attention_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention each key receives from the chunk's trailing queries, summed over them.

    q: [..., W, H_q, D] are the queries of the chunk's last W tokens, k: [..., T, H_kv, D]. Causal
    within the chunk: query i sits at chunk index T - W + i and sees keys 0..T - W + i. Softmax in
    float32 per (query, q-head); summed over queries and over the q-heads of each KV group
    (q-head h belongs to KV head h // (H_q / H_kv), as in HF repeat_kv). Returns [..., H_kv, T].
    """
    num_q, num_heads_q = q.shape[-3:-1]
    num_keys, num_heads_kv = k.shape[-3:-1]
    group = num_heads_q // num_heads_kv
    qf = q.float().unflatten(-2, (num_heads_kv, group)).movedim(-4, -2)  # [..., Hkv, G, W, D]
    kf = k.float().movedim(-3, -1).unsqueeze(-3)  # [..., Hkv, 1, D, T]
    logits = torch.matmul(qf, kf) * scale  # [..., Hkv, G, W, T]
    qpos = torch.arange(num_keys - num_q, num_keys, device=k.device)
    mask = torch.arange(num_keys, device=k.device)[None, :] > qpos[:, None]  # [W, T] future keys
    probs = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
    return probs.sum(dim=(-3, -2))
