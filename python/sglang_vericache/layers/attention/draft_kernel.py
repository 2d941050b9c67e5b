"""The fused CPU path of DRAFT_DECODE attention (sgl_kernel_ext.cpu_draft_attention).

One C++ call per layer reads a request's [compressed rows | exact tail | draft rows] where they are
stored: token-dropped rows as kept, quantized codes (int8, fp8, kivi 2/4, kvquant 3/4, rotatekv 2/4,
and a dropper followed by any of them) dequantized inside the kernel, with no gathered or
dequantized copy of the context (kvquant / rotatekv: RoPE is put back on the pre-RoPE keys with
the compressor's own cos / sin table, rotatekv's Hadamard transform undone row by row). Its reduction is batch invariant
(fixed 64-key chunks in key order, float32 online softmax) and its dequantized rows are the
compressors' decompress() rows in float32, not rounded to q's dtype: in a bfloat16 / float16 model
the torch path (torch_backend._forward_draft: gathers, dequantized copies and SDPA, or the
fixed-chunk kernel under deterministic inference) holds them in that dtype, so the two paths differ
by that rounding (the kernel's rows are the closer to the compressor's values; rounding them cost
bfloat16 drafting ~10% on a Xeon). Drafts are checked by the verifier, so the output is full mode's
either way.

The torch backend takes this path for every DRAFT_DECODE layer on a CPU when the kernel builds
(once, cached per source and CPU like the deterministic kernel) and the layer's layout is one it
reads; otherwise the torch path, with one warning saying why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from sglang_vericache.layers.attention.torch_attend import kernel_loads

if TYPE_CHECKING:
    from sglang_vericache.layers.attention.draft_metadata import DraftMetadata
    from sglang_vericache.layers.radix_attention import RadixAttention
    from sglang_vericache.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_vericache.model_executor.forward_batch import DraftContext

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def fused_draft_available() -> bool:
    """Whether the fused kernel is built and loaded."""
    return kernel_loads("cpu_draft_attention", logger, "draft attention: the fused CPU kernel is unavailable, "
                        "drafting takes the slower torch path (gathered and dequantized copies)")


def _fits(q: torch.Tensor, layer: RadixAttention) -> str | None:
    """Why the kernel cannot take this call, or None."""
    if q.device.type != "cpu":
        return f"device {q.device.type}"
    if layer.head_dim % 8 or layer.v_head_dim % 8:
        return f"head dims {layer.head_dim}/{layer.v_head_dim} are not multiples of 8"
    return None


def _rope_and_rotation(pool, lid: int, md: DraftMetadata) -> tuple:
    """kvquant / rotatekv (alone or after a dropper): the quantizer's own RoPE table, grown to cover
    every position the batch's chunks hold (chunk i of a request holds positions below (i + 1) * T),
    and rotatekv's Hadamard grouping; () for other compressors."""
    quant = pool.compressor
    if hasattr(quant, "stage"):  # a composition: the quantizer of this layer's kept-row count
        quant = quant.stage(lid)
    rope = getattr(quant, "rope", None)
    if rope is None or not hasattr(quant, "dequantize"):
        return ()
    bound = int(md.chunk_lens.max()) * pool.compressor.config.chunk_size if md.chunk_lens.numel() else 1
    table = rope.table(torch.tensor([max(bound, 1)]))
    rotation = (quant.key_heads, quant.block) if hasattr(quant, "key_heads") else None
    return table, rotation


def fused_draft_attention(
    q: torch.Tensor,  # [B, H, D]
    layer: RadixAttention,
    ctx: DraftContext,
    exact: MHATokenToKVPool,
    md: DraftMetadata,
    unwindowed: DraftMetadata | None = None,
) -> torch.Tensor | None:
    """-> [B, H*Dv] in q's dtype; None when the kernel does not read this layer (torch path).
    unwindowed: where md is a sliding-window layer's context (draft_metadata.windowed_draft: leading
    chunks skipped), the whole context, whose chunk counts bound the positions kvquant's / rotatekv's
    RoPE table must cover (the kernel reads each row's stored position)."""
    from sgl_kernel_ext.cpu_draft_attention import compressed_layer, draft_decode_attention

    lid = layer.layer_id
    pool = ctx.compressed_pool
    comp = compressed_layer(pool.layouts[lid].kind, pool.flat if md.flat else pool.buffers[lid],
                            *_rope_and_rotation(pool, lid, unwindowed or md))
    why = _fits(q, layer) or (None if comp is not None else f"{pool.compressor.name}'s layout")
    if why is not None:
        if why not in _warned:
            _warned.add(why)
            logger.warning("draft attention: the fused CPU kernel does not read %s; torch path", why)
        return None
    tail = (exact.get_key_buffer(lid), exact.get_value_buffer(lid), md.tail_index, md.tail_lens)
    draft = None
    if md.draft_index is not None:
        dp = ctx.draft_pool
        draft = (dp.get_key_buffer(lid), dp.get_value_buffer(lid), md.draft_index, md.draft_lens)
    # Dequantized rows are read in float32 (not rounded to q's dtype: the module docstring).
    out = draft_decode_attention(q, comp, md.chunk_ids, md.chunk_lens, tail, draft, layer.scaling, torch.float32)
    return out.to(q.dtype).reshape(q.shape[0], -1)
