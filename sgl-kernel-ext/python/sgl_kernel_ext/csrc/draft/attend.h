// Draft-decode attention: the attend loop. Prefetches, one compressed row as float32 K / V rows, the
// key-score path's rows, and attend_item: one (request, KV heads) work item over its keys, CHUNK at a time.
#pragma once

#include "avx512_paths.h"
#include "rotatekv_rows.h"

namespace {

// Asks for what the row loop will read of compressed row j of chunk id, KV heads hk0 .. hk0 + nh - 1:
// its K / V codes (token-drop rows); at a chunk's first row the chunk's per-row float16 scales / zeros
// (every row's and head's: a few lines) and kvquant's per-channel key ranges, levels and outlier lists;
// at a kivi key group's first row its key scales / zeros. The row loop calls it
// PREFETCH_ROWS rows ahead: without prefetches each row's load is waited on in turn (token-drop
// drafting in bfloat16 at batch 16, context 1600 ran 2x slower on an AMD EPYC). One row at a time, as
// the fixed-chunk kernel does: a whole chunk's rows asked for at once, or every row's scales, cost an
// Intel Xeon (Sapphire Rapids) 10-15% on quantized rows against no prefetch at all (the prefetch
// instructions themselves: such rows are a few dozen instructions each). Inlined: called out of line,
// prefetches measured no gain.
__attribute__((always_inline)) inline void prefetch_row(const Compressed& cp, const Shape& sh, int64_t id, int64_t j,
                                                        int64_t hk0, int64_t nh) {
  const int64_t R = cp.rows, Hkv = sh.Hkv, kb = cp.row_bytes[0], vb = cp.row_bytes[1];
  const int64_t row = (id * R + j) * Hkv + hk0;
  prefetch_bytes(cp.k, row * kb, nh * kb);
  prefetch_bytes(cp.v, row * vb, nh * vb);
  if (j == 0) {  // the chunk's per-row scales / zeros, every head's (a few lines)
    const uint16_t* sc[4] = {cp.k_scale, cp.k_zero, cp.v_scale, cp.v_zero};
    for (int i = 0; i < 4; ++i)
      if (cp.scale_width[i]) prefetch_bytes(sc[i], id * R * Hkv * cp.scale_width[i] * 2, R * Hkv * cp.scale_width[i] * 2);
  }
  if (cp.kind == KIVI && j % cp.key_group == 0) {
    const int64_t at = ((id * (R / cp.key_group) + j / cp.key_group) * Hkv + hk0) * sh.D * 2;
    prefetch_bytes(cp.k_scale, at, sh.D * 2);
    prefetch_bytes(cp.k_zero, at, sh.D * 2);
  } else if (cp.kind == KVQUANT && j == 0) {
    const Rotated& rt = cp.rt;
    prefetch_bytes(cp.k_scale, (id * Hkv + hk0) * sh.D * 2, sh.D * 2);
    prefetch_bytes(cp.k_zero, (id * Hkv + hk0) * sh.D * 2, sh.D * 2);
    prefetch_bytes(rt.k_levels, id * rt.num_levels * 2, rt.num_levels * 2);
    prefetch_bytes(rt.v_levels, id * rt.num_levels * 2, rt.num_levels * 2);
    const int64_t ib = rt.idx32 ? 4 : 2, vsz = rt.out_elem == F32 ? 4 : 2;
    for (const void* p : {rt.k_out_idx, rt.v_out_idx}) prefetch_bytes(p, id * rt.n_out * ib, rt.n_out * ib);
    for (const void* p : {rt.k_out_val, rt.v_out_val}) prefetch_bytes(p, id * rt.n_out * vsz, rt.n_out * vsz);
  }
}

// prefetch_row for every row of chunk id (key_scores' windows: once a chunk, not a call a row).
inline void prefetch_chunk(const Compressed& cp, const Shape& sh, int64_t id, int64_t hk0, int64_t nh) {
  prefetch_row(cp, sh, id, 0, hk0, nh);
  const int64_t kb = cp.row_bytes[0], vb = cp.row_bytes[1];
  for (int64_t j = 1; j < cp.rows; ++j) {
    const int64_t row = (id * cp.rows + j) * sh.Hkv + hk0;
    prefetch_bytes(cp.k, row * kb, nh * kb);
    prefetch_bytes(cp.v, row * vb, nh * vb);
  }
}

// Row j (key group `group` for kivi) of chunk id, KV head hk, as float32 K and V rows: *kp / *vp
// point into the pool (float32 token-drop rows) or at kd / vd, where the row is dequantized and
// rounded to TO (token-drop rows are exact: never rounded).
template <Elem TO>
void compressed_row(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t group, int64_t hk,
                    float* kd, float* vd, const float** kp, const float** vp, Scratch& st) {
  const int64_t R = cp.rows, D = sh.D, Dv = sh.Dv, Hkv = sh.Hkv;
  const int64_t row = (id * R + j) * Hkv + hk;  // (chunk, row, head)
  if (cp.kind == TOKEN_DROP) {
    *kp = exact_row(cp.k, cp.elem, row * D, D, kd);
    *vp = exact_row(cp.v, cp.elem, row * Dv, Dv, vd);
    return;
  }
  *kp = kd;
  *vp = vd;
  if (cp.kind == KVQUANT) {
    if (cp.bits == 2) return kvquant_row<2, TO>(cp, sh, id, j, hk, kd, vd, st);
    if (cp.bits == 3) return kvquant_row<3, TO>(cp, sh, id, j, hk, kd, vd, st);
    return kvquant_row<4, TO>(cp, sh, id, j, hk, kd, vd, st);
  }
  if (cp.kind == INT8 || cp.kind == FP8) {
    const float ksc = half_to_float(cp.k_scale[row]), vsc = half_to_float(cp.v_scale[row]);
    if (cp.kind == INT8) {
      int8_row<TO>(static_cast<const int8_t*>(cp.k) + row * D, ksc, kd, D);
      int8_row<TO>(static_cast<const int8_t*>(cp.v) + row * Dv, vsc, vd, Dv);
    } else {
      fp8_row<TO>(static_cast<const uint8_t*>(cp.k) + row * D, ksc, kd, D);
      fp8_row<TO>(static_cast<const uint8_t*>(cp.v) + row * Dv, vsc, vd, Dv);
    }
    return;
  }
  // kivi: keys per channel (scale/zero shared by a group of key_group tokens), values per token
  if (id != st.group_chunk || group != st.group) {
    const int64_t at = ((id * (R / cp.key_group) + group) * Hkv + hk) * D;
    halves_to_float(cp.k_scale + at, st.ks.data(), D);
    halves_to_float(cp.k_zero + at, st.kz.data(), D);
    st.group_chunk = id;
    st.group = group;
  }
  const uint8_t* kc = static_cast<const uint8_t*>(cp.k) + row * (D * cp.bits / 8);
  const uint8_t* vc = static_cast<const uint8_t*>(cp.v) + row * (Dv * cp.bits / 8);
  const int64_t vg = cp.value_group, ng = Dv / vg;
  const uint16_t* vs16 = cp.v_scale + row * ng;
  const uint16_t* vz16 = cp.v_zero + row * ng;
  if (vg % VW != 0) {  // value groups narrower than a vector: scales expanded per channel
    for (int64_t gi = 0, d = 0; gi < ng; ++gi) {
      const float sc = half_to_float(vs16[gi]), z = half_to_float(vz16[gi]);
      for (int64_t e = 0; e < vg; ++e, ++d) st.vs[d] = sc, st.vz[d] = z;
    }
  }
  if (cp.bits == 4) {
    kivi_row<4, TO>(kc, st.ks.data(), st.kz.data(), kd, D);
    if (vg % VW == 0) kivi_row_grouped<4, TO>(vc, vs16, vz16, vg, vd, Dv);
    else kivi_row<4, TO>(vc, st.vs.data(), st.vz.data(), vd, Dv);
  } else {
    kivi_row<2, TO>(kc, st.ks.data(), st.kz.data(), kd, D);
    if (vg % VW == 0) kivi_row_grouped<2, TO>(vc, vs16, vz16, vg, vd, Dv);
    else kivi_row<2, TO>(vc, st.vs.data(), st.vz.data(), vd, Dv);
  }
}

// The compressed rows of request b on the key-score path (a function of its own: inlined into attend_item's row
// loop it slowed the other kinds' by ~10%): a chunk's rows CHUNK at most at a time, the values' sums into acc at
// the end (rotatekv: and back from its basis).
__attribute__((noinline)) void scored_item(const Compressed& cp, const Shape& sh, int64_t b, int64_t hk0, int64_t nh,
                                           Scratch& st) {
  const int64_t* ids = cp.ids + b * cp.width;
  const int64_t lens = cp.lens[b], QH = nh * sh.G, Dv = sh.Dv;
  if (!lens) return;
  std::fill(st.accq.begin(), st.accq.end(), 0.f);
  std::fill(st.zsum.begin(), st.zsum.end(), 0.f);
  prefetch_chunk(cp, sh, ids[0], hk0, nh);
  for (int64_t chunk = 0; chunk < lens; ++chunk) {
    if (chunk + 1 < lens) prefetch_chunk(cp, sh, ids[chunk + 1], hk0, nh);  // the next chunk's rows
    for (int64_t j = 0; j < cp.rows; j += CHUNK) {
      const int64_t cn = std::min(CHUNK, cp.rows - j);
      if (cp.kind == KVQUANT) scored_rows(cp, sh, ids[chunk], j, cn, hk0, st);
      else if (cp.kind == KIVI) kivi_scored_rows(cp, sh, ids[chunk], j, cn, hk0, st);
      else rkv_scored_rows(cp, sh, ids[chunk], j, cn, hk0, st);
    }
  }
  const int64_t vg = cp.kind == KVQUANT ? Dv : cp.kind == KIVI ? cp.value_group : cp.rt.group, nz = Dv / vg;
  for (int64_t qi = 0; qi < QH; ++qi)
    for (int64_t d = 0; d < Dv; ++d)
      st.acc[qi * Dv + d] += st.accq[qi * Dv + (cp.bits == 4 ? code_lane<4>(d) : d)] + st.zsum[qi * nz + d / vg];
  for (int64_t qi = 0; cp.kind == ROTATEKV && qi < QH; ++qi) fwht_blocks<F32>(st.acc.data() + qi * Dv, Dv, cp.rt.block);
}

// The G query heads of each of the KV heads hk0 .. hk0 + nh - 1 of request b over its keys, CHUNK at a time
// (nh > 1: one rotatekv Hadamard group, whose key rows are transformed together). Query head
// qi = hh * G + g of the item reads KV head hk0 + hh; its arithmetic does not depend on nh.
// Dequantized rows are rounded to TO (cp.round_to).
//
// rotatekv with float32 rows: the transform back of its value rows is linear, so it is applied once to
// the weighted sum of the compressed rows' values (per query head, after the last compressed row: the
// 64-key chunks stop there) instead of to every row; the tail and draft rows come after, in their own
// basis. The result equals attention over decompress()'s rows to float32 rounding (not bitwise: the sum is
// rounded in the other basis); a single key is still its row bitwise (its weight is exactly 1).
template <Elem TO>  // not inlined into the parallel loop: inlined, its row loop compiled ~10% slower
__attribute__((noinline)) void attend_item(const float* q, const Compressed& cp, const Part& tail, const Part& draft,
                                           const Shape& sh, float scale, int64_t b, int64_t hk0, int64_t nh,
                                           float* out, Scratch& st) {
  const int64_t D = sh.D, Dv = sh.Dv, G = sh.G, QH = nh * G;
  const int64_t* ids = cp.ids + b * cp.width;
  const bool tagged = cp.head != nullptr;  // token drop, head-adaptive: KV head hk0's cells (nh == 1)
  if (tagged) {
    st.cells.clear();
    const int64_t per_chunk = cp.rows * sh.Hkv;
    for (int64_t c = 0; c < cp.lens[b]; ++c)
      for (int64_t at = ids[c] * per_chunk, e = at + per_chunk; at < e; ++at)
        if (cp.head[at] == hk0) st.cells.push_back(at);
  }
  const int64_t n_comp = tagged ? static_cast<int64_t>(st.cells.size()) : cp.lens[b] * cp.rows, n_tail = tail.lens[b];
  const int64_t n = n_comp + n_tail + (draft.lens ? draft.lens[b] : 0);
  const int64_t* tail_slots = tail.index + b * tail.width;
  const int64_t* draft_slots = draft.lens ? draft.index + b * draft.width : nullptr;
  const bool scored = key_scores_apply(cp, sh) && key_scores_request(cp, b);  // scored_item takes its compressed rows
  for (int64_t qi = 0; qi < QH; ++qi) {
    const float* qr = q + (b * sh.H + hk0 * G + qi) * D;
    for (int64_t d = 0; d < D; ++d) st.qf[qi * D + d] = qr[d] * scale;
  }
  std::fill(st.acc.begin(), st.acc.begin() + QH * Dv, 0.f);
  std::fill(st.m.begin(), st.m.begin() + QH, -std::numeric_limits<float>::infinity());
  std::fill(st.l.begin(), st.l.begin() + QH, 0.f);
  st.group_chunk = st.group = -1;
  int64_t chunk = 0, j = 0, group = 0, in_group = 0;  // cursor over the compressed rows
  int64_t ahead_chunk = 0, ahead_j = 0;  // the next row to prefetch: PREFETCH_ROWS past the cursor
  auto ahead = [&]() {
    prefetch_row(cp, sh, ids[ahead_chunk], ahead_j, hk0, nh);
    if (++ahead_j == cp.rows) ahead_j = 0, ++ahead_chunk;
  };
  const bool segments = kvquant_segments(cp, sh);  // kvquant rows a segment (of one chunk) at a time
  if (scored) scored_item(cp, sh, b, hk0, nh, st);  // the compressed rows: the loop below starts past them
  else if (!tagged) for (int64_t a = 0; a < std::min(n_comp, PREFETCH_ROWS); ++a) ahead();
  const float** kp = st.kp.data();  // [nh][CHUNK]
  const float** vp = st.vp.data();
  const bool fold = folds_values<TO> && cp.kind == ROTATEKV;  // values summed in the rotated basis (above)
  for (int64_t c0 = scored ? n_comp : 0, cn = 0; c0 < n; c0 += cn) {
    cn = std::min(CHUNK, (fold && c0 < n_comp ? n_comp : n) - c0);
    const int64_t cn8 = (cn + VW - 1) / VW * VW;
    for (int64_t c = 0; c < cn; ++c) {
      const int64_t i = c0 + c;
      float* kd = st.kbuf.data() + c * D;  // head hh's rows at + hh * CHUNK * D
      float* vd = st.vbuf.data() + c * Dv;
      if (i < n_comp && tagged) {  // cell cells[i]: its row as stored, prefetching PREFETCH_ROWS cells ahead
        if (i + PREFETCH_ROWS < n_comp) {
          prefetch_bytes(cp.k, st.cells[i + PREFETCH_ROWS] * cp.row_bytes[0], cp.row_bytes[0]);
          prefetch_bytes(cp.v, st.cells[i + PREFETCH_ROWS] * cp.row_bytes[1], cp.row_bytes[1]);
        }
        kp[c] = exact_row(cp.k, cp.elem, st.cells[i] * D, D, kd);
        vp[c] = exact_row(cp.v, cp.elem, st.cells[i] * Dv, Dv, vd);
      } else if (i < n_comp && segments) {  // the rest of this window's rows of the chunk at the cursor, at once
        const int64_t seg = std::min({cn - c, cp.rows - j, n_comp - i});
        for (int64_t r = 0; r < seg && ahead_chunk < cp.lens[b]; ++r) ahead();
        kvquant_rows<TO>(cp, sh, ids[chunk], j, j + seg, hk0, kd, vd, st);
        for (int64_t r = 0; r < seg; ++r) kp[c + r] = kd + r * D, vp[c + r] = vd + r * Dv;
        c += seg - 1;
        if ((j += seg) == cp.rows) j = 0, ++chunk;
      } else if (i < n_comp) {
        if (ahead_chunk < cp.lens[b]) ahead();
        if (cp.kind == ROTATEKV) {
          rotatekv_rows_any<TO>(cp, sh, ids[chunk], j, hk0, nh, kd, vd, CHUNK * D, CHUNK * Dv, st);
          for (int64_t hh = 0; hh < nh; ++hh) kp[hh * CHUNK + c] = kd + hh * CHUNK * D, vp[hh * CHUNK + c] = vd + hh * CHUNK * Dv;
        } else {  // nh == 1
          compressed_row<TO>(cp, sh, ids[chunk], j, group, hk0, kd, vd, &kp[c], &vp[c], st);
        }
        if (++in_group == cp.key_group) in_group = 0, ++group;
        if (++j == cp.rows) j = 0, group = 0, in_group = 0, ++chunk;
      } else {
        const bool in_tail = i < n_comp + n_tail;
        const int64_t slot = in_tail ? tail_slots[i - n_comp] : draft_slots[i - n_comp - n_tail];
        const Part& part = in_tail ? tail : draft;
        for (int64_t hh = 0; hh < nh; ++hh) {
          const int64_t at = slot * sh.Hkv + hk0 + hh;
          kp[hh * CHUNK + c] = exact_row(part.k, part.elem, at * D, D, kd + hh * CHUNK * D);
          vp[hh * CHUNK + c] = exact_row(part.v, part.elem, at * Dv, Dv, vd + hh * CHUNK * Dv);
        }
      }
    }
    for (int64_t hh = 0; hh < nh; ++hh)
      for (int64_t c = cn; c < cn8; ++c) kp[hh * CHUNK + c] = st.zero.data();  // padding lanes: -inf below
    auto state = [&](int64_t qi, int64_t slot) {  // slot: which CHUNK floats of score scratch
      return HeadState{st.qf.data() + qi * D, st.s.data() + slot * CHUNK, &st.m[qi], &st.l[qi], st.acc.data() + qi * Dv};
    };
    for (int64_t hh = 0; hh < nh; ++hh) {  // a KV head's query heads two at a time (rows loaded once for both)
      const float* const* kh = kp + hh * CHUNK;
      const float* const* vh = vp + hh * CHUNK;
      int64_t g = 0;
      for (; g + 1 < G; g += 2) attend_chunk2(state(hh * G + g, 0), state(hh * G + g + 1, 1), kh, vh, cn, cn, D, Dv);
      if (g < G) attend_chunk(state(hh * G + g, 0), kh, vh, cn, D, Dv);
    }
    if (fold && c0 + cn == n_comp)
      for (int64_t qi = 0; qi < QH; ++qi)
        fwht_blocks<F32>(st.acc.data() + qi * Dv, Dv, cp.rt.block);
  }
  for (int64_t qi = 0; qi < QH; ++qi) {
    float* o = out + (b * sh.H + hk0 * G + qi) * Dv;
    const float inv = st.l[qi] > 0.f ? 1.f / st.l[qi] : 0.f;
    for (int64_t d = 0; d < Dv; ++d) o[d] = st.acc[qi * Dv + d] * inv;
  }
}

}  // namespace
