"""The compressor names `--kv-compressor` accepts, and how a composed name splits. No torch import:
server_args parses flags with it; compress/registry.py builds compressors by the same names (a test
keeps the two equal).

    NAME          one registered compressor (a token dropper or a quantizer)
    DROP+QUANT    a token dropper, then a quantizer of the rows it keeps (e.g. snapkv+kivi4)
"""

from __future__ import annotations

TOKEN_DROPPING = ("streamingllm", "snapkv", "pyramidkv", "h2o", "knorm", "expected_attention", "kvzip",
                  "kvzip_proxy", "kvzap")
# Quantizers: the bit width fixes the ratio (their layout is "quantized").
QUANTIZING = ("kivi2", "kivi4", "int8", "fp8", "kvquant3", "kvquant4", "rotatekv2", "rotatekv4")
# Registry order (compress/registry.py's COMPRESSOR_NAMES).
KV_COMPRESSORS = (
    "streamingllm",
    "snapkv",
    "pyramidkv",
    "h2o",
    "knorm",
    "kivi2",
    "kivi4",
    "int8",
    "fp8",
    "expected_attention",
    "kvzip",
    "kvzip_proxy",
    "kvzap",
    "kvquant3",
    "kvquant4",
    "rotatekv2",
    "rotatekv4",
)


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
