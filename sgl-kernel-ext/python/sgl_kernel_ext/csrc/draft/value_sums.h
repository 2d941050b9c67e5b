// Draft-decode attention, AVX-512 only (included by avx512_paths.h): values summed from their codes, and
// the kvquant key-score path's softmax chunk (scores, online softmax, value sums).
#pragma once

#include "kvquant_scores.h"

namespace {

// ---- kvquant values summed from their codes (the same windows): the value of channel d of row j is
// level[code] * scale_j + zero_j, so sum_j p_j v_j[d] = sum_j (p_j scale_j) level[code_jd] + sum_j p_j zero_j: one
// permute a 16-code vector and one fused multiply-add per query head, no value row built, and the zeros' sum once a
// segment (value_sums). The exact outliers add p_j (exact - dequantized) to their channel. A reassociation of the row
// path's sum: the same values, rounded otherwise.
//
// Codes in lane order: 4-bit codes are widened 16 bytes at a time, low nibbles (even channels) then high (odd), so
// the sums are kept in that order (code_lane) and put back in channel order at the end; 2 / 3 bits: channel order.
// The codes of one row of DC channels as DC / 16 vectors in code_lane order (permute indices: bits past a code's
// are ignored by level tables replicated to 16 entries).
template <int BITS, int DC>
__attribute__((always_inline)) inline void value_codes(const uint8_t* vc, __m512i* q) {
  constexpr int NV = DC / 16;
  if constexpr (BITS == 4) {
#pragma GCC unroll 8
    for (int g = 0; g < NV / 2; ++g) {
      const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vc + 16 * g)));
      q[2 * g] = x, q[2 * g + 1] = _mm512_srli_epi32(x, 4);
    }
  } else {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) q[i] = kvq_codes16<BITS>(vc, 16 * i);
  }
}

// accq[g] (NG query heads, DC lanes in code_lane order) += weight(g, i, c) * table[code] over n code rows from vc
// (stride rs), vector i of row c: the value sums' one loop (kvquant's and min-max values').
template <int BITS, int DC, int NG, typename W>
__attribute__((always_inline)) inline void sum_code_rows(const uint8_t* vc, int64_t rs, int64_t n, __m512 table,
                                                         W weight, float* accq) {
  constexpr int NV = DC / 16;
  __m512 a[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) a[g][i] = _mm512_loadu_ps(accq + g * DC + 16 * i);
  for (int64_t c = 0; c < n; ++c, vc += rs) {
    __m512i q[NV];
    value_codes<BITS, DC>(vc, q);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const __m512 l = _mm512_permutexvar_ps(q[i], table);
      for (int g = 0; g < NG; ++g) a[g][i] = _mm512_fmadd_ps(_mm512_set1_ps(weight(g, i, c)), l, a[g][i]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(accq + g * DC + 16 * i, a[g][i]);
}

// A chunk's per-row scales / zeros of the nh KV heads from hk0 ([T, Hkv, ng] float16, ng groups a row) as float32
// [nh * ng, T]: the chunk's block converted, then each head and group's column.
inline void chunk_scales(const uint16_t* src16, int64_t T, int64_t Hkv, int64_t ng, int64_t hk0, int64_t nh,
                       float* dst, Scratch& st) {
  const int64_t n = T * Hkv * ng;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(st.vtmp.data() + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src16 + i))));
  for (; i < n; ++i) st.vtmp[i] = half_to_float(src16[i]);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i stride = _mm512_set1_epi32(static_cast<int32_t>(Hkv * ng));
  for (int64_t hh = 0; hh < nh; ++hh)
    for (int64_t g = 0; g < ng; ++g)
      for (int64_t j = 0; j < T; j += 16) {
        const __m512i at = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(j))), stride),
                                            _mm512_set1_epi32(static_cast<int32_t>((hk0 + hh) * ng + g)));
        _mm512_storeu_ps(dst + (hh * ng + g) * T + j, _mm512_i32gather_ps(at, st.vtmp.data(), 4));
      }
}

// The value side of chunk id, KV head hk, before its rows are summed: its scales / zeros as float32 (st.vsc /
// st.vzr [T]) and its value outliers as (row, channel, exact - dequantized) (st.vo_*).
template <int BITS, int DC>
void value_chunk(const Compressed& cp, const Shape& sh, int64_t id, int64_t hk, Scratch& st) {
  constexpr int NB = DC * BITS / 8, shift = __builtin_ctz(DC);
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, Hkv = sh.Hkv;
  chunk_scales(cp.v_scale + id * T * Hkv, T, Hkv, 1, hk, 1, st.vsc.data(), st);
  chunk_scales(cp.v_zero + id * T * Hkv, T, Hkv, 1, hk, 1, st.vzr.data(), st);
  float lv[16];
  for (int e = 0; e < 16; ++e) lv[e] = st.vlv[e & (rt.num_levels - 1)];
  const __m512 lv16 = _mm512_loadu_ps(lv);
  if (static_cast<int64_t>(st.vo_j.size()) < rt.n_out + 16)
    st.vo_j.resize(rt.n_out + 16), st.vo_d.resize(rt.n_out + 16), st.vo_x.resize(rt.n_out + 16);
  const uint8_t* vc0 = static_cast<const uint8_t*>(cp.v) + (id * T * Hkv + hk) * NB;
  const __m512i vrs = _mm512_set1_epi32(static_cast<int32_t>(Hkv * NB));
  int64_t cursor = 0, m = 0;
  kvq_outlier_groups(rt, false, id, &cursor, T, Hkv, shift, [&](__mmask16 k, __m512i rh, __m512i d, __m512 x) {
    __m512i j;
    const __mmask16 on = kvq_this_head(st, Hkv, hk, k, rh, &j);
    // the code: the dword at byte min(BITS d / 8, NB - 4) of the row (no read past it), shifted
    const __m512i bit = _mm512_mullo_epi32(d, _mm512_set1_epi32(BITS));
    const __m512i at = _mm512_min_epi32(_mm512_srli_epi32(bit, 3), _mm512_set1_epi32(NB - 4));
    const __m512i word = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), on,
                                                     _mm512_add_epi32(_mm512_mullo_epi32(j, vrs), at), vc0, 1);
    const __m512i code = _mm512_srlv_epi32(word, _mm512_sub_epi32(bit, _mm512_slli_epi32(at, 3)));
    const __m512 sc = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, j, st.vsc.data(), 4);
    const __m512 zr = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), on, j, st.vzr.data(), 4);
    const __m512 deq = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(code, lv16), sc), zr);
    _mm512_mask_compressstoreu_epi32(st.vo_j.data() + m, on, j);
    _mm512_mask_compressstoreu_epi32(st.vo_d.data() + m, on, d);
    _mm512_mask_compressstoreu_ps(st.vo_x.data() + m, on, _mm512_sub_ps(x, deq));
    m += __builtin_popcount(on);
  });
  st.vo_n = m;
}

// Rows [j0, j1) of chunk id, KV head hk, for query heads [g0, g0 + NG) with probabilities st.sg[g * CHUNK + j - j0]:
// st.accq += (p * scale) level[code] per lane, st.zsum += p * zero, and the outliers' p (exact - dequantized) into
// acc (channel order).
template <int BITS, int DC, int NG>
void value_sums_heads(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                      int64_t g0, float* acc, Scratch& st) {
  constexpr int NB = DC * BITS / 8;
  const int64_t T = cp.rows, rs = sh.Hkv * NB, n = j1 - j0;
  float lv[16];
  for (int e = 0; e < 16; ++e) lv[e] = st.vlv[e & (cp.rt.num_levels - 1)];
  const __m512 lv16 = _mm512_loadu_ps(lv);
  float* pp = st.pp.data();
  for (int g = 0; g < NG; ++g) {  // p * scale, and the zeros' sum
    const float* p = st.sg.data() + (g0 + g) * CHUNK;
    __m512 z = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 16) {
      const __m512 pc = _mm512_loadu_ps(p + c);
      _mm512_storeu_ps(pp + g * CHUNK + c, _mm512_mul_ps(pc, _mm512_loadu_ps(st.vsc.data() + j0 + c)));
      z = _mm512_fmadd_ps(pc, _mm512_loadu_ps(st.vzr.data() + j0 + c), z);
    }
    st.zsum[g0 + g] += _mm512_reduce_add_ps(z);
  }
  const uint8_t* vc = static_cast<const uint8_t*>(cp.v) + ((id * T + j0) * sh.Hkv + hk) * NB;
  sum_code_rows<BITS, DC, NG>(vc, rs, n, lv16, [&](int g, int, int64_t c) { return pp[g * CHUNK + c]; },
                              st.accq.data() + g0 * DC);
  for (int64_t e = 0; e < st.vo_n; ++e) {  // the exact outliers (a chunk's are ~1% of its values)
    const int64_t j = st.vo_j[e];
    if (j < j0 || j >= j1) continue;
    for (int g = 0; g < NG; ++g) {
      float& o = acc[(g0 + g) * DC + st.vo_d[e]];
      o = std::fma(st.sg[(g0 + g) * CHUNK + j - j0], st.vo_x[e], o);
    }
  }
}

template <int BITS, int DC>
void value_sums(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk, float* acc,
                Scratch& st) {
  for (int64_t g = 0; g < sh.G;) {
    if (sh.G - g >= 4) value_sums_heads<BITS, DC, 4>(cp, sh, id, j0, j1, hk, g, acc, st), g += 4;
    else if (sh.G - g >= 2) value_sums_heads<BITS, DC, 2>(cp, sh, id, j0, j1, hk, g, acc, st), g += 2;
    else value_sums_heads<BITS, DC, 1>(cp, sh, id, j0, j1, hk, g, acc, st), g += 1;
  }
}

// key_scores_rows for every query head of the KV head: 4, 2 or 1 at a time.
template <int BITS, int DC>
void key_scores_heads(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                      Scratch& st) {
  for (int64_t g = 0; g < sh.G;) {
    if (sh.G - g >= 4) key_scores_rows<BITS, DC, 4>(cp, sh, id, j0, j1, hk, g, st), g += 4;
    else if (sh.G - g >= 2) key_scores_rows<BITS, DC, 2>(cp, sh, id, j0, j1, hk, g, st), g += 2;
    else key_scores_rows<BITS, DC, 1>(cp, sh, id, j0, j1, hk, g, st), g += 1;
  }
}

// Rows [j0, j1) of chunk id, KV head hk: every query head's scores to st.sg at j - j0 (and, at a chunk's first
// rows, what its keys and values need).
template <int BITS, int DC>
void key_scores(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                Scratch& st) {
  if (j0 == 0) {
    kvquant_chunk_ranges(cp, sh, id, hk, st);
    key_scores_chunk<DC>(cp, sh, id, hk, st);
    value_chunk<BITS, DC>(cp, sh, id, hk, st);
  }
  key_scores_heads<BITS, DC>(cp, sh, id, j0, j1, hk, st);
}

// Calls f(bits, head dim) as compile-time constants (the key-score path's instances).
template <typename F>
inline void with_kvquant_shape(const Compressed& cp, const Shape& sh, F&& f) {
  auto by_dim = [&](auto bits) {
    if (sh.D == 64) f(bits, std::integral_constant<int, 64>{});
    else f(bits, std::integral_constant<int, 128>{});
  };
  if (cp.bits == 2) by_dim(std::integral_constant<int, 2>{});
  else if (cp.bits == 3) by_dim(std::integral_constant<int, 3>{});
  else by_dim(std::integral_constant<int, 4>{});
}

// The sums value_sums keeps beside acc follow the online softmax: rescaled as softmax_chunk rescales acc
// (alpha = exp(old max - new max), the same expression: the same value).
// nz: the zeros' sums a query head keeps (kvquant 1, rotatekv one a scale group).
inline void fold_rescale(Scratch& st, int64_t g, float m_before, int64_t D, int64_t nz) {
  if (m_before == st.m[g]) return;
  const float alpha = std::exp(m_before - st.m[g]);
  for (int64_t d = 0; d < D; ++d) st.accq[g * D + d] *= alpha;
  for (int64_t z = 0; z < nz; ++z) st.zsum[g * nz + z] *= alpha;
}

// The online softmax of query heads [0, nq) over a segment's cn scores in st.sg, and the value sums kept beside
// acc (nz zeros' sums a head) rescaled with it.
inline void scored_softmax(Scratch& st, int64_t nq, int64_t cn, int64_t D, int64_t nz) {
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float m0 = st.m[qi];
    softmax_chunk(HeadState{nullptr, st.sg.data() + qi * CHUNK, &st.m[qi], &st.l[qi], st.acc.data() + qi * D}, cn, D);
    fold_rescale(st, qi, m0, D, nz);
  }
}

// Rows [j, j + cn) of chunk id (within the chunk) on the key-score path, one softmax chunk: scores, the online
// softmax of the G query heads (st.m / st.l / st.acc, and st.accq / st.zsum), the values' sums.
template <int BITS, int DC>
void scored_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t cn, int64_t hk, Scratch& st) {
  key_scores<BITS, DC>(cp, sh, id, j, j + cn, hk, st);
  scored_softmax(st, sh.G, cn, DC, 1);
  value_sums<BITS, DC>(cp, sh, id, j, j + cn, hk, st.acc.data(), st);
}

inline void scored_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t cn, int64_t hk,
                        Scratch& st) {
  with_kvquant_shape(cp, sh, [&](auto bits, auto dim) {
    scored_rows<decltype(bits)::value, decltype(dim)::value>(cp, sh, id, j, cn, hk, st);
  });
}

}  // namespace
