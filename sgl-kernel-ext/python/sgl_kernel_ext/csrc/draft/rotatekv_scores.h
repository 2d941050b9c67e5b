// Draft-decode attention, AVX-512 only (included by avx512_paths.h): the rotatekv key-score path.
#pragma once

#include "value_sums.h"

namespace {

// ---- rotatekv_key_scores: rotatekv keys scored 16 to a vector. A key is RoPE(H x) with x = code * scale + zero in
// the rotated basis (per token and group of channels) and H the Walsh-Hadamard transform over the N = key_heads * D
// channels of the item's KV heads. Lanes are keys, so H is butterflies between vectors (no shuffle): strides 1-8
// over 16 channels at a time in registers (stored to st.xbuf), strides 16 and up over the channels c, c + 16, ...
// (read back), then RoPE from the pair-major table (as kvquant_key_scores) and 2 fused multiply-adds a channel pair
// and query head. H's scaling is on the query. Values stay in the rotated basis (as the row path with
// float32 rows): sum p (code * scale + zero) = sum (p scale) code + sum p zero per scale group, transformed back once.

// Chunk id's keys and values of the nh KV heads from hk0, before its rows: scales / zeros, and the QH = nh G scaled
// queries (st.qf) times H's scaling.
template <int DC>
void rkv_chunk(const Compressed& cp, const Shape& sh, int64_t id, int64_t hk0, int64_t nh, Scratch& st) {
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, ng = DC / rt.group, blk = T * sh.Hkv * ng;
  chunk_scales(cp.k_scale + id * blk, T, sh.Hkv, ng, hk0, nh, st.ksc.data(), st);
  chunk_scales(cp.k_zero + id * blk, T, sh.Hkv, ng, hk0, nh, st.kzr.data(), st);
  chunk_scales(cp.v_scale + id * blk, T, sh.Hkv, ng, hk0, nh, st.vsc.data(), st);
  chunk_scales(cp.v_zero + id * blk, T, sh.Hkv, ng, hk0, nh, st.vzr.data(), st);
  const __m512 f = _mm512_set1_ps(fwht_scale(nh * DC));
  for (int64_t qi = 0; qi < nh * sh.G; ++qi)
    for (int i = 0; i < DC; i += 16)
      _mm512_storeu_ps(st.qrot.data() + qi * DC + i, _mm512_mul_ps(_mm512_loadu_ps(st.qf.data() + qi * DC + i), f));
}

// The float value of each lane's code (its low 4 bits; 2-bit codes come masked): one permute of 0..15.
inline __m512 code_floats(__m512i q) {
  return _mm512_permutexvar_ps(q, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// Scores of rows [j0, j1) of chunk id (multiples of 16) for the NHK * G query heads into st.sg[qi * CHUNK + j - j0].
template <int BITS, int DC, int NHK, int G>
void rkv_scores_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk0,
                     Scratch& st) {
  constexpr int N = NHK * DC, NU = N / 16, NB = DC * BITS / 8, QH = NHK * G, NA = QH <= 4 ? 2 : 1;
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, rs = sh.Hkv * NB, ng = DC / rt.group;
  const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(rs)));
  const __m512i m2 = _mm512_set1_epi32(3);
  float* X = st.xbuf.data();
  const float* qr = st.qrot.data();
  const int64_t p0 = rt.pos[id * T];  // the chunk's positions: p0, p0 + 1, ...
  for (int64_t j = j0; j < j1; j += 16) {
    const uint8_t* kc = static_cast<const uint8_t*>(cp.k) + ((id * T + j) * sh.Hkv + hk0) * NB;
    // strides 1-8: 16 channels [16u, 16u + 16) at a time
#pragma GCC unroll 1
    for (int u = 0; u < NU; ++u) {
      const int hh = 16 * u / DC, d0 = 16 * u % DC;
      const int64_t gi = (hh * ng + d0 / rt.group) * T + j;
      const __m512 sc = _mm512_loadu_ps(st.ksc.data() + gi), zr = _mm512_loadu_ps(st.kzr.data() + gi);
      const uint8_t* at = kc + hh * NB + d0 * BITS / 8;
      __m512 x[16];
      if constexpr (BITS == 4) {
        const __m512i w0 = _mm512_i32gather_epi32(vidx, at, 1), w1 = _mm512_i32gather_epi32(vidx, at + 4, 1);
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t)
          x[t] = _mm512_fmadd_ps(code_floats(_mm512_srli_epi32(t < 8 ? w0 : w1, 4 * (t % 8))), sc, zr);
      } else {
        const __m512i w = _mm512_i32gather_epi32(vidx, at, 1);
#pragma GCC unroll 16
        for (int t = 0; t < 16; ++t)
          x[t] = _mm512_fmadd_ps(code_floats(_mm512_and_si512(_mm512_srli_epi32(w, 2 * t), m2)), sc, zr);
      }
      fwht_strides<__m512, 16>(x);
#pragma GCC unroll 16
      for (int t = 0; t < 16; ++t) _mm512_storeu_ps(X + (16 * u + t) * 16, x[t]);
    }
    // strides 16 and up over c, c + 16, ...; RoPE and the scores
    __m512 acc[QH][NA];
    for (int qi = 0; qi < QH; ++qi)
      for (int a = 0; a < NA; ++a) acc[qi][a] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int c = 0; c < 16; ++c) {
      __m512 y[NU];
#pragma GCC unroll 16
      for (int k = 0; k < NU; ++k) y[k] = _mm512_loadu_ps(X + (c + 16 * k) * 16);
      fwht_strides<__m512, NU>(y);
#pragma GCC unroll 16
      for (int k = 0; k < NU; ++k) {
        const int ch = 16 * k + c, hh = ch / DC, i = ch % DC;
        if (i >= DC / 2) continue;
        const __m512 a = y[k], b = y[k + DC / 32];
        const __m512 cs = _mm512_loadu_ps(rt.cos_t + i * rt.Pt + p0 + j), sn = _mm512_loadu_ps(rt.sin_t + i * rt.Pt + p0 + j);
        const __m512 lo = _mm512_fmsub_ps(a, cs, _mm512_mul_ps(b, sn));
        const __m512 hi = _mm512_fmadd_ps(b, cs, _mm512_mul_ps(a, sn));
        for (int g = 0; g < G; ++g) {
          const int qi = hh * G + g;
          __m512& z = acc[qi][c % NA];
          z = _mm512_fmadd_ps(_mm512_set1_ps(qr[qi * DC + i]), lo, z);
          z = _mm512_fmadd_ps(_mm512_set1_ps(qr[qi * DC + i + DC / 2]), hi, z);
        }
      }
    }
    for (int qi = 0; qi < QH; ++qi)
      _mm512_storeu_ps(st.sg.data() + qi * CHUNK + (j - j0), NA == 2 ? _mm512_add_ps(acc[qi][0], acc[qi][1]) : acc[qi][0]);
  }
}

// Min-max values (rotatekv's, kivi's: code * scale + zero per token and group of `group` channels), rows [j0, j1)
// of chunk id, the NHK KV heads from hk0: st.accq[qi] += (p scale) (code - c0) per lane (code_lane order) and
// st.zsum[qi * ng + g] += p (zero + c0 scale), with the probabilities in st.sg. c0 = (2^bits - 1) / 2, the middle
// code: both sums are then of a value's size (zero is the group's minimum: p zero and p scale code would be
// large and cancel, losing bits).
template <int BITS, int DC, int NHK, int G>
void minmax_value_sums(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk0,
                       int64_t group, Scratch& st) {
  constexpr int NB = DC * BITS / 8;
  const int64_t T = cp.rows, rs = sh.Hkv * NB, ng = DC / group, n = j1 - j0;
  constexpr float c0 = ((1 << BITS) - 1) / 2.f;
  const __m512 centered = _mm512_sub_ps(code_floats(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                                        _mm512_set1_ps(c0));  // code - c0 by code
  float* pp = st.pp.data();  // [qi][g][c]
  for (int qi = 0; qi < NHK * G; ++qi) {
    const int hh = qi / G;
    const float* p = st.sg.data() + qi * CHUNK;
    for (int64_t g = 0; g < ng; ++g) {
      const float* sc = st.vsc.data() + (hh * ng + g) * T + j0;
      const float* zr = st.vzr.data() + (hh * ng + g) * T + j0;
      __m512 z = _mm512_setzero_ps();
      for (int64_t c = 0; c < n; c += 16) {
        const __m512 pc = _mm512_loadu_ps(p + c), s16 = _mm512_loadu_ps(sc + c);
        _mm512_storeu_ps(pp + (qi * ng + g) * CHUNK + c, _mm512_mul_ps(pc, s16));
        z = _mm512_fmadd_ps(pc, _mm512_fmadd_ps(_mm512_set1_ps(c0), s16, _mm512_loadu_ps(zr + c)), z);
      }
      st.zsum[qi * ng + g] += _mm512_reduce_add_ps(z);
    }
  }
  for (int hh = 0; hh < NHK; ++hh) {
    const uint8_t* vc = static_cast<const uint8_t*>(cp.v) + ((id * T + j0) * sh.Hkv + hk0 + hh) * NB;
    const auto weight = [&](int g, int i, int64_t c) {
      const int64_t grp = (BITS == 4 ? 32 * (i / 2) : 16 * i) / group;  // the lanes' scale group
      return pp[((hh * G + g) * ng + grp) * CHUNK + c];
    };
    sum_code_rows<BITS, DC, G>(vc, rs, n, centered, weight, st.accq.data() + hh * G * DC);
  }
}

template <int BITS, int DC, int NHK, int G>
void rkv_scored_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t cn, int64_t hk0,
                     Scratch& st) {
  if (j == 0) rkv_chunk<DC>(cp, sh, id, hk0, NHK, st);
  rkv_scores_rows<BITS, DC, NHK, G>(cp, sh, id, j, j + cn, hk0, st);
  scored_softmax(st, NHK * G, cn, DC, DC / cp.rt.group);
  minmax_value_sums<BITS, DC, NHK, G>(cp, sh, id, j, j + cn, hk0, cp.rt.group, st);
}

inline void rkv_scored_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t cn, int64_t hk0,
                            Scratch& st) {
  auto by_heads = [&](auto bits, auto dim, auto nhk) {
    constexpr int B = decltype(bits)::value, DC = decltype(dim)::value, NHK = decltype(nhk)::value;
    if (sh.G == 1) rkv_scored_rows<B, DC, NHK, 1>(cp, sh, id, j, cn, hk0, st);
    else if (sh.G == 2) rkv_scored_rows<B, DC, NHK, 2>(cp, sh, id, j, cn, hk0, st);
    else rkv_scored_rows<B, DC, NHK, 4>(cp, sh, id, j, cn, hk0, st);
  };
  auto by_dim = [&](auto bits) {
    if (sh.D == 128) by_heads(bits, std::integral_constant<int, 128>{}, std::integral_constant<int, 1>{});
    else if (cp.rt.key_heads == 2) by_heads(bits, std::integral_constant<int, 64>{}, std::integral_constant<int, 2>{});
    else by_heads(bits, std::integral_constant<int, 64>{}, std::integral_constant<int, 1>{});
  };
  if (cp.bits == 2) by_dim(std::integral_constant<int, 2>{});
  else by_dim(std::integral_constant<int, 4>{});
}

}  // namespace
