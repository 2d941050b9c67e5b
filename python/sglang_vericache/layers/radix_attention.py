"""RadixAttention: the model-side handle of one attention layer; the backend does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglang_vericache.model_executor.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 sliding_window: int | None = None):
        """sliding_window: a query at position p sees the keys at positions > p - sliding_window
        (Hugging Face's sliding-window mask); None: every earlier key."""
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {sliding_window}")
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H*D] or [T, H, D], k/v [T, Hkv*D] or [T, Hkv, D] -> [T, H*D]; hidden [T, hidden_size]:
        the layer's attention input, captured instead of q under forward_batch.capture_hidden (kvzap)."""
        if forward_batch.captured_q is not None:
            src = q
            if forward_batch.capture_hidden:
                if hidden is None:
                    raise ValueError("capture_hidden: this model's attention does not pass its hidden states")
                src = hidden
            forward_batch.captured_q[self.layer_id] = src.reshape(src.shape[0], -1)
        if forward_batch.captured_k is not None:
            forward_batch.captured_k[self.layer_id] = k.reshape(k.shape[0], -1)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
