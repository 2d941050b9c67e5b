"""A bad --model-path fails at start-up with an error that names the path and the problem."""

from __future__ import annotations

import os
import shutil

import pytest

from sglang_vericache.layers.attention.registry import get_attention_backend_class
from sglang_vericache.model_config import ModelConfig
from sglang_vericache.model_executor.model_runner import ModelRunner
from sglang_vericache.models.registry import get_model_class
from sglang_vericache.server_args import ServerArgs
from sglang_vericache.testing import make_random_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_random_checkpoint("llama", str(tmp_path_factory.mktemp("ckpt") / "llama"))


def runner_for(path: str, **kw) -> ModelRunner:
    return ModelRunner(ServerArgs(model_path=path, page_size=4, max_total_tokens=256, **kw))


def test_missing_folder_raises_file_not_found(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="model folder not found.*nope"):
        runner_for(missing)


def test_folder_without_config_json_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        runner_for(str(tmp_path))


def test_folder_without_safetensors_raises_file_not_found(llama_dir, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(os.path.join(llama_dir, "config.json"), bare)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors weights in model folder .*bare"):
        runner_for(str(bare))


def test_index_naming_a_missing_shard_raises(tmp_path):
    path = make_random_checkpoint("llama", str(tmp_path / "sh"), max_shard_size="100KB")
    os.remove(os.path.join(path, "model-00002-of-00006.safetensors"))
    with pytest.raises(FileNotFoundError, match="names missing shards"):
        runner_for(path)


def test_unsupported_architecture_lists_supported_ones():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_unknown_attention_backend_lists_available_ones():
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'; available: \['flashinfer', 'torch', 'triton'\]"):
        get_attention_backend_class("flash")


def test_sliding_window_on_a_backend_without_one_is_refused(tmp_path):
    path = make_random_checkpoint("mistral", str(tmp_path / "m"), sliding_window=32)
    with pytest.raises(ValueError, match=r"MistralForCausalLM \(.*\) has sliding-window attention layers \(window "
                                         r"32\), which --attention-backend triton does not implement; use "
                                         r"--attention-backend torch"):
        runner_for(path, attention_backend="triton")
    assert runner_for(path).model.model.layers[0].self_attn.attn.sliding_window == 32


def test_model_config_fields(llama_dir):
    cfg = ModelConfig.from_path(llama_dir)
    assert (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers) == ("LlamaForCausalLM", 64, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.context_len == 256 and cfg.vocab_size % 64 == 0
    assert str(cfg.dtype) == "torch.float32"
    assert cfg.eos_token_ids == {cfg.hf_config.eos_token_id}
    assert ModelConfig.from_path(llama_dir, dtype="bfloat16", context_length=100).context_len == 100
