"""Qwen3: Llama with per-head RMSNorm on q and k before RoPE (bias only if attention_bias)."""

from __future__ import annotations

from sglang_vericache.models.llama import AttentionFlags, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_flags(cls, config) -> AttentionFlags:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionFlags(qkv_bias=bias, o_bias=bias, qk_norm=True)
