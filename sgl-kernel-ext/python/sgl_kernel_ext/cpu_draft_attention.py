"""Draft-decode attention on the CPU over compressed KV read in place (csrc/draft_decode_attention.cpp).

One query token per request over [compressed rows | exact tail | draft rows]. Compressed rows are
read as the pool stores them: token-dropped rows (exact dtype) or int8 / fp8 / kivi 2-4 bit /
kvquant 2-4 bit (non-uniform levels, exact outliers, pre-RoPE keys) / rotatekv 2-4 bit (Hadamard
basis, pre-RoPE keys) codes dequantized row by row in float32 inside the kernel, with the
compressors' own arithmetic (RoPE from the compressor's own cos / sin table, the Walsh-Hadamard
butterflies in rotatekv.fwht's order: the rows
equal `decompress()` bitwise, or `decompress().to(round_to)`), never expanded in memory (rotatekv
with float32 rows: its value rows' inverse transform is applied once to their weighted sum, equal to
float32 rounding). Under AVX-512, kvquant, rotatekv and kivi with float32 rows (what the model passes) and chunks of
16k rows (at consecutive positions: pre-RoPE keys) build no rows: keys are scored 16 at a time from their codes and values summed from theirs
(the same values, rounded in another order: equal to float32 rounding). The
reduction is batch invariant: each (request, KV head) goes over its keys in order, 64 at a time,
float32 online softmax; a row's output does not depend on the batch, other rows, padding or the
thread count.

`compressed_layer` names a compressed layer's pool buffers (the layouts of sglang_vericache's
compress/ package, by tensor name) in the kernel's terms; `draft_decode_attention_ref` is plain
softmax attention over given float contexts, the reference for tests. Built on first use like
cpu_attention (same machinery, its own library); `scripts/setup_cpu.sh` builds it up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from sgl_kernel_ext.cpu_attention import build_library

_SOURCE = Path(__file__).parent / "csrc" / "draft_decode_attention.cpp"
# The dequantization rounds each step as torch does (no fused multiply-add contraction); the
# kernel's dot products use explicit FMA instructions.
_CFLAGS = ("-ffp-contract=off",)
KINDS = {"token_drop": 0, "int8": 1, "fp8": 2, "kivi": 3, "kvquant": 4, "rotatekv": 5}
KVQUANT_NAMES = ("k_codes", "k_scale", "k_zero", "k_levels", "k_out_val", "k_out_idx",
                 "v_codes", "v_scale", "v_zero", "v_levels", "v_out_val", "v_out_idx", "pos")
ROTATEKV_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "pos")
ROUND_TO = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def load() -> None:
    """Build (once per source and CPU) and load the kernel; RuntimeError if it cannot be built."""
    build_library(_SOURCE, "sgl_kernel_ext_draft_cpu", _CFLAGS)


@dataclass(frozen=True)
class CompressedLayer:
    """One layer of a compressed pool as the kernel reads it."""

    kind: str  # a key of KINDS
    bits: int  # kivi / kvquant / rotatekv code width (0 otherwise)
    tensors: tuple[torch.Tensor, ...]  # in the kernel's order (see the .cpp header)
    params: tuple[int, ...] = ()  # rotatekv: (key_heads, block)


def compressed_layer(
    layout_kind: str,
    buffers: dict[str, torch.Tensor],
    rope_table: tuple[torch.Tensor, torch.Tensor] | None = None,
    rotation: tuple[int, int] | None = None,
) -> CompressedLayer | None:
    """A compressed layer's pool buffers ({name: [num_chunks + 1, ...]}) -> what the kernel reads,
    or None for a layout it does not know. kvquant and rotatekv (pre-RoPE keys) also need
    rope_table: the compressor's float32 cos, sin [P, D] covering every stored position
    (ChunkRope.table); rotatekv also rotation = (key_heads, block): its Hadamard grouping."""
    names = set(buffers)
    if layout_kind == "quantized" and names in (set(KVQUANT_NAMES), set(ROTATEKV_NAMES)):
        if rope_table is None or buffers["k_codes"].dtype != torch.uint8:
            return None
        cos, sin = (t.float().contiguous() for t in rope_table)
        d = cos.shape[-1]
        tables = _one_angle_per_pair(cos, sin)
        bits = 8 * buffers["k_codes"].shape[-1] // d
        if names == set(KVQUANT_NAMES):
            return CompressedLayer("kvquant", bits, (*(buffers[n] for n in KVQUANT_NAMES), *tables))
        if rotation is None:
            return None
        return CompressedLayer("rotatekv", bits, (*(buffers[n] for n in ROTATEKV_NAMES), *tables),
                               tuple(int(x) for x in rotation))
    if layout_kind == "token_drop" and {"k", "v"} <= names:
        tags = (buffers["head"],) if "head" in names else ()  # head-adaptive budgets: each cell's KV head
        return CompressedLayer("token_drop", 0, (buffers["k"], buffers["v"], *tags))
    if layout_kind != "quantized":
        return None
    k = buffers.get("k")
    if names == {"k", "k_scale", "v", "v_scale"}:
        fp8 = getattr(torch, "float8_e4m3fn", None)
        if k.dtype == torch.int8:
            return CompressedLayer("int8", 0, (k, buffers["k_scale"], buffers["v"], buffers["v_scale"]))
        if fp8 is not None and k.dtype == fp8:  # codes read as their bytes
            return CompressedLayer("fp8", 0, (k.view(torch.uint8), buffers["k_scale"],
                                              buffers["v"].view(torch.uint8), buffers["v_scale"]))
        return None
    if names == {"k", "k_scale", "k_zero", "v", "v_scale", "v_zero"} and k.dtype == torch.uint8:
        bits = 8 * k.shape[-1] // buffers["k_scale"].shape[-1]  # packed bytes per row vs head_dim
        if bits not in (2, 4):
            return None
        order = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero")
        return CompressedLayer("kivi", bits, tuple(buffers[n] for n in order))
    return None


_EMPTY = torch.empty(0, dtype=torch.int64)
_HALVES: dict[int, tuple] = {}  # id(cos) -> (cos, sin, what _one_angle_per_pair gives): the last few tables seen
_NO_TABLE = torch.empty(0)


def _pair_major(half: torch.Tensor) -> torch.Tensor:
    """[P, D/2] -> [D/2, P + 16] (the first P columns: half transposed): rows 16 floats longer than P so the rows of a
    block of positions do not all fall in one cache set (P is a power of two)."""
    out = torch.zeros(half.shape[1], half.shape[0] + 16, dtype=half.dtype)
    out[:, : half.shape[0]] = half.t()
    return out


def _one_angle_per_pair(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A [P, D] RoPE table -> (cos, sin, cos_t, sin_t) as the kernel reads it. Where its channel pairs
    (d, d + D/2) share their angles (ChunkRope's: cos, sin = cat(freqs, freqs)): the first halves [P, D/2]
    (half the loads per key row) and the same pair-major, [D/2, P + 16] (the key-score paths read 16 positions
    of a pair at once); any other table as it is, with no pair-major copy. Once per table object (the tables are
    cached)."""
    hit = _HALVES.get(id(cos))
    if hit is None or hit[0] is not cos or hit[1] is not sin:
        h = cos.shape[-1] // 2
        if torch.equal(cos[:, :h], cos[:, h:]) and torch.equal(sin[:, :h], sin[:, h:]):
            halves = (cos[:, :h].contiguous(), sin[:, :h].contiguous())
            tables = (*halves, *(_pair_major(t) for t in halves))
        else:
            tables = (cos, sin, _NO_TABLE, _NO_TABLE)
        if len(_HALVES) >= 4:  # tables grow by doubling: old ones are not asked for again
            _HALVES.clear()
        hit = _HALVES[id(cos)] = (cos, sin, tables)
    return hit[2]


def draft_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    compressed: CompressedLayer,
    chunk_ids: torch.Tensor,  # [B, C] int64, request b reads chunk_ids[b, :chunk_lens[b]]
    chunk_lens: torch.Tensor,  # [B]
    tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],  # k, v [N, Hkv, D], index [B, S_t], lens [B]
    draft: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,  # as tail (draft pool), or None
    scale: float,
    round_to: torch.dtype = torch.float32,
) -> torch.Tensor:
    """-> float32 [B, H, Dv]. Dequantized rows are rounded to `round_to` (bfloat16 / float16: as a
    context held in that dtype would store them). Head dims must be multiples of 8; every request
    needs at least one key."""
    load()
    tail_k, tail_v, tail_index, tail_lens = tail
    draft_k, draft_v, draft_index, draft_lens = draft if draft is not None else (_EMPTY, _EMPTY, _EMPTY, _EMPTY)
    def i64(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int64).contiguous()

    return torch.ops.sgl_kernel_ext_draft_cpu.draft_decode_attention(
        q.float().contiguous(), KINDS[compressed.kind], compressed.bits, ROUND_TO[round_to], list(compressed.tensors),
        i64(chunk_ids), i64(chunk_lens), tail_k, tail_v, i64(tail_index), i64(tail_lens),
        draft_k, draft_v, i64(draft_index), i64(draft_lens), float(scale), list(compressed.params),
    )


def draft_decode_attention_ref(
    q: torch.Tensor,  # [B, H, D]
    keys: list[torch.Tensor],  # per request [S_b, Hkv, D], its whole context in order
    values: list[torch.Tensor],  # per request [S_b, Hkv, Dv]
    scale: float,
) -> torch.Tensor:
    """Softmax attention in float64 over float contexts (query head h reads KV head h // G) -> float32."""
    b_, h, _ = q.shape
    out = []
    for b in range(b_):
        k, v = keys[b].double(), values[b].double()
        g = h // k.shape[1]
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [S, H, D]
        scores = torch.einsum("hd,shd->hs", q[b].double() * scale, k)
        out.append(torch.einsum("hs,shd->hd", torch.softmax(scores, -1), v))
    return torch.stack(out).float()
