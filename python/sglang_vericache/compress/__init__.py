"""KV-cache compressors for the compressed tier: one page-aligned chunk of one layer at a time.

    cfg = CompressorConfig.from_model_config("snapkv", ratio=4, chunk_size=64, model_config=mc)
    comp = get_compressor(cfg.name, cfg)
    w = comp.query_window(layer_id)  # 0, W or T trailing queries of the chunk
    chunk = comp.compress(layer_id, k, v, q=q[-w:] if w else None, positions=pos)
    k_rows, v_rows = comp.decompress(layer_id, chunk)  # float32 [comp.layout(layer_id).rows, H_kv, D]

k, v (and q, positions) may carry leading batch dims to compress N chunks of a layer at once.
`layout(layer_id)` is static (names, shapes, dtypes of the stored tensors): allocate pools from it.
The names, each one's kind (token dropping or quantization) and class: the one table,
compressor_names.COMPRESSORS. A name may be `DROP+QUANT` (`snapkv+kivi4`): the dropper's kept rows,
quantized (compose.py).
"""

from sglang_vericache.compress.base import (
    CompressedChunk,
    CompressorConfig,
    KVCompressor,
    Layout,
    TensorSpec,
    exact_bytes_per_token,
)
from sglang_vericache.compress.registry import COMPRESSOR_NAMES, fp8_supported, get_compressor

__all__ = [
    "COMPRESSOR_NAMES",
    "CompressedChunk",
    "CompressorConfig",
    "KVCompressor",
    "Layout",
    "TensorSpec",
    "exact_bytes_per_token",
    "fp8_supported",
    "get_compressor",
]
