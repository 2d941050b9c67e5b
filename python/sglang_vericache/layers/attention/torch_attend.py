"""The attention arithmetic of the torch path (TorchNativeAttnBackend and the backends that fall back
to it): SDPA over gathered K/V with a boolean mask, GQA by grouping query heads (never copying K/V),
and the batch-invariant kernel (--enable-deterministic-inference) reading the pool in place.
Every function returns [B*Lq, H*Dv] rows in request-major order."""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sglang_vericache.layers.attention.torch_metadata import PaddedMetadata, RaggedBlock
    from sglang_vericache.layers.radix_attention import RadixAttention

logger = logging.getLogger(__name__)
_loaded: dict[str, bool] = {}  # sgl_kernel_ext module -> whether its CPU kernel loaded (tried once per process)


def kernel_loads(module: str, log: logging.Logger, fallback: str) -> bool:
    """Whether sgl_kernel_ext.<module>'s CPU kernel builds and loads, tried once per process; if not,
    one warning on `log` saying what runs instead (`fallback`) and why."""
    if module not in _loaded:
        try:
            importlib.import_module(f"sgl_kernel_ext.{module}").load()
            _loaded[module] = True
        except (ImportError, RuntimeError) as exc:
            log.warning("%s: %s", fallback, exc)
            _loaded[module] = False
    return _loaded[module]


def cpu_kernel_available() -> bool:
    """Whether the batch-invariant CPU kernel is built and loaded."""
    return kernel_loads("cpu_attention", logger, "attention: the CPU fixed-chunk kernel is unavailable, decode "
                        "steps gather the KV for SDPA (slower)")


def sdpa_mask(md: PaddedMetadata | RaggedBlock, group: int) -> torch.Tensor | None:
    """The mask for query rows ordered (group g, query i) -> row g*Lq + i: [B, 1, G*Lq, S] (cached)."""
    if md.allowed is None:
        return None
    if group not in md.masks:
        bs, q_len, s = md.allowed.shape
        if q_len == 1:
            md.masks[group] = md.allowed[:, None]  # [B, 1, 1, S] broadcasts over the group
        else:
            md.masks[group] = md.allowed[:, None, None].expand(bs, 1, group, q_len, s).reshape(bs, 1, -1, s)
    return md.masks[group]


def sdpa_attend(
    q: torch.Tensor,  # [B*Lq, H, D], request-major
    k_buf: torch.Tensor,  # [num_slots, Hkv, D]
    v_buf: torch.Tensor,  # [num_slots, Hkv, Dv]
    md: PaddedMetadata | RaggedBlock,  # kv_index [B, S] and the mask
    bs: int,
    q_len: int,
    layer: RadixAttention,
) -> torch.Tensor:
    """-> [B*Lq, H*Dv]."""
    h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    g = h // hkv
    s = md.kv_index.shape[1]
    flat = md.kv_index.reshape(-1)
    keys = k_buf.index_select(0, flat).view(bs, s, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
    values = v_buf.index_select(0, flat).view(bs, s, hkv, -1).transpose(1, 2)  # [B, Hkv, S, Dv]
    if keys.dtype != q.dtype:
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if md.causal:  # a prompt from position 0: the causal kernel skips the masked half of the scores
        qh = q.view(bs, q_len, h, d).transpose(1, 2)  # [B, H, Lq, D]; head i reads KV head i // g
        out = F.scaled_dot_product_attention(qh, keys, values, is_causal=True, scale=layer.scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).reshape(bs * q_len, -1)
    return grouped_sdpa(q, keys, values, sdpa_mask(md, g), bs, q_len, layer)


def invariant_kernel(q, k_src, v_src, index, allowed, layer: RadixAttention, kernel=None,
                     start: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Lq, H, D] over rows index [B, S] of k_src / v_src [N, Hkv, D] -> [B*Lq, H*Dv] in q's dtype,
    through `kernel` (fixed_chunk_attention's interface; None: the CPU kernel). start [B, Lq]: each
    query's first visible key (a sliding window, which `allowed` also holds): the CPU kernel skips the
    keys before it."""
    if kernel is None:
        from sgl_kernel_ext.cpu_attention import fixed_chunk_attention

        out = fixed_chunk_attention(q, k_src, v_src, index, allowed, layer.scaling, start)
    else:
        out = kernel(q, k_src, v_src, index, allowed, layer.scaling)
    return out.to(q.dtype).reshape(q.shape[0] * q.shape[1], -1)


def invariant_attend(q, k_buf, v_buf, md: PaddedMetadata | RaggedBlock, bs: int, q_len: int,
                      layer: RadixAttention, kernel=None) -> torch.Tensor:
    """attend through the batch-invariant kernel, reading the pool in place (no gather)."""
    index, allowed = md.kv_index, md.allowed
    if k_buf.dtype != q.dtype:  # --kv-cache-dtype: gather, then read in the compute dtype
        s = index.shape[1]
        k_buf = k_buf.index_select(0, index.reshape(-1)).to(q.dtype)
        v_buf = v_buf.index_select(0, index.reshape(-1)).to(q.dtype)
        index = torch.arange(bs * s, device=q.device).view(bs, s)
    return invariant_kernel(q.view(bs, q_len, *q.shape[1:]), k_buf, v_buf, index, allowed, layer, kernel,
                            getattr(md, "start", None))


def invariant_context(q, keys, values, allowed, bs: int, q_len: int, layer: RadixAttention,
                       kernel=None, start: torch.Tensor | None = None) -> torch.Tensor:
    """q [B*Lq, H, D] over assembled contexts keys / values [B, S, Hkv, D] -> [B*Lq, H*Dv]."""
    s = keys.shape[1]
    index = torch.arange(bs * s, device=q.device).view(bs, s)
    return invariant_kernel(q.view(bs, q_len, *q.shape[1:]), keys.reshape(bs * s, *keys.shape[2:]),
                             values.reshape(bs * s, *values.shape[2:]), index, allowed, layer, kernel, start)


def grouped_sdpa(
    q: torch.Tensor,  # [B*Lq, H, D], request-major
    keys: torch.Tensor,  # [B, Hkv, S, D]
    values: torch.Tensor,  # [B, Hkv, S, Dv]
    mask: torch.Tensor | None,  # [B, 1, G*Lq or 1, S] bool
    bs: int,
    q_len: int,
    layer: RadixAttention,
) -> torch.Tensor:
    """GQA without copying K/V: query heads grouped by their KV head, rows ordered (g, i). -> [B*Lq, H*Dv]."""
    hkv, d = layer.num_kv_heads, layer.head_dim
    g = layer.num_heads // hkv
    qg = q.view(bs, q_len, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(bs, hkv, g * q_len, d)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=layer.scaling)
    return out.view(bs, hkv, g, q_len, -1).permute(0, 3, 1, 2, 4).reshape(bs * q_len, -1)


def gather_parts(parts: list, bs: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(K source, V source, position-major flat index) per part, sources [rows, Hkv, D] -> the context
    k_ctx, v_ctx [S * bs, Hkv, D] in q's dtype, position-major (key j of request b is row j * bs + b), and S.
    Each part is gathered straight into its slice (no concat)."""
    s = sum(len(p[2]) for p in parts) // bs
    k_src0, v_src0, _ = parts[0]
    k_ctx = torch.empty((s * bs, *k_src0.shape[1:]), dtype=q.dtype, device=q.device)
    v_ctx = torch.empty((s * bs, *v_src0.shape[1:]), dtype=q.dtype, device=q.device)
    row = 0
    for k_src, v_src, flat in parts:
        gather_into(k_ctx[row : row + len(flat)], k_src, flat)
        gather_into(v_ctx[row : row + len(flat)], v_src, flat)
        row += len(flat)
    return k_ctx, v_ctx, s


def gather_into(out: torch.Tensor, src: torch.Tensor, index: torch.Tensor) -> None:
    """out[i] = src[index[i]] (out contiguous), converting dtype if needed."""
    if len(index) == 0:
        return
    if src.dtype == out.dtype:
        torch.index_select(src, 0, index, out=out)
    else:
        out.copy_(src.index_select(0, index))
