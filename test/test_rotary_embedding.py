"""Our RoPE tables equal Hugging Face's (default and llama3 scaling, old and new config formats)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from sglang_vericache.layers.rotary_embedding import RotaryEmbedding, compute_inv_freq, get_rope_parameters

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def config(rope_scaling: dict | None) -> LlamaConfig:
    return LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=131072,
                       rope_theta=500000.0, rope_scaling=rope_scaling)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_cos_sin_equal_hf_at_far_positions(rope_scaling):
    cfg = config(rope_scaling)
    positions = torch.tensor([0, 1, 17, 4095, 8192, 100000, 131071])
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[None])
    ours = RotaryEmbedding(128, 131072, get_rope_parameters(cfg))
    cos, sin = ours.get_cos_sin(positions, torch.float32)
    assert torch.equal(cos[:, 0], hf_cos[0]) and torch.equal(sin[:, 0], hf_sin[0])


def test_llama3_scaling_changes_low_frequencies_only():
    base = compute_inv_freq(get_rope_parameters(config(None)), 128)
    scaled = compute_inv_freq(get_rope_parameters(config(LLAMA3)), 128)
    assert torch.equal(scaled[0], base[0])  # highest frequency untouched
    assert torch.allclose(scaled[-1], base[-1] / 8.0)  # lowest divided by the factor


def test_unsupported_rope_type_is_refused():
    with pytest.raises(NotImplementedError, match="rope_type 'yarn' is not supported"):
        compute_inv_freq({"rope_type": "yarn", "rope_theta": 10000.0}, 64)
