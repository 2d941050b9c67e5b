"""Half-precision matrix products through float32 on CPUs without half-precision dot products.

On a CPU with no bfloat16 / float16 dot-product instructions (no AVX512-BF16 or AMX-BF16; no
AVX512-FP16 or AMX-FP16), torch's half GEMM runs at ~10 GFLOP/s on two AVX2 cores: a bfloat16
prefill then spends three quarters of its time in matrix products, and a product over 16 rows costs
16 times one over one row (measured: benchmark/results/half_gemm.md). The same products in float32
(MKL) run 4-7x faster at 16 rows and more, so with `--cpu-half-gemm float32` every linear layer keeps
a float32 copy of its weight (a half value is exact in float32) and computes

    y = round_to_half(float32(x) @ float32(W)^T + b)

one float32 accumulation rounded once, as a GPU's tensor cores compute a bfloat16 product (and as
torch's own CPU half GEMM does, in another summation order). It is one function of the weights and
the input row, so every mode (full, VeriCache's drafts and verification) gets the same bits from it,
and --enable-deterministic-inference probes its float32 products for row invariance like any other.
The price is memory: 4 more bytes per weight. `auto` takes it only on such a CPU and only while the
copies stay under MAX_RAM_FRACTION of the memory available.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

POLICIES = ("auto", "native", "float32")
MAX_RAM_FRACTION = 0.25  # auto: the float32 copies take at most this share of available memory
NATIVE_FLAGS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}


def cpu_has_native(dtype: torch.dtype, flags: str | None = None) -> bool:
    """Whether this CPU has dot-product instructions for `dtype` (float32: always)."""
    if dtype not in NATIVE_FLAGS:
        return True
    if flags is None:
        from sgl_kernel_ext.cpu_attention import cpu_flags

        flags = cpu_flags()
    have = set(flags.split())
    return any(f in have for f in NATIVE_FLAGS[dtype])


def available_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def linear_modules(model: torch.nn.Module) -> list:
    from sglang_vericache.layers.linear import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def use_float32(model: torch.nn.Module, policy: str, device: str) -> bool:
    """Whether `policy` (one of POLICIES) puts `model`'s linear layers on float32 products."""
    if policy not in POLICIES:
        raise ValueError(f"--cpu-half-gemm must be one of {POLICIES}, got {policy!r}")
    mods = linear_modules(model)
    if policy == "native" or not str(device).startswith("cpu") or not mods:
        return False
    dtype = mods[0].weight.dtype
    if dtype == torch.float32:
        return False
    if policy == "float32":
        return True
    if cpu_has_native(dtype):
        return False
    extra = sum(m.weight.numel() for m in mods) * 4
    avail = available_ram_bytes()
    if avail is not None and extra > MAX_RAM_FRACTION * avail:
        logger.info("--cpu-half-gemm auto: native %s products (float32 weight copies would take %.1f GB of %.1f GB "
                    "available)", dtype, extra / 2**30, avail / 2**30)
        return False
    return True


def enable_float32_gemm(model: torch.nn.Module) -> int:
    """Gives every linear layer its float32 weight (and bias) copy; -> the copies' bytes. Call again
    after the weights change."""
    total = 0
    for m in linear_modules(model):
        m.gemm_weight = m.weight.detach().float()
        m.gemm_bias = None if m.bias is None else m.bias.detach().float()
        total += m.gemm_weight.numel() * 4
    return total
