"""The bundled default model (python/sglang_vericache/assets/vericache-code-tiny) is what its card says.

Loads it through `transformers` on CPU (float32); the recipe that made it is recipes/code_model/.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import sglang_vericache

MODEL_DIR = Path(sglang_vericache.__file__).parent / "assets" / "vericache-code-tiny"
CODE = 'def f(x, *args, **kw):\n    """Doc."""\n\tif x  >= 1:\n        return {"a": [x, \'ü\']}  # ok\n\n'


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((MODEL_DIR / "config.json").read_text())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def test_config_is_a_gqa_llama_with_head_dim_64(config: dict) -> None:
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["head_dim"] == 64
    assert config["hidden_size"] == 256
    assert config["num_hidden_layers"] == 8
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 768
    assert config["vocab_size"] == 6144
    assert config["max_position_embeddings"] == 2048
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)


def test_weights_are_bf16_safetensors_under_40_mb() -> None:
    path = MODEL_DIR / "model.safetensors"
    assert path.stat().st_size <= 40 * 1024 * 1024
    with safe_open(path, "pt") as f:
        names = f.keys()
        assert {str(f.get_slice(k).get_dtype()) for k in names} == {"BF16"}


def test_model_loads_in_transformers_with_5_to_20_m_params(model) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == 7_868_672
    assert 5_000_000 <= n_params <= 20_000_000
    logits = model(input_ids=torch.tensor([[1, 320, 290, 794]])).logits
    assert logits.shape == (1, 4, 6144)
    assert torch.isfinite(logits).all()


def test_tokenizer_prepends_bos_and_round_trips_code(tokenizer) -> None:
    ids = tokenizer(CODE).input_ids
    assert ids[0] == tokenizer.bos_token_id == 1
    assert ids.count(1) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == CODE
    assert tokenizer.decode(ids) == "<s>" + CODE


def test_special_tokens(tokenizer) -> None:
    assert tokenizer.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]) == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<s>", "</s>", "<pad>")


def test_chat_template_renders_chatml(tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Write f."},
        {"role": "assistant", "content": "def f():\n    pass"},
    ]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nWrite f.<|im_end|>\n<|im_start|>assistant\ndef f():\n    pass<|im_end|>\n"
    )
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWrite f.<|im_end|>\n<|im_start|>assistant\n"


def test_generation_config_is_greedy_and_stops_at_eos_and_im_end() -> None:
    gen = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 4]
    assert gen["do_sample"] is False
