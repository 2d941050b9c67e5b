"""Gemma 3 (text: Gemma3ForCausalLM), on the Llama building blocks, computed as Hugging Face's
modeling_gemma3 does:

- token embeddings scaled by sqrt(hidden_size), the scale rounded to the embedding's dtype first;
- Gemma RMSNorm ((1 + weight), float32 throughout), four per layer: input, post-attention,
  pre-feedforward, post-feedforward (attention and MLP outputs are normed before the residual add);
- per-head q / k norms before RoPE, attention scaled by query_pre_attn_scalar ** -0.5;
- a GELU-tanh gated MLP;
- sliding-window layers and global layers (config.layer_types), each kind with its own RoPE
  (config.rope_parameters[layer_type]: base 10,000 local, 1,000,000 global on the released models);
  the window is the attention backend's (RadixAttention.sliding_window);
- optional final-logit softcapping (tanh), applied in the logits' compute dtype as HF does;
- tied embeddings.
Attention-logit softcapping (none of the Gemma 3 releases set it) and bidirectional attention are
refused with a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

from sglang_vericache.layers.activation import GeluAndMul
from sglang_vericache.layers.layernorm import GemmaRMSNorm
from sglang_vericache.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear
from sglang_vericache.layers.radix_attention import RadixAttention
from sglang_vericache.layers.rotary_embedding import RotaryEmbedding
from sglang_vericache.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang_vericache.model_executor.forward_batch import ForwardBatch
from sglang_vericache.models.llama import (
    AttentionFlags,
    LlamaAttention,
    LlamaForCausalLM,
    layer_sliding_window,
)

GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_python_tanh": "tanh", "gelu": "none"}


def check_gemma3_config(config) -> None:
    """Refuse what this implementation does not compute, naming the field."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError(
            f"Gemma 3: attn_logit_softcapping={config.attn_logit_softcapping} is not supported (the attention "
            "backends do not softcap scores); the released Gemma 3 checkpoints leave it null")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("Gemma 3: use_bidirectional_attention (an embedding model) is not supported")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if act not in GELU_APPROXIMATIONS:
        raise NotImplementedError(f"Gemma 3: hidden_activation {act!r} is not supported "
                                  f"(supported: {sorted(GELU_APPROXIMATIONS)})")


def layer_rope_parameters(config, layer_type: str) -> dict:
    """The RoPE parameters of one layer kind: config.rope_parameters[layer_type] (transformers >= 5), else
    the older rope_theta (global) / rope_local_base_freq (sliding) fields."""
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    else:
        local = layer_type == "sliding_attention"
        theta = getattr(config, "rope_local_base_freq", 10000.0) if local else getattr(config, "rope_theta", 1e6)
        params = {"rope_theta": theta, **({} if local else dict(getattr(config, "rope_scaling", None) or {}))}
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", 10000.0)
    return params


class Gemma3MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(h, [i, i], bias=False)
        self.down_proj = RowParallelLinear(i, h, bias=False)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        self.act_fn = GeluAndMul(GELU_APPROXIMATIONS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3Attention(LlamaAttention):
    """Llama's attention with Gemma norms on q and k, query_pre_attn_scalar scaling and the layer's window."""

    def __init__(self, config, layer_id: int):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_id, AttentionFlags(qkv_bias=bias, o_bias=bias))
        self.qk_norm = True
        self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.attn = RadixAttention(self.num_heads, self.head_dim, config.query_pre_attn_scalar**-0.5,
                                   self.num_kv_heads, layer_id, sliding_window=layer_sliding_window(config, layer_id))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int):
        super().__init__()
        self.layer_type = config.layer_types[layer_id]
        self.self_attn = Gemma3Attention(config, layer_id)
        self.mlp = Gemma3MLP(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, hidden, cos, sin, forward_batch: ForwardBatch) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, forward_batch)
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    def __init__(self, config, max_position: int):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = config.hidden_size**0.5
        self.layers = nn.ModuleList([Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # one table per layer kind (no parameters or buffers: never part of a state dict)
        self.rotary_embs = nn.ModuleDict({t: RotaryEmbedding(head_dim, max_position, layer_rope_parameters(config, t))
                                          for t in sorted(set(config.layer_types))})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch):
        hidden = self.embed_tokens(input_ids)
        # HF: embedding * embed_scale.to(weight dtype) (sqrt(640) rounds to 25.25 in bfloat16)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        cos_sin = {t: rope.get_cos_sin(positions, hidden.dtype) for t, rope in self.rotary_embs.items()}
        for layer in self.layers:
            hidden = layer(hidden, *cos_sin[layer.layer_type], forward_batch)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, context_len: int | None = None):
        nn.Module.__init__(self)
        check_gemma3_config(config)
        self.config = config
        context_len = context_len or config.max_position_embeddings
        self.model = Gemma3Model(config, context_len + 64)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        if getattr(config, "tie_word_embeddings", True):
            self.tie_weights()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)  # float32 of the dtype's products: exact in hidden's dtype
        cap = self.final_logit_softcapping
        if cap is None:
            return logits
        # HF softcaps the lm_head's output in the model dtype
        capped = logits.to(hidden.dtype)
        return (torch.tanh(capped / cap) * cap).float()
