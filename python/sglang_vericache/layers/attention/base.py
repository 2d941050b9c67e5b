"""AttentionBackend: the interface every attention implementation provides."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_vericache.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    forward_metadata: Any = None  # what init_forward_metadata built for this forward (every layer reads it)

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Called once per forward, before the first layer: precompute what all layers share."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Write k/v of the new tokens to out_cache_loc (if save_kv_cache), attend; -> [T, H*Dv]. The
        metadata init_forward_metadata built picks the path (forward_with)."""
        return self.forward_with(self.forward_metadata, q, k, v, layer, forward_batch, save_kv_cache)

    @abstractmethod
    def forward_with(self, md: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                     fb: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        """forward over metadata md: a backend runs the kinds it built and hands the others to the
        backend it extends (super().forward_with)."""

    @staticmethod
    def save_kv(pool: MHATokenToKVPool, layer: RadixAttention, out_loc: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor) -> None:
        """Writes the new tokens' k/v ([T, Hkv*D] or [T, Hkv, D]) to pool slots out_loc of layer."""
        t = k.shape[0]
        pool.set_kv_buffer(layer.layer_id, out_loc, k.reshape(t, layer.num_kv_heads, layer.head_dim),
                           v.reshape(t, layer.num_kv_heads, layer.v_head_dim))
