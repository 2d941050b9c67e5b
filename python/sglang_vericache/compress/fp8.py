"""fp8: float8_e4m3fn codes with a per-token-per-head float16 scale."""

from __future__ import annotations

import torch

from sglang_vericache.compress.quant import PerTokenScaledCompressor


class FP8Compressor(PerTokenScaledCompressor):
    """Per (token, KV head): scale = amax / 448 (float16, rounded up), code = e4m3fn(x / scale)
    (round to nearest even). The grid is floating: |x - deq| <= scale * ulp_e4m3(|x / scale|) / 2,
    i.e. 2^-4 relative for normals (|x / scale| >= 2^-6), scale * 2^-10 absolute below.
    """

    name = "fp8"
    code_max = 448.0

    def __init__(self, config):
        if not hasattr(torch, "float8_e4m3fn"):
            raise RuntimeError(f"fp8 needs torch.float8_e4m3fn (torch >= 2.1), not in {torch.__version__}")
        super().__init__(config)
        self.code_dtype = torch.float8_e4m3fn

    def encode(self, scaled):
        return scaled.to(torch.float8_e4m3fn)
