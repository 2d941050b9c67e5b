"""Build a model from a local HF folder or GGUF file: construct without initializing, then fill from
safetensors (load_format safetensors), a GGUF file (gguf; model_loader/gguf_loader.py), whichever the
path holds (auto), or with seeded random weights from the config alone (dummy)."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from sglang_vericache.model_config import ModelConfig
from sglang_vericache.models.registry import get_model_class

INDEX_FILE = "model.safetensors.index.json"
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def safetensors_files(path: str) -> list[str]:
    """The weight files: the shards the index names if there is one, else every *.safetensors."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {path!r} names missing shards: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in model folder {path!r} (only safetensors checkpoints are supported)"
        )
    return files


def iterate_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    model_config: ModelConfig, device: str = "cpu", load_format: str = "auto", seed: int = 0
) -> nn.Module:
    """Construct on the meta device (no random init), allocate on `device`, load, cast to dtype.
    dummy: no weight files read; every weight ~ N(0, initializer_range), norm weights 1 (as HF
    initializes them), from `seed` -- for benchmarking a model's shape without its checkpoint."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"--load-format must be one of {LOAD_FORMATS}, got {load_format!r}")
    gguf_file = model_config.gguf_file
    if load_format == "auto":
        load_format = "gguf" if gguf_file else "safetensors"
    if load_format == "gguf" and not gguf_file:
        raise ValueError(f"--load-format gguf needs --model-path naming a .gguf file (or a folder holding one "
                         f"and no config.json); {model_config.model_path!r} is a Hugging Face folder")
    if load_format == "safetensors" and gguf_file:
        raise ValueError(f"--load-format safetensors, but --model-path {model_config.model_path!r} is a GGUF "
                         f"checkpoint: pass --load-format gguf (or auto)")
    cls = get_model_class(model_config.architecture)
    if load_format == "safetensors":
        safetensors_files(model_config.model_path)  # fail before building anything
    with _default_dtype(model_config.dtype), torch.device("meta"):
        model = cls(model_config.hf_config, context_len=model_config.context_len)
    model = model.to_empty(device=device)
    if getattr(model_config.hf_config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty may have split the shared parameter
    if load_format == "dummy":
        init_dummy_weights(model, getattr(model_config.hf_config, "initializer_range", 0.02), seed)
    elif load_format == "gguf":
        from sglang_vericache.model_loader.gguf_loader import hf_weight_names, iterate_gguf

        model.load_weights(iterate_gguf(gguf_file, hf_weight_names(model), model_config.hf_config))
    else:
        model.load_weights(iterate_safetensors(model_config.model_path))
    return model.eval()


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float, seed: int) -> None:
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():  # a tied lm_head is listed once
        if p.dim() == 1:  # norm weights and biases
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
            continue
        # drawn where the weight lives (an 8B model in seconds on a GPU); same seed, same device
        # kind -> the same model
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        p.normal_(0.0, std, generator=gen)
