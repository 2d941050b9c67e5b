"""Compressors by name (`--kv-compressor NAME`). Each factory imports its module lazily."""

from __future__ import annotations

import importlib
import logging

import torch

from sglang_vericache.compress.base import CompressorConfig, KVCompressor

# name -> (module, class, extra constructor kwargs)
_COMPRESSORS: dict[str, tuple[str, str, dict]] = {
    "streamingllm": ("streamingllm", "StreamingLLMCompressor", {}),
    "snapkv": ("snapkv", "SnapKVCompressor", {}),
    "pyramidkv": ("pyramidkv", "PyramidKVCompressor", {}),
    "h2o": ("h2o", "H2OCompressor", {}),
    "knorm": ("knorm", "KNormCompressor", {}),
    "kivi2": ("kivi", "KIVICompressor", {"bits": 2}),
    "kivi4": ("kivi", "KIVICompressor", {"bits": 4}),
    "int8": ("int8", "Int8Compressor", {}),
    "fp8": ("fp8", "FP8Compressor", {}),
}
COMPRESSOR_NAMES: tuple[str, ...] = tuple(_COMPRESSORS)
logger = logging.getLogger(__name__)


def get_compressor(name: str, config: CompressorConfig) -> KVCompressor:
    if name not in _COMPRESSORS:
        raise ValueError(f"unknown kv compressor {name!r}; choose one of: {', '.join(COMPRESSOR_NAMES)}")
    if config.name != name:
        raise ValueError(f"get_compressor({name!r}) got a config for {config.name!r}")
    module, cls, kwargs = _COMPRESSORS[name]
    comp = getattr(importlib.import_module(f"sglang_vericache.compress.{module}"), cls)(config, **kwargs)
    if comp.layout(0).kind == "quantized":
        logger.info("%s ignores ratio %g; its layout sets the ratio: %.3f", name, config.ratio, comp.effective_ratio())
    return comp


def fp8_supported() -> bool:
    return hasattr(torch, "float8_e4m3fn")
