"""int8: symmetric per-token-per-head codes with a float16 scale."""

from __future__ import annotations

import torch

from sglang_vericache.compress.quant import PerTokenScaledCompressor


class Int8Compressor(PerTokenScaledCompressor):
    """Per (token, KV head): scale = amax / 127 (float16, rounded up), code = round(x / scale)
    in [-127, 127] (round half to even). |x - code * scale| <= scale / 2.
    """

    name = "int8"
    code_dtype = torch.int8
    code_max = 127.0

    def encode(self, scaled):
        return torch.round(scaled).to(torch.int8)
