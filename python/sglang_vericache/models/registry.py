"""Model classes by HF architecture name (config.json "architectures"), imported lazily."""

from __future__ import annotations

import importlib

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "sglang_vericache.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "sglang_vericache.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "sglang_vericache.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "sglang_vericache.models.qwen3:Qwen3ForCausalLM",
    "Gemma3ForCausalLM": "sglang_vericache.models.gemma3:Gemma3ForCausalLM",
}


def get_model_class(architecture: str) -> type:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"model architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    module_name, cls_name = MODEL_REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module_name), cls_name)
