"""One page of KV, every layer, <-> bytes.

A page payload is a list with one dict per layer of named tensors:
  exact tier:      [{"k": [P, H_kv, D], "v": [P, H_kv, Dv]} per layer]   (P = page_size)
  compressed tier: [chunk.tensors per layer]  (the layer's `Layout` tensors, one chunk = one page)
A PageSpec is the matching list of per-layer TensorSpec tuples: what the payload must look like.

Wire format (little-endian):
  b"VCKVPAGE" | u16 version | u32 header_len | header (UTF-8 JSON) | data
  header = {"layers": [[[name, dtype, shape], ...] per layer], "nbytes": len(data), "crc32": crc(data)}
  data   = each tensor's raw bytes in header order, every tensor starting at a 16-byte aligned offset.
Invariants: deserialize(serialize(p)) is bit-identical to p (same names, order, shapes, dtypes,
bytes, whatever the dtype: bf16, fp8 and uint8 codes go through as raw bytes); any truncation,
flipped bit or spec mismatch raises PayloadError naming what is wrong, never returns wrong KV.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from typing import Sequence

import torch

from sglang_vericache.compress.base import Layout, TensorSpec

MAGIC = b"VCKVPAGE"
VERSION = 1
_PREFIX = struct.Struct("<8sHI")
ALIGN = 16

PagePayload = list[dict[str, torch.Tensor]]
PageSpec = list[tuple[TensorSpec, ...]]

assert sys.byteorder == "little", "the page format is little-endian; big-endian hosts need a byteswap"


class PayloadError(ValueError):
    """A stored page is corrupted or is not the page the reader expects."""


def exact_page_spec(
    num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    v_head_dim: int | None = None,
) -> PageSpec:
    """The spec of one exact-tier page (MHATokenToKVPool rows of one page)."""
    k = TensorSpec("k", (page_size, num_kv_heads, head_dim), dtype)
    v = TensorSpec("v", (page_size, num_kv_heads, v_head_dim or head_dim), dtype)
    return [(k, v) for _ in range(num_layers)]


def compressed_page_spec(layouts: Sequence[Layout]) -> PageSpec:
    """The spec of one compressed-tier chunk (CompressedKVPool.layouts)."""
    return [tuple(lay.tensors) for lay in layouts]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise PayloadError(f"unknown dtype {name!r} in page header")
    return dtype


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def serialize_page(payload: PagePayload) -> bytes:
    """Bytes of one page: header + every layer's tensors (bit-exact, any dtype)."""
    layers, parts, off = [], [], 0
    for layer in payload:
        entries = []
        for name, t in layer.items():
            raw = _raw(t)
            pad = -off % ALIGN
            parts += [b"\0" * pad, raw]
            off += pad + len(raw)
            entries.append([name, _dtype_name(t.dtype), list(t.shape)])
        layers.append(entries)
    data = b"".join(parts)
    header = json.dumps({"layers": layers, "nbytes": len(data), "crc32": zlib.crc32(data)},
                        separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + data


def _check_spec(layers: list, spec: PageSpec) -> None:
    if len(layers) != len(spec):
        raise PayloadError(f"page has {len(layers)} layers, expected {len(spec)}")
    for i, (got, want) in enumerate(zip(layers, spec)):
        g = [(n, _parse_dtype(d), tuple(s)) for n, d, s in got]
        w = [(s.name, s.dtype, tuple(s.shape)) for s in want]
        if g != w:
            raise PayloadError(f"layer {i}: page holds {_fmt(g)}, expected {_fmt(w)}")


def check_payload(payload: PagePayload, spec: PageSpec) -> None:
    """Raises PayloadError unless payload has exactly spec's layers, names, shapes and dtypes."""
    _check_spec([[[n, _dtype_name(t.dtype), list(t.shape)] for n, t in layer.items()] for layer in payload], spec)


def _fmt(entries: list) -> str:
    return ", ".join(f"{n}:{_dtype_name(d)}{list(s)}" for n, d, s in entries)


def deserialize_page(blob: bytes, spec: PageSpec | None = None) -> PagePayload:
    """The page in blob; checked against spec when given. Raises PayloadError if corrupted."""
    if len(blob) < _PREFIX.size:
        raise PayloadError(f"page is {len(blob)} bytes, shorter than its {_PREFIX.size}-byte prefix")
    magic, version, hlen = _PREFIX.unpack_from(blob)
    if magic != MAGIC:
        raise PayloadError(f"not a KV page (magic {magic!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise PayloadError(f"page format version {version}, this reader knows {VERSION}")
    start = _PREFIX.size + hlen
    try:
        header = json.loads(bytes(blob[_PREFIX.size : start]))
        layers, nbytes, crc = header["layers"], int(header["nbytes"]), int(header["crc32"])
    except (ValueError, KeyError, TypeError) as e:
        raise PayloadError(f"page header is unreadable: {e}") from None
    data = blob[start:]
    if len(data) != nbytes:
        raise PayloadError(f"page data is {len(data)} bytes, header says {nbytes} (truncated or padded)")
    if zlib.crc32(data) != crc:
        raise PayloadError("page data fails its CRC32 check (corrupted)")
    try:
        if spec is not None:
            _check_spec(layers, spec)
        return _split(data, layers)
    except (ValueError, TypeError) as e:
        raise e if isinstance(e, PayloadError) else PayloadError(f"page header is inconsistent: {e}") from None


def _split(data: bytes, layers: list) -> PagePayload:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    out, off = [], 0
    for entries in layers:
        layer = {}
        for name, dname, shape in entries:
            dtype = _parse_dtype(dname)
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            off += -off % ALIGN
            if off + n > len(data):
                raise PayloadError(f"tensor {name!r} runs past the page data ({off + n} > {len(data)})")
            layer[name] = buf[off : off + n].view(dtype).reshape(shape)
            off += n
        out.append(layer)
    if off != len(data):
        raise PayloadError(f"page data has {len(data) - off} bytes no tensor accounts for")
    return out
