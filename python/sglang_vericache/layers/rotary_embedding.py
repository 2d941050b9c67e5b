"""Rotary position embedding (default, linear, llama3), computed exactly as Hugging Face does.

transformers >= 5 keeps every RoPE parameter in `config.rope_parameters` (rope_type,
rope_theta, factor, ...); older configs keep `rope_theta` and `rope_scaling`. Both are read.
cos/sin are cached in float32 for positions [0, max_position) and cast to the activation
dtype after the gather, as HF casts them to the query dtype.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def get_rope_parameters(config, layer_type: str | None = None) -> dict:
    """A flat dict with at least rope_type and rope_theta. Configs with RoPE parameters per layer kind
    (Gemma 3: {"sliding_attention": {...}, "full_attention": {...}}) need layer_type."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        if "rope_theta" not in params and any(isinstance(v, dict) for v in params.values()):
            if layer_type not in params:
                raise NotImplementedError(f"RoPE parameters per layer kind ({sorted(params)}): name the kind")
            params = dict(params[layer_type])
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] in ("llama3",):
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def compute_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    base = params["rope_theta"]
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float) / dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


_cpu_kernel = None  # sgl_kernel_ext.cpu_rowwise.rotary once use_cpu_kernel() ran


def use_cpu_kernel() -> None:
    """Rotate CPU tensors in one call (sgl_kernel_ext.cpu_rowwise.rotary: the same bits as the torch
    ops below, which a decode step would otherwise dispatch ~14 of per layer)."""
    global _cpu_kernel
    from sgl_kernel_ext import cpu_rowwise

    cpu_rowwise.load()
    _cpu_kernel = torch.ops.sgl_kernel_ext_rowwise.rotary


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, Hkv, D], cos/sin [T, 1, D] (already in q's dtype)."""
    if (_cpu_kernel is not None and q.device.type == "cpu" and q.dim() == 3 and k.dim() == 3 and cos.dim() == 3
            and q.dtype == k.dtype == cos.dtype == sin.dtype and q.stride(-1) == 1 and k.stride(-1) == 1):
        return _cpu_kernel(q, k, cos, sin)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict):
        super().__init__()
        self.head_dim = head_dim
        self.rope_parameters = rope_parameters
        self._build(max_position)

    def _build(self, max_position: int) -> None:
        # Built on the CPU explicitly (the model may be constructed on the meta device) and moved
        # to the activations' device on first use. Not a buffer: never part of a state dict.
        # A position's row is the same in a table of any length (elementwise from its index).
        inv_freq = compute_inv_freq(self.rope_parameters, self.head_dim)
        positions = torch.arange(max_position, device="cpu")
        freqs = positions[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_position = max_position
        self.cos_cache = emb.cos()
        self.sin_cache = emb.sin()

    def reserve(self, max_position: int) -> None:
        """Cover positions [0, max_position): the runtime places work past the context (kvzip's replay)."""
        if max_position > self.max_position:
            self._build(max_position)

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, D] in `dtype`."""
        if self.cos_cache.device != positions.device:
            self.cos_cache = self.cos_cache.to(positions.device)
            self.sin_cache = self.sin_cache.to(positions.device)
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)
