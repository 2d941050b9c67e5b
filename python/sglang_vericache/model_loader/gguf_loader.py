"""Weights from a GGUF file, as the Hugging Face (name, tensor) pairs a model's `load_weights` takes.

Names: gguf's HF -> GGUF tensor-name map (`gguf.get_tensor_name_map`, which transformers, vLLM and
SGLang use too), applied to the HF names the model loads: its parameters, fused ones split back into
their checkpoint names through the class's `stacked_params_mapping`.
Values: `gguf.quants.dequantize` of each tensor's bytes (float32, exact for F32/F16/BF16), then
transformers' per-architecture undo of what llama.cpp's converter changed (TENSOR_PROCESSORS: the
q/k row permutation of llama files, Gemma's norm weights stored as w + 1). `load_weights` casts to
the model dtype, as it does for safetensors.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from sglang_vericache.utils.gguf_files import TensorEntry, check_tensor_table, ensure_config, load_tensor_table

logger = logging.getLogger(__name__)

PROGRESS_BAR_MIN_TENSORS = 64  # a bar only where the dequantization takes a while


def hf_weight_names(model: nn.Module) -> list[str]:
    """The checkpoint (HF) names `model.load_weights` needs: q_proj/k_proj/v_proj for a fused qkv_proj."""
    mapping = getattr(model, "stacked_params_mapping", ())
    names = []
    for name, _ in model.named_parameters():  # a tied lm_head is listed once, as the embedding
        split = [name.replace(f".{fused}.", f".{hf}.") for fused, hf, _ in mapping if f".{fused}." in name]
        names.extend(split or [name])
    return names


def gguf_names(architecture: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """{GGUF tensor name: HF name} for the HF names gguf's map knows (blk.0.attn_q.weight: ...q_proj.weight)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(a for a, n in MODEL_ARCH_NAMES.items() if n == architecture)
    name_map = get_tensor_name_map(arch, num_layers)
    out = {}
    for hf in hf_names:
        base, _, suffix = hf.rpartition(".")  # weight / bias
        gguf_base = name_map.get_name(base)
        if gguf_base is not None:
            out[f"{gguf_base}.{suffix}"] = hf
    return out


def tensor_data(blob: np.ndarray, t: TensorEntry) -> np.ndarray:
    """The tensor's stored values as gguf.GGUFReader presents them: F32/F16 as floats in their shape, every
    other type as uint8 rows of its blocks (the input gguf.quants.dequantize takes)."""
    raw = blob[t.offset : t.offset + t.n_bytes]
    if t.ggml_type in ("F32", "F16"):
        return raw.view(np.float32 if t.ggml_type == "F32" else np.float16).reshape(t.shape)
    rows = math.prod(t.shape[:-1])
    return raw.reshape(*t.shape[:-1], t.n_bytes // rows)


def dequantized(blob: np.ndarray, t: TensorEntry) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(tensor_data(blob, t), GGMLQuantizationType[t.ggml_type])


def iterate_gguf(gguf_path: str, hf_names: Iterable[str], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file the model has a parameter for; the others
    (none in the supported architectures' files) are named in a warning and skipped."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    architecture, table = load_tensor_table(ensure_config(gguf_path))
    check_tensor_table(gguf_path, table, os.path.getsize(gguf_path))  # truncated since it was cached?
    names = gguf_names(architecture, hf_config.num_hidden_layers, hf_names)
    skipped = [t.name for t in table if t.name not in names]
    if skipped:
        logger.warning("GGUF tensors with no parameter in the model, skipped: %s", skipped)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=hf_config.to_dict())
    todo = [t for t in table if t.name in names]
    types = sorted({t.ggml_type for t in todo})
    logger.info("loading GGUF %s: dequantizing %d tensors (%s)", gguf_path, len(todo), ", ".join(types))
    blob = np.asarray(np.memmap(gguf_path, mode="r", dtype=np.uint8))  # plain views: memmap slices cost ~15%
    t0 = time.perf_counter()
    for t in _progress(todo):
        w = processor.process(weights=dequantized(blob, t), name=t.name).weights
        if not (w.flags.writeable and w.flags.c_contiguous) or w.dtype != np.float32:
            w = np.array(w, dtype=np.float32, order="C")  # a view of the mapped file, or permuted
        yield names[t.name], torch.from_numpy(w)
    logger.info("loading GGUF %s: %d tensors in %.1f s", gguf_path, len(todo), time.perf_counter() - t0)


def _progress(items: list) -> Iterable:
    if len(items) < PROGRESS_BAR_MIN_TENSORS:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc="dequantizing GGUF tensors", unit="tensor")
