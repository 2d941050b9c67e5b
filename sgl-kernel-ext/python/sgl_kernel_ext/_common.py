"""Pieces every attention kernel shares: launch helpers and the online-softmax block update.

+------------------------------------------------------------------------------------+
| Partial results (flash decoding): a stage-1 program covers one split of one part   |
| of one request's keys for the G query heads of one KV head, and writes            |
|   o_part[b, h, p, :] = sum_j softmax-weight_j * v_j   (already divided by l)       |
|   lse_part[b, h, p]   = m + log(l)    (-inf when the split holds no key)           |
| at its partial index p = part offset + split. decode_merge combines the P partials. |
+------------------------------------------------------------------------------------+
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

NUM_SMS_GUESS = 132  # H100/H200; only sizes the default split count


def is_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_f32(q: torch.Tensor) -> bool:
    """Run tl.dot in float32 (IEEE)? Always under the interpreter (its bf16/fp16 dot is wrong)
    and for float32 queries; otherwise operands are cast to q's dtype (as the torch backend does)."""
    return is_interpreting() or q.dtype == torch.float32


def block_h(group: int) -> int:
    """Query heads per program, padded to tl.dot's minimum of 16 rows."""
    return max(16, triton.next_power_of_2(group))


def default_splits(batch: int, num_kv_heads: int, max_keys: int, block_n: int) -> int:
    """Splits per request so that B * Hkv * splits fills the GPU about twice, <= key blocks."""
    want = triton.cdiv(2 * NUM_SMS_GUESS, max(1, batch * num_kv_heads))
    return max(1, min(want, triton.cdiv(max(1, max_keys), block_n), 64))


def check_qkv(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> int:
    """-> the GQA group size G = Hq / Hkv."""
    assert q.shape[-1] == head_dim, f"q head_dim {q.shape[-1]} != kv head_dim {head_dim}"
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16, "head_dim: power of 2, >= 16"
    assert q.shape[-2] % num_kv_heads == 0, f"{q.shape[-2]} q heads not a multiple of {num_kv_heads}"
    return q.shape[-2] // num_kv_heads


# Under the interpreter every call of a jit function (tl.sum, tl.max, tl.cdiv and any helper) re-patches
# triton.language first (~2 ms each, most of a small kernel's time). Kernels that run in the CPU
# tests use these instead: plain functions there (the same numpy reductions), jit helpers on a GPU.
if is_interpreting():
    def interp_helper(fn):
        return fn

    def row_sum(x, axis):
        return tl.reduce(x, axis, tl.standard._sum_combine)

    def row_max(x, axis):
        return tl.reduce(x, axis, tl.standard._elementwise_max)

    def ceil_div(x, d):
        return (x + d - 1) // d
else:
    interp_helper = triton.jit

    @triton.jit
    def row_sum(x, axis: tl.constexpr):
        return tl.sum(x, axis=axis)

    @triton.jit
    def row_max(x, axis: tl.constexpr):
        return tl.max(x, axis=axis)

    @triton.jit
    def ceil_div(x, d):
        return tl.cdiv(x, d)


@interp_helper
def chunk_keys(chunk_ids, b, stride_cb, n0, hi, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key block n0 of a request whose keys are the rows of its chunks in order (key n: row n % ROWS of chunk
    chunk_ids[b, n // ROWS]) -> (ok: the keys below hi, their chunk ids, their rows)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    ok = offs_n < hi
    cid = tl.load(chunk_ids + b * stride_cb + offs_n // ROWS, mask=ok, other=0).to(tl.int64)
    return ok, cid, offs_n % ROWS


@triton.jit
def split_range(length, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of split `split`: length cut into NUM_SPLITS runs of whole BLOCK_N blocks."""
    split_len = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    return lo, tl.minimum(lo + split_len, length)


@triton.jit
def load_query_group(q, b, h0, stride_qb, stride_qh, G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr):
    """Request b's G query heads [h0, h0 + G) (one KV head's group) as BLOCK_H rows -> (rows, rows_ok)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    rows_ok = offs_h < G
    qv = tl.load(
        q + b * stride_qb + (h0 + offs_h)[:, None] * stride_qh + offs_d[None, :],
        mask=rows_ok[:, None],
        other=0.0,
    )
    return qv, rows_ok


@triton.jit
def empty_softmax_state(BLOCK_H: tl.constexpr, D: tl.constexpr):
    """(running max, running sum, accumulator) before the first key block."""
    return (tl.full([BLOCK_H], -1e30, tl.float32), tl.zeros([BLOCK_H], tl.float32),
            tl.zeros([BLOCK_H, D], tl.float32))


@triton.jit
def online_softmax_block(q, k, v, valid, m_i, l_i, acc, sm_scale, DOT_F32: tl.constexpr):
    """One key block of flash attention. q [M, D], k/v [N, D], valid [M, N] (False: masked).
    State m_i/l_i [M] and acc [M, D] in float32; m_i starts at -1e30 (finite, so an all-masked
    block leaves the state unchanged instead of making NaNs)."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = tl.where(valid, s * sm_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_F32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def begin_split(q, b, kvh, split, length, stride_qb, stride_qh, G: tl.constexpr, NUM_SPLITS: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """A stage-1 program of request b, KV head kvh and split `split` over `length` keys, before its first key
    block: its keys [lo, hi), its G query heads from h0 = kvh * G (rows, rows_ok) and an empty softmax state.
    -> (lo, hi, h0, rows, rows_ok, m_i, l_i, acc)."""
    lo, hi = split_range(length, split, NUM_SPLITS, BLOCK_N)
    h0 = kvh * G
    qv, rows_ok = load_query_group(q, b, h0, stride_qb, stride_qh, G, BLOCK_H, D)
    m_i, l_i, acc = empty_softmax_state(BLOCK_H, D)
    return lo, hi, h0, qv, rows_ok, m_i, l_i, acc


@triton.jit
def store_partial(o_part, lse_part, b, h0, p, m_i, l_i, acc, rows_ok, num_heads, num_partials,
                  BLOCK_H: tl.constexpr, D: tl.constexpr):
    """Writes rows h0 + [0, BLOCK_H) (where rows_ok) of partial p into the contiguous [B, num_heads,
    num_partials, D] / [B, num_heads, num_partials] partials (new_partials); see the box above."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    at = (b * num_heads + h0 + offs_h) * num_partials + p  # (b, h, p) of each row
    tl.store(o_part + at[:, None] * D + offs_d[None, :], out, mask=rows_ok[:, None])
    tl.store(lse_part + at, lse, mask=rows_ok)


def new_partials(
    batch: int, num_heads: int, num_partials: int, head_dim: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Contiguous float32 partials o [B, H, P, D], lse [B, H, P] (store_partial and merge_partials
    address them by (b, h, p))."""
    o = torch.empty((batch, num_heads, num_partials, head_dim), dtype=torch.float32, device=device)
    lse = torch.empty((batch, num_heads, num_partials), dtype=torch.float32, device=device)
    return o, lse


def decode_partials(q: torch.Tensor, num_kv_heads: int, max_keys: int, sm_scale: float | None,
                    num_kv_splits: int | None, extra_parts: int, block_n: int):
    """A decode call's softmax scale, its splits of max_keys keys (num_kv_splits, else default_splits) and
    partials for them and extra_parts more (an exact tail's splits, the draft rows'):
    -> (scale, splits, o_part, lse_part)."""
    bs, nh, d = q.shape
    scale = d**-0.5 if sm_scale is None else sm_scale
    splits = num_kv_splits or default_splits(bs, num_kv_heads, max_keys, block_n)
    o_part, lse_part = new_partials(bs, nh, splits + extra_parts, d, q.device)
    return scale, splits, o_part, lse_part
