"""AttentionBackend: the interface every attention implementation provides."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.model_executor.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Called once per forward, before the first layer: precompute what all layers share."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """Write k/v of the new tokens to out_cache_loc (if save_kv_cache), attend; -> [T, H*Dv]."""
