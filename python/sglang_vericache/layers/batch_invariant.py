"""Batch-invariant arithmetic for --enable-deterministic-inference.

Invariant (what every layer below guarantees when it is on): a token row's result is computed by
the same arithmetic in the same order whatever else shares the forward (how many rows, which
rows, where the row sits, how many threads). Then a request's output is one function of
(checkpoint, prompt, seed): alone or batched, chunked or not, cache hit or miss, full mode or a
VeriCache verify pass.

- Matrix products (`linear`): a library GEMM rounds a row differently for different row counts
  (on an AVX2 EPYC, MKL float32 changes a row's bits for M = 1, 2, 3, 5, 6, 7, 9, 10, 11 against
  M = 16; bfloat16 is invariant there as it is). Rows are therefore computed in blocks: the plain
  call where it is invariant, else one call over the rows padded to a multiple of the block, else one
  call per block. `choose_linear_mode` probes the model's own shapes once at start (every batch size
  up to 40 and larger ones up to MAX_CALL_ROWS, two offsets, every row alone and in windows of 2-8,
  one thread and the current number) and picks the cheapest mode that is invariant on this CPU; if
  none is, the server refuses to start. On a CPU with native half-precision dot products (AVX512-BF16,
  AMX, AVX512-FP16) bfloat16 / float16 products are only ever computed one block of BLOCK_ROWS rows per
  call ("blocked"), invariant by construction (every call the same shape): there oneDNN picks another
  kernel by row count, and a Sapphire Rapids Xeon's one-row kernel rounds about one output in 30 000
  differently from its many-row kernel, too rarely for a probe to be sure of seeing it (the probe saw
  none; a 32-request bfloat16 run flipped a logprob).
- Element-wise ops: torch's vectorized loops finish each thread's range with scalar code, and
  float32 silu's scalar and vector paths differ in ~4% of inputs (exp does not); `silu_and_mul`
  uses x / (1 + exp(-x)) in float32.
  With the triton backend (`enable_batch_invariance(model, "triton")`) every linear layer is
  sgl_kernel_ext.batch_invariant_matmul instead (TRITON_MODE): fixed tiles, one in-order pass over K,
  invariant by construction, so nothing is probed.
- Attention: sgl_kernel_ext.cpu_attention (fixed chunks of visible keys, float32 statistics); with the
  triton backend sgl_kernel_ext.fixed_split_attention (the same chunking, as Triton tiles).
- Norms, softmax, log_softmax and the sampler work per row on a CPU (checked in the tests). On a GPU
  torch's CUDA reductions pick their split from the tensor's shape, so on the triton backend
  (`row_kernels`, by default when the model is on CUDA) RMSNorm is sgl_kernel_ext.batch_invariant_rmsnorm
  and the sampler's log_softmax / logsumexp sgl_kernel_ext.batch_invariant_softmax (one program per
  row, fixed block order); `uses_triton_row_kernels` says when. On a CPU they stay torch's: the
  interpreter would run them one row-program at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# (name, rows per block), cheapest first. "plain": the library call as it is (some CPUs' kernels are
# already row-invariant for some dtypes, e.g. bfloat16 on AVX2); "padded": rows padded to a multiple
# of the block, one call; "blocked": one call per block.
BLOCK_ROWS = 16
MODES = (("plain", 1), ("padded", 4), ("padded", 8), ("padded", BLOCK_ROWS), ("blocked", BLOCK_ROWS))
PROBE_VERSION = 2  # part of the probe cache's keys: answers of an older probe are not reused
PROBE_ROWS = (*range(1, 41), 47, 64, 65, 100, 127, 128, 200, 255, 256, 333, 511, 512)  # row counts probed
MAX_CALL_ROWS = 512  # larger inputs are computed in calls of this many rows (within the probed sizes)
TRITON_MODE = ("triton", 0)  # sgl_kernel_ext.batch_invariant_matmul (the triton backend's linear mode)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: tuple[str, int]) -> torch.Tensor:
    """F.linear with every row computed as a row of a block of mode[1] rows (see module docstring)."""
    kind, block = mode
    if kind == "triton":
        from sgl_kernel_ext.batch_invariant_matmul import batch_invariant_linear

        return batch_invariant_linear(x, weight, bias)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if m > MAX_CALL_ROWS:
        parts = [linear(p, weight, bias, mode) for p in x2.split(MAX_CALL_ROWS)]
        return torch.cat(parts).reshape(*shape[:-1], weight.shape[0])
    if kind == "plain":
        return F.linear(x, weight, bias)
    pad = -m % block
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])])
    if kind == "padded" or x2.shape[0] == block:
        y = F.linear(x2, weight, bias)
    else:
        y = torch.cat([F.linear(blk, weight, bias) for blk in x2.split(block)])
    return y[:m].reshape(*shape[:-1], weight.shape[0])


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[gate, up] -> silu(gate) * up, silu in float32 as x / (1 + exp(-x)), rounded as F.silu's is."""
    d = x.shape[-1] // 2
    g = x[..., :d].float()
    return (g / (1.0 + torch.exp(-g))).to(x.dtype) * x[..., d:]


def _invariant(weight: torch.Tensor, bias: torch.Tensor | None, mode: tuple[str, int]) -> bool:
    """Every row computed in batches of every PROBE_ROWS size, at two offsets, and with one thread,
    equals the same row computed in the largest batch with the current threads."""
    rows = PROBE_ROWS
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows[-1] + 3, weight.shape[1], generator=gen).to(weight.dtype)
    ref = linear(x, weight, bias, mode)
    threads = torch.get_num_threads()
    try:
        for n_threads in dict.fromkeys((threads, 1)):
            torch.set_num_threads(n_threads)
            for m in rows:
                for start in (0, 3) if m + 3 <= len(x) else (0,):
                    if not torch.equal(linear(x[start : start + m], weight, bias, mode), ref[start : start + m]):
                        return False
            for m in range(1, 9):  # decode-sized calls: every row alone, in windows of 2-8
                for start in range(0, len(x) - m + 1, m):
                    if not torch.equal(linear(x[start : start + m], weight, bias, mode), ref[start : start + m]):
                        return False
    finally:
        torch.set_num_threads(threads)
    return True


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sglang_vericache" / "batch_invariance.json"


def _machine_key() -> str:
    """What a probe's answer depends on besides the shape: the CPU, torch and the thread count."""
    from sgl_kernel_ext.cpu_attention import cpu_flags

    return hashlib.sha1(f"{cpu_flags()}|{torch.__version__}|{torch.get_num_threads()}".encode()).hexdigest()[:16]


def choose_linear_mode(model: torch.nn.Module) -> tuple[str, int]:
    """The first of MODES that is row-invariant for every distinct linear shape of the model (calls
    never exceed MAX_CALL_ROWS rows, the largest size probed). Answers are remembered per machine in
    _cache_path(): probes of a large model's shapes take seconds."""
    from sglang_vericache.layers.half_gemm import cpu_has_native

    shapes = {}  # (shape, bias, product dtype) -> (weight, bias) as the products see them (layers/half_gemm.py)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            w, b = mod.matmul_weights() if hasattr(mod, "matmul_weights") else (mod.weight, mod.bias)
            shapes.setdefault((tuple(w.shape), b is not None, w.dtype), (w, b))
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    size, machine = len(cache), _machine_key()

    def invariant(wb: tuple[torch.Tensor, torch.Tensor | None], mode: tuple[str, int]) -> bool:
        w, b = wb
        if w.dtype in (torch.bfloat16, torch.float16) and mode[0] != "blocked" and cpu_has_native(w.dtype):
            return False  # see the module docstring: only one shape per call is safe there
        key = f"{machine}|v{PROBE_VERSION}|{tuple(w.shape)}|{b is not None}|{w.dtype}|{mode}"
        if key not in cache:
            cache[key] = _invariant(w, b, mode)
        return cache[key]

    try:
        with torch.inference_mode():
            for mode in MODES:
                if all(invariant(wb, mode) for wb in shapes.values()):
                    return mode
                logger.info("deterministic inference: %s matrix products (%d-row blocks) are not row-invariant "
                            "on this CPU", *mode)
    finally:
        if len(cache) != size:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(cache))
                tmp.replace(path)
            except OSError as exc:
                logger.warning("could not save the batch-invariance probe cache %s: %s", path, exc)
    raise RuntimeError(
        "--enable-deterministic-inference: no row-invariant matrix product found on this machine "
        f"(tried {', '.join(f'{k} x{b}' for k, b in MODES)})"
    )


def uses_triton_row_kernels(enable_deterministic_inference: bool, attention_backend: str, device) -> bool:
    """RMSNorm and the sampler's log_softmax / logsumexp through the Triton kernels (module docstring)?"""
    return enable_deterministic_inference and attention_backend == "triton" and str(device).startswith("cuda")


def enable_batch_invariance(model: torch.nn.Module, attention_backend: str = "torch",
                            row_kernels: bool | None = None) -> tuple[str, int]:
    """Switch the model's linear layers and activations (and with row_kernels its RMSNorms; None:
    on the triton backend with the model on CUDA) to batch-invariant arithmetic; -> the linear
    mode (TRITON_MODE with the triton backend, else the probe's choice)."""
    from sglang_vericache.layers.activation import SiluAndMul
    from sglang_vericache.layers.layernorm import RMSNorm
    from sglang_vericache.layers.linear import Linear

    mode = TRITON_MODE if attention_backend == "triton" else choose_linear_mode(model)
    if row_kernels is None:
        row_kernels = uses_triton_row_kernels(True, attention_backend, next(model.parameters(), torch.empty(0)).device)
    norm_kernel = None
    if row_kernels:
        from sgl_kernel_ext.batch_invariant_rmsnorm import rms_norm as norm_kernel
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            mod.batch_invariant_kernel = norm_kernel
        elif isinstance(mod, Linear):
            mod.batch_invariant_mode = mode
        elif isinstance(mod, SiluAndMul):
            mod.batch_invariant = True
        elif isinstance(mod, torch.nn.Linear):
            raise TypeError(f"{type(mod).__name__} is a plain nn.Linear: use layers.linear.Linear")
    return mode
