"""sgl-kernel-ext: Triton kernels for sglang-vericache, each with a plain-torch reference in ref.py.

Stands alone (torch + triton only): every entry point takes plain tensors in SGLang's layouts.
"""

from sgl_kernel_ext.decode_exact import decode_attention
from sgl_kernel_ext.decode_merge import merge_partials
from sgl_kernel_ext.decode_prerope import prerope_decode_attention
from sgl_kernel_ext.decode_quantized import quantized_decode_attention
from sgl_kernel_ext.decode_token_drop import token_drop_decode_attention
from sgl_kernel_ext.fixed_split_attention import fixed_split_attention
from sgl_kernel_ext.quantize_append import quantize_append
from sgl_kernel_ext.verify_attention import verify_attention

__all__ = [
    "decode_attention",
    "fixed_split_attention",
    "merge_partials",
    "prerope_decode_attention",
    "quantize_append",
    "quantized_decode_attention",
    "token_drop_decode_attention",
    "verify_attention",
]
