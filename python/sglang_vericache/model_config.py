"""ModelConfig: what the runtime needs to know about a checkpoint, read from its local folder or GGUF file.

A GGUF file's config is transformers' conversion of its metadata, cached beside its tokenizer
(utils/gguf_files.py). dtype auto: the config's torch_dtype; for GGUF, float32 if every weight is
stored F32, else bfloat16 (a quantized or half file has no float32 weights to keep)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

import torch

from sglang_vericache.server_args import ServerArgs
from sglang_vericache.utils.gguf_files import ensure_config, gguf_file_of

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model folder not found: {path!r} (--model-path must be a local folder "
                                f"or a .gguf file)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model folder {path!r} has no config.json (not a Hugging Face checkpoint folder) "
                         f"and no .gguf file")


def _checkpoint_dtype(hf_config) -> torch.dtype:
    dt = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dt, str):
        dt = _DTYPES.get(dt.replace("torch.", ""), None)
    return dt if isinstance(dt, torch.dtype) and dt in _DTYPES.values() else torch.float32


def _as_set(x) -> set[int]:
    if x is None:
        return set()
    return {int(t) for t in x} if isinstance(x, (list, tuple)) else {int(x)}


def _eos_token_ids(path: str, hf_config) -> set[int]:
    ids = _as_set(getattr(hf_config, "eos_token_id", None))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids |= _as_set(json.load(f).get("eos_token_id"))
    return ids


@dataclass
class ModelConfig:
    model_path: str
    hf_config: object
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    context_len: int
    dtype: torch.dtype
    eos_token_ids: set[int] = field(default_factory=set)
    tie_word_embeddings: bool = False
    gguf_file: str | None = None  # the GGUF file the weights come from (model_path names it or its folder)

    tp_size: int = 1  # > 1: a rank's view (tp_shard): its attention heads and KV heads

    @staticmethod
    def from_server_args(server_args: ServerArgs) -> ModelConfig:
        mc = ModelConfig.from_path(server_args.model_path, server_args.dtype, server_args.context_length,
                                   server_args.trust_remote_code)
        return mc.tp_shard(server_args.tp_size)

    def tp_shard(self, tp_size: int) -> ModelConfig:
        """One rank's view at tensor-parallel size tp_size: num_attention_heads and num_key_value_heads
        are its own (what its KV pools, compressors and attention hold); vocab_size and hf_config stay whole."""
        if tp_size == 1:
            return self
        for what, n in (("num_attention_heads", self.num_attention_heads),
                        ("num_key_value_heads", self.num_key_value_heads),
                        ("intermediate_size", getattr(self.hf_config, "intermediate_size", 0))):
            if n % tp_size:
                raise ValueError(f"--tp-size {tp_size} must divide the model's {what} ({n})")
        return replace(self, num_attention_heads=self.num_attention_heads // tp_size,
                       num_key_value_heads=self.num_key_value_heads // tp_size, tp_size=tp_size)

    @staticmethod
    def from_path(path: str, dtype: str = "auto", context_length: int | None = None,
                  trust_remote_code: bool = False) -> ModelConfig:
        from transformers import AutoConfig

        gguf_file = gguf_file_of(path)
        config_dir = ensure_config(gguf_file) if gguf_file else path
        if not gguf_file:
            check_model_folder(path)
        hf_config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
        archs = getattr(hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"{config_dir}/config.json names no 'architectures'")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return ModelConfig(
            model_path=path,
            hf_config=hf_config,
            architecture=archs[0],
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            context_len=context_length or hf_config.max_position_embeddings,
            dtype=_checkpoint_dtype(hf_config) if dtype == "auto" else _DTYPES[dtype],
            eos_token_ids=_eos_token_ids(config_dir, hf_config),
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            gguf_file=gguf_file,
        )
