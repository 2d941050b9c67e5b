"""The compressors `--kv-compressor` accepts: one table (COMPRESSORS) of each name's kind and the class
that implements it, and how a composed name splits. No torch import: server_args parses flags with it;
compress/registry.py builds compressors from the same table.

    NAME          one registered compressor (a token dropper or a quantizer)
    DROP+QUANT    a token dropper, then a quantizer of the rows it keeps (e.g. snapkv+kivi4)
"""

from __future__ import annotations

from typing import NamedTuple


class CompressorEntry(NamedTuple):
    kind: str  # "drop": keeps some tokens' rows exactly; "quant": keeps every row at fewer bits (fixed ratio)
    module: str  # sglang_vericache.compress.<module>
    cls: str  # the KVCompressor subclass in it
    kwargs: dict  # extra constructor keyword arguments besides the CompressorConfig


# The one table of compressors, in registry order.
COMPRESSORS: dict[str, CompressorEntry] = {
    "streamingllm": CompressorEntry("drop", "streamingllm", "StreamingLLMCompressor", {}),
    "snapkv": CompressorEntry("drop", "snapkv", "SnapKVCompressor", {}),
    "pyramidkv": CompressorEntry("drop", "pyramidkv", "PyramidKVCompressor", {}),
    "h2o": CompressorEntry("drop", "h2o", "H2OCompressor", {}),
    "knorm": CompressorEntry("drop", "knorm", "KNormCompressor", {}),
    "kivi2": CompressorEntry("quant", "kivi", "KIVICompressor", {"bits": 2}),
    "kivi4": CompressorEntry("quant", "kivi", "KIVICompressor", {"bits": 4}),
    "int8": CompressorEntry("quant", "int8", "Int8Compressor", {}),
    "fp8": CompressorEntry("quant", "fp8", "FP8Compressor", {}),
    "expected_attention": CompressorEntry("drop", "expected_attention", "ExpectedAttentionCompressor", {}),
    "kvzip": CompressorEntry("drop", "kvzip", "KVzipCompressor", {}),
    "kvzip_proxy": CompressorEntry("drop", "kvzip", "KVzipProxyCompressor", {}),
    "kvzap": CompressorEntry("drop", "kvzap", "KVzapCompressor", {}),
    "kvquant3": CompressorEntry("quant", "kvquant", "KVQuantCompressor", {"bits": 3}),
    "kvquant4": CompressorEntry("quant", "kvquant", "KVQuantCompressor", {"bits": 4}),
    "rotatekv2": CompressorEntry("quant", "rotatekv", "RotateKVCompressor", {"bits": 2}),
    "rotatekv4": CompressorEntry("quant", "rotatekv", "RotateKVCompressor", {"bits": 4}),
}
KV_COMPRESSORS: tuple[str, ...] = tuple(COMPRESSORS)
TOKEN_DROPPING: tuple[str, ...] = tuple(n for n, e in COMPRESSORS.items() if e.kind == "drop")
# Quantizers: the bit width fixes the ratio (their layout is "quantized").
QUANTIZING: tuple[str, ...] = tuple(n for n, e in COMPRESSORS.items() if e.kind == "quant")


def split_kv_compressor(spec: str) -> tuple[str, ...]:
    """A `--kv-compressor` value -> (name,) or (dropper, quantizer); a ValueError names the bad part."""
    names = ", ".join(KV_COMPRESSORS)
    parts = tuple(spec.split("+"))
    if len(parts) == 1:
        if spec not in KV_COMPRESSORS:
            raise ValueError(
                f"--kv-compressor must be one of {names} (or a token dropper + a quantizer, "
                f"e.g. snapkv+kivi4), got {spec!r}"
            )
        return parts
    for part in parts:
        if part not in KV_COMPRESSORS:
            raise ValueError(
                f"--kv-compressor {spec!r}: unknown part {part!r}; each part must be one of {names}"
            )
    if len(parts) != 2 or parts[0] not in TOKEN_DROPPING or parts[1] not in QUANTIZING:
        raise ValueError(
            f"--kv-compressor {spec!r}: a composition is one token-dropping compressor "
            f"({', '.join(TOKEN_DROPPING)}) then one quantizer ({', '.join(QUANTIZING)}): "
            "drop tokens, then quantize what is kept"
        )
    return parts
