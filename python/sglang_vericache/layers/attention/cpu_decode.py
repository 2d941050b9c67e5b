"""A DECODE step's attention on a CPU as part of one fused call per decoder layer.

When a step's attention is exactly "write each request's new K/V to the pool at out_cache_loc, then
the batch-invariant CPU kernel over the pool in place" (the torch backend's DECODE path, kernel_decode
on), a model whose layers have a fused CPU op (models/llama.py: sgl_kernel_ext's llama_decode_layer)
passes these operands to it and does the layer in one call: the same kernels on the same operands
as RadixAttention -> TorchNativeAttnBackend.forward -> invariant_attend, so the same bits, without
their ~15 Python-level calls per layer. Any other step (prefill, verify, drafts, staged or mixed
batches, hidden-state capture, a KV pool of another dtype or class) gets no plan and goes the usual way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.torch_metadata import PaddedMetadata

if TYPE_CHECKING:
    from sglang_vericache.model_executor.forward_batch import ForwardBatch

_EMPTY_BOOL = torch.empty(0, dtype=torch.bool)
EMPTY_START = torch.empty(0, dtype=torch.int64)  # no sliding window: every query's keys start at 0


@dataclass
class CpuDecodePlan:
    """The operands of a DECODE step's attention that every layer shares (a layer adds its pool buffers)."""

    loc: torch.Tensor  # [B] int64: the pool slot each request's new K/V is written to
    kv_index: torch.Tensor  # [B, S] int64: the pool slots of each request's keys
    allowed: torch.Tensor  # [B, 1, S] bool (or empty: every key visible)
    k_buffer: list[torch.Tensor]  # per layer [slots, Hkv, D], the pool's (written in place)
    v_buffer: list[torch.Tensor]
    dtype: torch.dtype  # the pool's
    forward_batch: ForwardBatch  # the batch it was planned for (a plan is used for that batch only)

    def buffers(self, fb: ForwardBatch, layer_id: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer layer_id's K / V buffers for batch fb, or None where the plan is another batch's or the pool is
        not in the hidden states' dtype."""
        if fb is not self.forward_batch or dtype != self.dtype:
            return None
        return self.k_buffer[layer_id], self.v_buffer[layer_id]


def cpu_decode_plan(fb: ForwardBatch, md, in_place: bool) -> CpuDecodePlan | None:
    """The plan for this forward, or None where its attention is not the plain in-place DECODE path.
    in_place: the backend's DECODE goes through the CPU kernel (kernel_decode)."""
    if not (in_place and fb.forward_mode.is_decode() and isinstance(md, PaddedMetadata)):
        return None
    if md.q_len != 1 or md.q_index is not None or md.out_index is not None or md.start is not None:
        return None
    if fb.captured_q is not None or fb.captured_k is not None or getattr(fb, "staged", None) is not None:
        return None
    pool = fb.token_to_kv_pool
    # the pool's class says its set_kv_buffer is a plain copy into k_buffer / v_buffer (its own __dict__:
    # a subclass that writes otherwise is not taken for it)
    if not vars(type(pool)).get("in_place_kv_writes", False) or pool.head_dim != pool.v_head_dim:
        return None
    loc = fb.out_cache_loc
    if loc.device.type != "cpu" or loc.dim() != 1 or loc.shape[0] != md.batch_size:
        return None
    index = md.kv_index if md.kv_index.dtype == torch.int64 else md.kv_index.to(torch.int64)
    allowed = _EMPTY_BOOL if md.allowed is None else md.allowed.contiguous()
    return CpuDecodePlan(loc.to(torch.int64).contiguous(), index.contiguous(), allowed, pool.k_buffer,
                         pool.v_buffer, pool.dtype, fb)
