"""Batch-invariant CPU attention (csrc/fixed_chunk_attention.cpp), built on first use.

`fixed_chunk_attention` reduces every query row over its visible keys in fixed chunks of
CHUNK visible keys, in key order, with float32 statistics, one row per work item: a row's output
depends on its query and its visible keys and values only (not on the batch, the number of query
rows, padding or the thread count). `fixed_chunk_attention_ref` is the same computation in torch
ops, row by row (the reference for tests; it rounds differently, so compare with a tolerance).

The C++ source is compiled by torch.utils.cpp_extension (g++, cached under
TORCH_EXTENSIONS_DIR) the first time it is needed; `scripts/setup_cpu.sh` builds it up front.
The build is named after the source and this CPU's instruction-set flags, so a cache shared by
machines of different CPUs never loads a binary built for another one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
CHUNK = 64
_SOURCE = Path(__file__).parent / "csrc" / "fixed_chunk_attention.cpp"
_lock = threading.Lock()
_loaded: set[tuple[Path, str, tuple[str, ...]]] = set()  # (source, prefix, flags) loaded in this process


def cpu_flags() -> str:
    """This CPU's instruction-set flags line from /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_name(source: Path = _SOURCE, prefix: str = "sgl_kernel_ext_cpu", extra_cflags: tuple[str, ...] = ()) -> str:
    """The build's name: a hash of the source (its text and where it is), the headers beside it and
    below it (csrc/*.h, csrc/draft/*.h: an edited header rebuilds), its extra flags, this CPU's flags
    and torch's version. The path is part of it because torch.utils.cpp_extension rebuilds a build
    directory whose sources moved: two checkouts sharing one would recompile on every alternate load
    (and wait on each other's lock)."""
    flags = " ".join(extra_cflags).encode()
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.rglob("*.h")))
    digest = hashlib.sha1(source.read_bytes() + headers + str(source.resolve()).encode() + flags
                          + cpu_flags().encode() + torch.__version__.encode())
    return f"{prefix}_{digest.hexdigest()[:12]}"


STALE_LOCK_S = 600  # a build lock older than this was left by a build that was killed


def _load_built(lib: Path) -> bool:
    """Load a library already built under this build's name (the name hashes everything the binary
    depends on), without torch.utils.cpp_extension's lock and ninja check; False if there is none or it
    does not load (a link that was cut short: it is removed and rebuilt)."""
    if not lib.is_file():
        return False
    try:
        torch.ops.load_library(str(lib))
    except OSError as exc:
        logger.warning("CPU kernel %s does not load (%s); rebuilding it", lib, exc)
        lib.unlink(missing_ok=True)
        return False
    return True


def _clear_stale_lock(lock: Path) -> None:
    """torch.utils.cpp_extension waits forever on a build lock; one left by a killed build is removed."""
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing the build lock %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


def build_library(source: Path, prefix: str, extra_cflags: tuple[str, ...] = ()) -> None:
    """Build (once per source, flags and CPU) and load a C++ kernel library of this package (its ops
    register themselves); raises RuntimeError with the compiler's message if it cannot be built."""
    key = (source, prefix, tuple(extra_cflags))
    if key in _loaded:  # every kernel call comes here: no hashing, no lock once loaded
        return
    with _lock:
        if key in _loaded:
            return
        from torch.utils.cpp_extension import _get_build_directory, load as load_extension

        name = build_name(source, prefix, extra_cflags)
        build_dir = Path(_get_build_directory(name, False))
        if _load_built(build_dir / f"{name}.so"):
            _loaded.add(key)
            return
        _clear_stale_lock(build_dir / "lock")
        flags = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG", *extra_cflags]
        logger.info("building the CPU kernel %s for this CPU (once; cached in %s): about a minute", source.name,
                    build_dir)
        start = time.perf_counter()
        try:
            load_extension(
                name=name,
                sources=[str(source)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=bool(os.environ.get("SGL_KERNEL_EXT_VERBOSE")),
            )
        except Exception as exc:  # compiler missing or failing: say what is needed
            raise RuntimeError(
                f"could not build the CPU kernel {source.name} with torch.utils.cpp_extension: {exc}. "
                "It needs g++ and the Python headers (Debian: apt-get install g++ python3-dev)"
            ) from exc
        logger.info("built the CPU kernel %s in %.0f s", source.name, time.perf_counter() - start)
        _loaded.add(key)


# Only attention_common.h's explicit fused multiply-adds fuse (its exp rounds every step).
_CFLAGS = ("-ffp-contract=off",)


def load() -> None:
    """Build (once per source and CPU) and load the batch-invariant attention kernel."""
    build_library(_SOURCE, "sgl_kernel_ext_cpu", _CFLAGS)


def fixed_chunk_attention(
    q: torch.Tensor,  # [B, Lq, H, D]
    k_src: torch.Tensor,  # [N, Hkv, D]
    v_src: torch.Tensor,  # [N, Hkv, Dv]
    index: torch.Tensor,  # [B, S] int64 rows of k_src / v_src
    allowed: torch.Tensor | None,  # [B, Lq, S] bool; None: every key visible
    scale: float,
    start: torch.Tensor | None = None,  # [B, Lq] int64 first visible key of each query; None: 0
) -> torch.Tensor:
    """-> float32 [B, Lq, H, Dv]. K/V are read in q's dtype (converted first if stored otherwise).
    start (a sliding window's first key): the keys before it are neither scanned nor read; a query's
    visible keys, and so its result, are the same as with those keys masked out in `allowed`."""
    load()
    if k_src.dtype != q.dtype:
        k_src, v_src = k_src.to(q.dtype), v_src.to(q.dtype)
    mask = torch.empty(0, dtype=torch.bool) if allowed is None else allowed.contiguous()
    first = torch.empty(0, dtype=torch.int64) if start is None else start.to(torch.int64).contiguous()
    return torch.ops.sgl_kernel_ext_cpu.fixed_chunk_attention(
        q.contiguous(), k_src.contiguous(), v_src.contiguous(), index.to(torch.int64).contiguous(), mask,
        float(scale), first,
    )


def fixed_chunk_attention_ref(q, k_src, v_src, index, allowed, scale) -> torch.Tensor:
    """The same reduction in torch ops (float32, one row at a time): for tests."""
    b_, lq, h, d = q.shape
    hkv, dv = k_src.shape[1], v_src.shape[2]
    g = h // hkv
    out = torch.zeros(b_, lq, h, dv, dtype=torch.float32)
    for b in range(b_):
        for i in range(lq):
            cols = torch.arange(index.shape[1]) if allowed is None else allowed[b, i].nonzero().squeeze(1)
            if len(cols) == 0:
                continue
            rows = index[b, cols]
            keys = k_src[rows].float().repeat_interleave(g, dim=1)  # [L, H, D]
            values = v_src[rows].float().repeat_interleave(g, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[b, i].float() * scale, keys)
            out[b, i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, -1), values)
    return out
