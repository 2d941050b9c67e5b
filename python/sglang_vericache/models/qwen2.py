"""Qwen2 / Qwen2.5: Llama with bias on q/k/v (not on o_proj)."""

from __future__ import annotations

from sglang_vericache.models.llama import AttentionFlags, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_flags(cls, config) -> AttentionFlags:
        return AttentionFlags(qkv_bias=True, o_bias=False)
