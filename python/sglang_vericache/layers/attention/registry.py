"""Attention backends by name. Each entry imports its module lazily (GPU-only code stays unimported)."""

from __future__ import annotations

import importlib

from sglang_vericache.layers.attention.base import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "torch": "sglang_vericache.layers.attention.torch_backend:TorchNativeAttnBackend",
    "triton": "sglang_vericache.layers.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "sglang_vericache.layers.attention.flashinfer_backend:FlashInferAttnBackend",
}


def get_attention_backend_class(name: str) -> type[AttentionBackend]:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKENDS)}")
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)


def create_attention_backend(name: str, model_runner) -> AttentionBackend:
    return get_attention_backend_class(name)(model_runner)
