"""Build a model from a local HF folder: construct without initializing, then fill from safetensors."""

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


def load_model(model_config: ModelConfig, device: str = "cpu") -> nn.Module:
    """Construct on the meta device (no random init), allocate on `device`, load, cast to dtype."""
    cls = get_model_class(model_config.architecture)
    safetensors_files(model_config.model_path)  # fail before building anything
    with _default_dtype(model_config.dtype), torch.device("meta"):
        model = cls(model_config.hf_config, context_len=model_config.context_len)
    model = model.to_empty(device=device)
    if getattr(model_config.hf_config, "tie_word_embeddings", False):
        model.tie_weights()  # to_empty may have split the shared parameter
    model.load_weights(iterate_safetensors(model_config.model_path))
    return model.eval()
