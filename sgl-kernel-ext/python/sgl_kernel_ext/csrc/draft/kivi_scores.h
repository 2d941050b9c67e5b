// Draft-decode attention, AVX-512 only (included by avx512_paths.h): the kivi key-score path.
#pragma once

#include "rotatekv_scores.h"

namespace {

// ---- kivi_key_scores: kivi's keys (per channel over groups of key_group tokens: code * scale + zero, RoPE already
// on) scored 16 to a vector: q . k = (q * scale) . code + q . zero, so per channel one permute (the codes' values)
// and one fused multiply-add a query head, and one constant a key group; values as rotatekv's (minmax_value_sums).

// Rows [j0, j1) of chunk id (multiples of 16; key groups of a multiple of 16 rows), KV head hk, query heads
// [g0, g0 + NG): scores into st.sg[g * CHUNK + j - j0].
template <int BITS, int DC, int NG>
void kivi_scores_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                      int64_t g0, Scratch& st) {
  constexpr int NB = DC * BITS / 8, NA = NG >= 4 ? 2 : 4;
  const int64_t T = cp.rows, rs = sh.Hkv * NB, kg = cp.key_group;
  const uint8_t* kc0 = static_cast<const uint8_t*>(cp.k) + (id * T * sh.Hkv + hk) * NB;
  const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(rs)));
  const __m512i m2 = _mm512_set1_epi32(3);
  for (int64_t j = j0; j < j1; j += 16) {
    const int64_t grp = j / kg;
    const float* qs = st.qrot.data() + (grp * sh.G + g0) * DC;  // q * scale of the group [G, D]
    const uint8_t* kc = kc0 + j * rs;
    __m512 acc[NG][NA];
    for (int g = 0; g < NG; ++g)
      for (int a = 0; a < NA; ++a) acc[g][a] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (int w = 0; w < NB / 4; ++w) {  // a dword: 8 4-bit or 16 2-bit codes of each of the 16 rows
      const __m512i word = _mm512_i32gather_epi32(vidx, kc + 4 * w, 1);
      constexpr int PER = 32 / BITS;
#pragma GCC unroll 16
      for (int t = 0; t < PER; ++t) {
        const int ch = PER * w + t;
        __m512i code = _mm512_srli_epi32(word, BITS * t);
        if constexpr (BITS == 2) code = _mm512_and_si512(code, m2);
        const __m512 x = code_floats(code);
        for (int g = 0; g < NG; ++g) {
          __m512& z = acc[g][t % NA];
          z = _mm512_fmadd_ps(_mm512_set1_ps(qs[g * DC + ch]), x, z);
        }
      }
    }
    for (int g = 0; g < NG; ++g) {
      __m512 z = NA == 4 ? _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_add_ps(acc[g][2], acc[g][3]))
                         : _mm512_add_ps(acc[g][0], acc[g][1]);
      z = _mm512_add_ps(z, _mm512_set1_ps(st.zsc[grp * sh.G + g0 + g]));
      _mm512_storeu_ps(st.sg.data() + (g0 + g) * CHUNK + (j - j0), z);
    }
  }
}

// Chunk id of KV head hk before its rows: per key group and query head q * scale [T / key_group, G, D] (st.qrot)
// and q . zero (st.zsc); the values' scales / zeros (as rotatekv's).
template <int DC>
void kivi_chunk(const Compressed& cp, const Shape& sh, int64_t id, int64_t hk, Scratch& st) {
  const int64_t T = cp.rows, kg = cp.key_group, ngk = T / kg, ngv = DC / cp.value_group;
  for (int64_t grp = 0; grp < ngk; ++grp) {
    const int64_t at = ((id * ngk + grp) * sh.Hkv + hk) * DC;
    for (int64_t d = 0; d < DC; d += 16) {
      _mm512_storeu_ps(st.ks.data() + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp.k_scale + at + d))));
      _mm512_storeu_ps(st.kz.data() + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cp.k_zero + at + d))));
    }
    for (int64_t g = 0; g < sh.G; ++g) {
      const float* q = st.qf.data() + g * DC;
      float* qs = st.qrot.data() + (grp * sh.G + g) * DC;
      __m512 z = _mm512_setzero_ps();
      for (int64_t d = 0; d < DC; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        _mm512_storeu_ps(qs + d, _mm512_mul_ps(qd, _mm512_loadu_ps(st.ks.data() + d)));
        z = _mm512_fmadd_ps(qd, _mm512_loadu_ps(st.kz.data() + d), z);
      }
      st.zsc[grp * sh.G + g] = _mm512_reduce_add_ps(z);
    }
  }
  const int64_t blk = T * sh.Hkv * ngv;
  chunk_scales(cp.v_scale + id * blk, T, sh.Hkv, ngv, hk, 1, st.vsc.data(), st);
  chunk_scales(cp.v_zero + id * blk, T, sh.Hkv, ngv, hk, 1, st.vzr.data(), st);
}

template <int BITS, int DC, int G>
void kivi_scored_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t cn, int64_t hk,
                      Scratch& st) {
  if (j == 0) kivi_chunk<DC>(cp, sh, id, hk, st);
  int64_t g = 0;
  for (; g + 2 <= G; g += 2) kivi_scores_rows<BITS, DC, 2>(cp, sh, id, j, j + cn, hk, g, st);
  if (g < G) kivi_scores_rows<BITS, DC, 1>(cp, sh, id, j, j + cn, hk, g, st);
  scored_softmax(st, G, cn, DC, DC / cp.value_group);
  minmax_value_sums<BITS, DC, 1, G>(cp, sh, id, j, j + cn, hk, cp.value_group, st);
}

inline void kivi_scored_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t cn, int64_t hk,
                             Scratch& st) {
  auto by_heads = [&](auto bits, auto dim) {
    constexpr int B = decltype(bits)::value, DC = decltype(dim)::value;
    if (sh.G == 1) kivi_scored_rows<B, DC, 1>(cp, sh, id, j, cn, hk, st);
    else if (sh.G == 2) kivi_scored_rows<B, DC, 2>(cp, sh, id, j, cn, hk, st);
    else kivi_scored_rows<B, DC, 4>(cp, sh, id, j, cn, hk, st);
  };
  auto by_dim = [&](auto bits) {
    if (sh.D == 64) by_heads(bits, std::integral_constant<int, 64>{});
    else by_heads(bits, std::integral_constant<int, 128>{});
  };
  if (cp.bits == 2) by_dim(std::integral_constant<int, 2>{});
  else by_dim(std::integral_constant<int, 4>{});
}

}  // namespace
