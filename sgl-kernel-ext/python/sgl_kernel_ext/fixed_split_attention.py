"""Batch-invariant attention for the triton backend under --enable-deterministic-inference.

+----------------------------------------------------------------------------------------------+
| Invariant: query row t (one token, all its heads) attends to the first row_len[t] keys of     |
| table row row_table[t]. Those keys are cut into fixed chunks of CHUNK keys at absolute key   |
| positions [c*CHUNK, (c+1)*CHUNK); each chunk is reduced on its own (float32 max, exp, sum    |
| and exp-weighted V), then the chunk partials are folded in chunk order, c = 0 first. Every  |
| reduction is per element (a float32 IEEE tl.dot on a GPU walks K in order for each output; |
| under the interpreter, broadcast products summed by numpy per element), so a row's bits are |
| a function of (its query, its keys and values, in order): not of the number of rows,        |
| requests or splits, the tile the row sits in or its place there, or the chunks computed in  |
| parallel. So a TARGET_VERIFY row equals the DECODE row of the same position, an EXTEND row   |
| equals both, and every path of the triton backend that uses this kernel (the direct pool    |
| paths and the torch-path layouts: padded, ragged, staged, draft contexts) agrees bitwise.   |
| The three forms (fused, split, gather; see fixed_split_attention) are tested equal.         |
+----------------------------------------------------------------------------------------------+

Not bitwise equal to the CPU kernel (cpu_attention.fixed_chunk_attention): that one sums q.k over d
and the 64 exp-weights sequentially and takes libm's exp; a Triton tile reduces with tl.dot /
tl.sum trees. The two agree to float32 rounding; a server uses one of them for every row.

K/V are read as stored, converted to q's dtype (as a decode step reads --kv-cache-dtype) and then to
float32; products are float32 (IEEE) in every dtype. Output: float32 [T, H, Dv].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext._common import block_h, ceil_div, interp_helper, is_interpreting, row_max, row_sum

CHUNK = 64  # keys per chunk (the CPU kernel's chunk)
BLOCK_T = 16  # query rows of one request per program of the fused kernel
MAX_PARTIAL_BYTES = 256 * 1024 * 1024  # split kernel: stage-1 partials of one launch
GATHER_ELEMENTS = 1 << 20  # gather kernel: elements of its largest temporary ([rows, CHUNK, D])
FORMS = ("fused", "split", "gather")


@interp_helper
def _chunk(qf, kv, vv, k_ok, has, USE_DOT: tl.constexpr, PER_ROW: tl.constexpr = False):
    """One chunk for the tile's rows: (max, sum of exp-weights, exp-weighted V sum, has a key).
    Rows without a key in the chunk get (0, 0, 0, False). Every row's result is computed from its
    own query and keys only: tl.dot on a GPU; under the interpreter (whose numpy dot rounds a row by
    its place in the tile) broadcast products reduced per element. kv / vv: [CHUNK, D] shared by the
    tile, or [rows, CHUNK, D] (PER_ROW: each row its own keys; the same per-element sums)."""
    kf = kv.to(tl.float32)
    vf = vv.to(tl.float32)
    if not PER_ROW:
        kf = kf[None, :, :]
        vf = vf[None, :, :]
    if USE_DOT:
        s = tl.dot(qf, tl.trans(kv.to(tl.float32)), input_precision="ieee")
    else:
        s = row_sum(qf[:, None, :] * kf, 2)
    s = tl.where(k_ok, s, float("-inf"))
    m = tl.where(has, row_max(s, 1), 0.0)
    p = tl.exp(s - m[:, None])  # masked keys: exp(-inf) = 0
    ll = row_sum(p, 1)
    if USE_DOT:
        o = tl.dot(p, vv.to(tl.float32), input_precision="ieee")
    else:
        o = row_sum(p[:, :, None] * vf, 1)
    return m, ll, o, has


@interp_helper
def _fold(m, ll, acc, mc, lc, oc, has):
    """Fold one chunk partial into a row's running (max, sum, output); rows without a key keep theirs."""
    m_new = tl.maximum(m, mc)
    alpha = tl.exp(m - m_new)  # 0 on a row's first chunk (m = -inf)
    beta = tl.exp(mc - m_new)
    ll_new = ll * alpha + lc * beta
    acc_new = acc * alpha[:, None] + oc * beta[:, None]
    return tl.where(has, m_new, m), tl.where(has, ll_new, ll), tl.where(has[:, None], acc_new, acc)


@interp_helper
def _finish(ll, acc):
    return tl.where(ll[:, None] > 0, acc / tl.maximum(ll, 1e-30)[:, None], 0.0)  # no key: zeros


@interp_helper
def _tile(q, row_table, row_len, t0, nrows, hk, sm_scale, stride_qt, stride_qh,
          G: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Tile row r = (query row t0 + r // BLOCK_H, head hk * G + r % BLOCK_H): its scaled query,
    its visible key count, whether it is real, and the table row the tile reads."""
    r = tl.arange(0, ROWS * BLOCK_H)
    ti = r // BLOCK_H
    hh = r % BLOCK_H
    ok = (ti < nrows) & (hh < G)
    od = tl.arange(0, BLOCK_D)
    qv = tl.load(q + (t0 + ti)[:, None] * stride_qt + (hk * G + hh)[:, None] * stride_qh + od[None, :],
                 mask=ok[:, None] & (od[None, :] < D), other=0.0)
    n = tl.load(row_len + t0 + ti, mask=ok, other=0).to(tl.int32)
    return qv.to(tl.float32) * sm_scale, n, ok, tl.load(row_table + t0).to(tl.int64)


@interp_helper
def _load_chunk(q, k_buf, v_buf, table, trow, c, hk, stride_kn, stride_kh, stride_vn, stride_vh, stride_tab,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                CHUNK: tl.constexpr, limit):
    """Keys [c*CHUNK, c*CHUNK + CHUNK) of table row trow (those < limit), read in q's dtype."""
    offs = c * CHUNK + tl.arange(0, CHUNK)
    in_row = offs < limit
    slot = tl.load(table + trow * stride_tab + offs, mask=in_row, other=0).to(tl.int64)
    od = tl.arange(0, BLOCK_D)
    odv = tl.arange(0, BLOCK_DV)
    kv = tl.load(k_buf + slot[:, None] * stride_kn + hk * stride_kh + od[None, :],
                 mask=in_row[:, None] & (od[None, :] < D), other=0.0)
    vv = tl.load(v_buf + slot[:, None] * stride_vn + hk * stride_vh + odv[None, :],
                 mask=in_row[:, None] & (odv[None, :] < DV), other=0.0)
    return offs, kv.to(q.dtype.element_ty), vv.to(q.dtype.element_ty)


@triton.jit
def _fused_kernel(
    q, k_buf, v_buf, table, row_table, row_len, block_start, block_rows, out, sm_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tab, stride_yt, stride_yh,
    G: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, USE_DOT: tl.constexpr,
):
    """One program = up to ROWS query rows of one request x the G heads of KV head hk, over all
    their chunks in order."""
    blk = tl.program_id(0)
    hk = tl.program_id(1)
    t0 = tl.load(block_start + blk).to(tl.int32)
    nrows = tl.load(block_rows + blk).to(tl.int32)
    qf, n, ok, trow = _tile(q, row_table, row_len, t0, nrows, hk, sm_scale, stride_qt, stride_qh,
                            G, BLOCK_H, ROWS, D, BLOCK_D)
    limit = row_max(n, 0)
    m = tl.full([ROWS * BLOCK_H], float("-inf"), tl.float32)
    ll = tl.zeros([ROWS * BLOCK_H], tl.float32)
    acc = tl.zeros([ROWS * BLOCK_H, BLOCK_DV], tl.float32)
    for c in range(0, ceil_div(limit, CHUNK)):
        offs, kv, vv = _load_chunk(q, k_buf, v_buf, table, trow, c, hk, stride_kn, stride_kh, stride_vn,
                                   stride_vh, stride_tab, D, DV, BLOCK_D, BLOCK_DV, CHUNK, limit)
        mc, lc, oc, has = _chunk(qf, kv, vv, offs[None, :] < n[:, None], c * CHUNK < n, USE_DOT)
        m, ll, acc = _fold(m, ll, acc, mc, lc, oc, has)
    r = tl.arange(0, ROWS * BLOCK_H)
    odv = tl.arange(0, BLOCK_DV)
    dst = out + (t0 + r // BLOCK_H)[:, None] * stride_yt + (hk * G + r % BLOCK_H)[:, None] * stride_yh
    tl.store(dst + odv[None, :], _finish(ll, acc), mask=ok[:, None] & (odv[None, :] < DV))


@triton.jit
def _gather_kernel(
    q, k_buf, v_buf, table, row_table, row_len, out, T, sm_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tab, stride_yt, stride_yh,
    H: tl.constexpr, G: tl.constexpr, BLOCK_HQ: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
    DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr,
):
    """The interpreter's form (few programs: each op there costs ~1 ms): one program = ROWS query rows
    of any requests x all heads, every tile row gathering its own keys ([rows, CHUNK, D] loads). The
    same per-element arithmetic as _fused_kernel's sum path, so the same bits (tested)."""
    r = tl.arange(0, ROWS * BLOCK_HQ)
    t = tl.program_id(0) * ROWS + r // BLOCK_HQ
    h = r % BLOCK_HQ
    ok = (t < T) & (h < H)
    hk = h // G
    od = tl.arange(0, BLOCK_D)
    odv = tl.arange(0, BLOCK_DV)
    qv = tl.load(q + t[:, None] * stride_qt + h[:, None] * stride_qh + od[None, :],
                 mask=ok[:, None] & (od[None, :] < D), other=0.0)
    qf = qv.to(tl.float32) * sm_scale
    n = tl.load(row_len + t, mask=ok, other=0).to(tl.int32)
    trow = tl.load(row_table + t, mask=ok, other=0).to(tl.int64)
    limit = row_max(n, 0)
    m = tl.full([ROWS * BLOCK_HQ], float("-inf"), tl.float32)
    ll = tl.zeros([ROWS * BLOCK_HQ], tl.float32)
    acc = tl.zeros([ROWS * BLOCK_HQ, BLOCK_DV], tl.float32)
    for c in range(0, ceil_div(limit, CHUNK)):
        offs = c * CHUNK + tl.arange(0, CHUNK)
        k_ok = offs[None, :] < n[:, None]  # [rows, CHUNK]
        slot = tl.load(table + trow[:, None] * stride_tab + offs[None, :], mask=k_ok, other=0).to(tl.int64)
        base = slot[:, :, None] * stride_kn + hk[:, None, None] * stride_kh
        kv = tl.load(k_buf + base + od[None, None, :], mask=k_ok[:, :, None] & (od[None, None, :] < D), other=0.0)
        vbase = slot[:, :, None] * stride_vn + hk[:, None, None] * stride_vh
        vv = tl.load(v_buf + vbase + odv[None, None, :], mask=k_ok[:, :, None] & (odv[None, None, :] < DV),
                     other=0.0)
        mc, lc, oc, has = _chunk(qf, kv.to(q.dtype.element_ty), vv.to(q.dtype.element_ty), k_ok, c * CHUNK < n,
                                 False, True)
        m, ll, acc = _fold(m, ll, acc, mc, lc, oc, has)
    dst = out + t[:, None] * stride_yt + h[:, None] * stride_yh + odv[None, :]
    tl.store(dst, _finish(ll, acc), mask=ok[:, None] & (odv[None, :] < DV))


@triton.jit
def _split_kernel(
    q, k_buf, v_buf, table, row_table, row_len, part_o, part_ml, sm_scale,
    stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tab,
    stride_ot, stride_oh, stride_oc, stride_mt, stride_mh, stride_mc,
    G: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr, USE_DOT: tl.constexpr,
):
    """Stage 1 of the split form: one program = one query row's G heads x one chunk."""
    t = tl.program_id(0)
    hk = tl.program_id(1)
    c = tl.program_id(2)
    qf, n, ok, trow = _tile(q, row_table, row_len, t, 1, hk, sm_scale, stride_qt, stride_qh,
                            G, BLOCK_H, 1, D, BLOCK_D)
    limit = row_max(n, 0)
    if c * CHUNK < limit:
        offs, kv, vv = _load_chunk(q, k_buf, v_buf, table, trow, c, hk, stride_kn, stride_kh, stride_vn,
                                   stride_vh, stride_tab, D, DV, BLOCK_D, BLOCK_DV, CHUNK, limit)
        mc, lc, oc, has = _chunk(qf, kv, vv, offs[None, :] < n[:, None], c * CHUNK < n, USE_DOT)
        hh = tl.arange(0, BLOCK_H)
        odv = tl.arange(0, BLOCK_DV)
        heads = hk * G + hh
        tl.store(part_o + t * stride_ot + heads[:, None] * stride_oh + c * stride_oc + odv[None, :], oc,
                 mask=ok[:, None] & (odv[None, :] < DV))
        ml = part_ml + t * stride_mt + heads * stride_mh + c * stride_mc
        tl.store(ml, mc, mask=ok)
        tl.store(ml + 1, lc, mask=ok)


@triton.jit
def _merge_kernel(
    part_o, part_ml, row_len, out,
    stride_ot, stride_oh, stride_oc, stride_mt, stride_mh, stride_mc, stride_yt, stride_yh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr,
):
    """Stage 2 of the split form: one program = one (query row, head), its chunks folded in order."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(row_len + t).to(tl.int32)
    odv = tl.arange(0, BLOCK_DV)
    d_ok = odv < DV
    m = tl.full([1], float("-inf"), tl.float32)
    ll = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, BLOCK_DV], tl.float32)
    has = tl.full([1], 1, tl.int1)
    for c in range(0, ceil_div(n, CHUNK)):
        ml = part_ml + t * stride_mt + h * stride_mh + c * stride_mc
        mc = tl.load(ml + tl.zeros([1], tl.int32))
        lc = tl.load(ml + 1 + tl.zeros([1], tl.int32))
        oc = tl.load(part_o + t * stride_ot + h * stride_oh + c * stride_oc + odv[None, :], mask=d_ok[None, :],
                     other=0.0)
        m, ll, acc = _fold(m, ll, acc, mc, lc, oc, has)
    tl.store(out + t * stride_yt + h * stride_yh + odv[None, :], _finish(ll, acc), mask=d_ok[None, :])


def _use_dot() -> bool:
    return not is_interpreting()


def fixed_split_attention(
    q: torch.Tensor,  # [T, H, D]
    k_buffer: torch.Tensor,  # [N, Hkv, D]
    v_buffer: torch.Tensor,  # [N, Hkv, Dv]
    table: torch.Tensor,  # [R, S] int: slot of each key position (req_to_token, or a context index)
    row_table: torch.Tensor,  # [T] int: the table row query row t reads
    row_len: torch.Tensor,  # [T] int: query row t sees keys [0, row_len[t]) of its table row
    sm_scale: float,
    rows_per_request: list[int] | None = None,  # runs of consecutive rows sharing a table row (None: 1 each)
    form: str | None = None,  # FORMS; None: "gather" under the interpreter, else "fused"
) -> torch.Tensor:
    """-> float32 [T, H, Dv] (see the module docstring for what is invariant). The forms give the same
    bits: "fused" (one program per <= 16 rows of a request x KV head, its chunks in order), "split"
    (chunks in parallel, then a merge in order: decode rows on a GPU), "gather" (the interpreter's:
    few programs, each tile row gathering its own keys)."""
    form = form or ("gather" if is_interpreting() else "fused")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, got {form!r}")
    t, h, d = q.shape
    hkv, dv = k_buffer.shape[1], v_buffer.shape[2]
    if k_buffer.shape[2] != d or h % hkv or v_buffer.shape[1] != hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, v {tuple(v_buffer.shape)}: "
                         "head dims or KV heads disagree")
    if row_table.shape != (t,) or row_len.shape != (t,):
        raise ValueError(f"row_table / row_len must be [{t}], got {tuple(row_table.shape)} / {tuple(row_len.shape)}")
    if rows_per_request is not None and sum(rows_per_request) != t:
        raise ValueError(f"rows_per_request sums to {sum(rows_per_request)}, q has {t} rows")
    out = torch.empty((t, h, dv), dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    g = h // hkv
    q, table, row_table, row_len = q.contiguous(), table.contiguous(), row_table.contiguous(), row_len.contiguous()
    common = (k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1), table.stride(0))
    # Tile heights: on a GPU >= 16 rows (tl.dot's minimum); a row's bits do not depend on them (both
    # reductions are per element: a float32 IEEE tl.dot walks K in order for each element).
    bh = triton.next_power_of_2(g) if is_interpreting() else block_h(g)
    shapes = dict(G=g, BLOCK_H=bh, D=d, DV=dv, BLOCK_D=triton.next_power_of_2(d),
                  BLOCK_DV=triton.next_power_of_2(dv), CHUNK=CHUNK, enable_fp_fusion=False)
    if form == "gather":
        per_row = triton.next_power_of_2(h) * CHUNK * max(shapes["BLOCK_D"], shapes["BLOCK_DV"])
        rows = min(triton.next_power_of_2(t), 1 << max(0, (GATHER_ELEMENTS // per_row).bit_length() - 1))
        _gather_kernel[(triton.cdiv(t, rows),)](
            q, k_buffer, v_buffer, table, row_table, row_len, out, t, float(sm_scale),
            q.stride(0), q.stride(1), *common, out.stride(0), out.stride(1),
            H=h, BLOCK_HQ=triton.next_power_of_2(h), ROWS=rows,
            **{key: val for key, val in shapes.items() if key != "BLOCK_H"})
        return out
    if form == "fused":
        starts, rows = [], []
        t0, runs = 0, rows_per_request or [1] * t
        tile_rows = 1 if max(runs) == 1 else BLOCK_T
        for n in runs:
            for b0 in range(0, n, tile_rows):
                starts.append(t0 + b0)
                rows.append(min(tile_rows, n - b0))
            t0 += n
        blocks = torch.tensor([starts, rows], dtype=torch.int32).to(q.device)
        _fused_kernel[(len(starts), hkv)](
            q, k_buffer, v_buffer, table, row_table, row_len, blocks[0], blocks[1], out, float(sm_scale),
            q.stride(0), q.stride(1), *common, out.stride(0), out.stride(1),
            ROWS=tile_rows, USE_DOT=_use_dot(), **shapes)
        return out
    chunks = max(1, triton.cdiv(int(row_len.max()), CHUNK))
    rows_per_launch = max(1, MAX_PARTIAL_BYTES // (h * chunks * (dv + 2) * 4))
    for t0 in range(0, t, rows_per_launch):
        t1 = min(t, t0 + rows_per_launch)
        part_o = torch.empty((t1 - t0, h, chunks, dv), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((t1 - t0, h, chunks, 2), dtype=torch.float32, device=q.device)
        qs, ys, lens = q[t0:t1], out[t0:t1], row_len[t0:t1]
        _split_kernel[(t1 - t0, hkv, chunks)](
            qs, k_buffer, v_buffer, table, row_table[t0:t1], lens, part_o, part_ml, float(sm_scale),
            qs.stride(0), qs.stride(1), *common, *part_o.stride()[:3], *part_ml.stride()[:3],
            USE_DOT=_use_dot(), **shapes)
        _merge_kernel[(t1 - t0, h)](
            part_o, part_ml, lens, ys, *part_o.stride()[:3], *part_ml.stride()[:3], ys.stride(0), ys.stride(1),
            DV=dv, BLOCK_DV=shapes["BLOCK_DV"], CHUNK=CHUNK, enable_fp_fusion=False)
    return out


def compact_rows(index: torch.Tensor, allowed: torch.Tensor | None, q_len: int):
    """(index [B, S], allowed [B, Lq, S] | None) -> (table, row_table, row_len) for
    fixed_split_attention: each request's visible columns moved to the front in order, and each
    query row's visible keys, which must then be a prefix of them (causal, padded and draft-context
    masks are; anything else is refused rather than chunked at other positions)."""
    b, s = index.shape
    dev = index.device
    row_table = torch.arange(b, device=dev).repeat_interleave(q_len)
    if allowed is None:
        return index, row_table, torch.full((b * q_len,), s, dtype=torch.int64, device=dev)
    union = allowed.any(1)  # [B, S]
    order = torch.argsort((~union).to(torch.int8), dim=1, stable=True)
    table = index.gather(1, order)
    visible = allowed.gather(2, order[:, None, :].expand(b, q_len, s))
    row_len = visible.sum(-1)  # [B, Lq]
    if not torch.equal(visible, torch.arange(s, device=dev) < row_len[..., None]):
        raise ValueError("fixed_split_attention: a query row's visible keys are not a prefix of its request's")
    return table, row_table, row_len.reshape(-1)


def fixed_split_attention_masked(q, k_src, v_src, index, allowed, scale) -> torch.Tensor:
    """cpu_attention.fixed_chunk_attention's interface (q [B, Lq, H, D], index [B, S], allowed
    [B, Lq, S] | None) on this kernel -> float32 [B, Lq, H, Dv]; the torch-path layouts use it."""
    b, lq, h, d = q.shape
    table, row_table, row_len = compact_rows(index, allowed, lq)
    out = fixed_split_attention(q.reshape(b * lq, h, d), k_src, v_src, table, row_table, row_len, scale, [lq] * b)
    return out.view(b, lq, h, -1)
