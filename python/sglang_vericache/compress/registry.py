"""Compressors by name (`--kv-compressor NAME`, or `DROP+QUANT` for a dropper then a quantizer of
what it keeps), built from compressor_names.COMPRESSORS. Each class's module is imported lazily."""

from __future__ import annotations

import importlib
import logging

import torch

from sglang_vericache.compress.base import CompressorConfig, KVCompressor
from sglang_vericache.compressor_names import COMPRESSORS, split_kv_compressor

COMPRESSOR_NAMES: tuple[str, ...] = tuple(COMPRESSORS)  # the table lives in compressor_names.py
logger = logging.getLogger(__name__)


def resolve(name: str) -> tuple[type, dict]:
    """A registered name -> (its class, its constructor kwargs besides the config)."""
    entry = COMPRESSORS[name]
    module = importlib.import_module(f"sglang_vericache.compress.{entry.module}")
    return getattr(module, entry.cls), dict(entry.kwargs)


def get_compressor(name: str, config: CompressorConfig) -> KVCompressor:
    parts = split_kv_compressor(name)  # ValueError naming the unknown or misplaced part
    if config.name != name:
        raise ValueError(f"get_compressor({name!r}) got a config for {config.name!r}")
    if len(parts) == 2:
        from sglang_vericache.compress.compose import compose

        comp = compose(config, resolve, *parts)
        logger.info("%s: %s keeps %d of %d rows per head, %s quantizes them: %.2fx smaller than exact",
                    name, parts[0], comp.layout(0).rows, config.chunk_size, parts[1], comp.effective_ratio())
        return comp
    cls, kwargs = resolve(name)
    comp = cls(config, **kwargs)
    if comp.layout(0).kind == "quantized":
        logger.info("%s ignores ratio %g; its layout sets the ratio: %.3f", name, config.ratio,
                    comp.effective_ratio())
    return comp


def fp8_supported() -> bool:
    return hasattr(torch, "float8_e4m3fn")
