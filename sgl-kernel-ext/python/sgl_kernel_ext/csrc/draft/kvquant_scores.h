// Draft-decode attention, AVX-512 only (included by avx512_paths.h): the kvquant key-score path's keys.
#pragma once

#include "kvquant_segments.h"

namespace {

// ---- kvquant_key_scores: kvquant keys scored 16 to a vector (lanes are keys), no row built.
// A chunk's keys are codes of pre-RoPE values with one scale / zero per channel: channel ch of 16 keys is one
// permute of the chunk's 16 levels by their codes and one fused multiply-add by the channel's scale and zero. The
// chunk's positions are consecutive, so RoPE's angles of a channel pair for 16 keys are one load from the table
// held pair-major (Rotated::cos_t / sin_t: the same angles the row path reads). The scores are then 2 fused
// multiply-adds a channel pair and query head per 16 keys, with no horizontal sums, and the values are summed from
// their codes (value_sums). The same dequantized values as decompress (to the rounding of a fused multiply-add), the
// scores and sums rounded in another order: the attention as the row path's to float32 rounding, not bitwise.
// Where it applies (key_scores_apply): AVX-512, float32 rows (TO == F32: what the model passes), head dims 64 /
// 128, chunks of a multiple of 16 rows at consecutive positions (one per row), a RoPE table whose channel pairs
// share their angles.

// Whether a call can take a key-score path (kvquant and rotatekv requests also need consecutive positions:
// key_scores_request): kvquant; rotatekv (rotatekv_key_scores) with one Hadamard transform over a head's D channels
// or two heads', scale groups of whole 32-channel blocks and 1, 2 or 4 query heads a KV head; kivi
// (kivi_key_scores) with key groups of whole 16-row blocks, value groups as rotatekv's, 1, 2 or 4 query heads.
inline bool key_scores_apply(const Compressed& cp, const Shape& sh) {
  const Rotated& rt = cp.rt;
  const bool heads_instanced = sh.G == 1 || sh.G == 2 || sh.G == 4;  // minmax_value_sums' instances
  if (cp.kind == KIVI)
    return cp.round_to == F32 && (sh.D == 64 || sh.D == 128) && sh.Dv == sh.D && cp.rows % 16 == 0 &&
           cp.key_group % 16 == 0 && cp.value_group % (cp.bits == 4 ? 32 : 16) == 0 && heads_instanced;
  const bool common = cp.round_to == F32 && (sh.D == 64 || sh.D == 128) && sh.Dv == sh.D && cp.rows % 16 == 0 &&
                      !rt.pos_per_head && rt.cos_t != nullptr;
  if (cp.kind == KVQUANT) return common;
  return common && cp.kind == ROTATEKV && rt.block == sh.D && rt.key_heads * sh.D <= 128 && rt.group % 32 == 0 &&
         heads_instanced;
}

// Whether every chunk of request b holds positions p0, p0 + 1, ..., p0 + T - 1 (kivi: no positions needed).
inline bool key_scores_request(const Compressed& cp, int64_t b) {
  if (cp.kind == KIVI) return true;
  const int64_t T = cp.rows;
  for (int64_t c = 0; c < cp.lens[b]; ++c) {
    const int32_t* p = cp.rt.pos + cp.ids[b * cp.width + c] * T;
    for (int64_t j = 1; j < T; ++j)
      if (p[j] != p[0] + j) return false;
  }
  return true;
}

// What chunk id's keys of KV head hk need before its rows are scored: its levels (repeated to 16) and its key
// outliers channel-major.
template <int DC>
void key_scores_chunk(const Compressed& cp, const Shape& sh, int64_t id, int64_t hk, Scratch& st) {
  constexpr int shift = __builtin_ctz(DC);
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, L = rt.num_levels;
  for (int e = 0; e < 16; ++e) st.ktab[e] = st.klv[e & (L - 1)];  // codes' bits past the level count: ignored
  uint16_t* mask = st.kmask_t.data();
  std::memset(mask, 0, DC * T / 16 * sizeof(uint16_t));
  if (static_cast<int64_t>(st.own.size()) < rt.n_out + 16) st.own.resize(rt.n_out + 16);
  int32_t* own = st.own.data();
  int64_t cursor = 0, n = 0;
  const __m512i vT = _mm512_set1_epi32(static_cast<int32_t>(T));
  kvq_outlier_groups(rt, true, id, &cursor, T, sh.Hkv, shift, [&](__mmask16 m, __m512i rh, __m512i d, __m512 x) {
    __m512i j;
    const __mmask16 on = kvq_this_head(st, sh.Hkv, hk, m, rh, &j);
    const __m512i flat = _mm512_add_epi32(_mm512_mullo_epi32(d, vT), j);  // [D, T]
    _mm512_mask_i32scatter_ps(st.kpat_t.data(), on, flat, x, 4);
    _mm512_mask_compressstoreu_epi32(own + n, on, flat);
    n += __builtin_popcount(on);
  });
  for (int64_t i = 0; i < n; ++i) mask[own[i] >> 4] |= uint16_t(1u << (own[i] & 15));
}

// Codes of 8 consecutive channels (group m) of 16 rows, one 32-bit lane per row (lane l: the row at kc + l * rs),
// from the dword at byte min(BITS * m, NB - 4) of each row (no read past a row); code t of the group at bit
// group_shift<BITS, NB>(m) + BITS * t.
template <int BITS, int NB>
constexpr int group_at(int m) {
  return BITS * m + 4 <= NB ? BITS * m : NB - 4;
}
template <int BITS, int NB>
constexpr int group_shift(int m) {
  return 8 * (BITS * m - group_at<BITS, NB>(m));
}

// Scores of rows [j0, j1) of chunk id (multiples of 16), KV head hk, for query heads [g0, g0 + NG) (scaled
// queries st.qf) into st.sg[g * CHUNK + j - j0]; key_scores_chunk has prepared the chunk.
template <int BITS, int DC, int NG>
void key_scores_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                     int64_t g0, Scratch& st) {
  constexpr int H = DC / 2, NB = DC * BITS / 8, NA = NG >= 4 ? 2 : 4;
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, rs = sh.Hkv * NB, TW = T / 16;
  const uint8_t* kc0 = static_cast<const uint8_t*>(cp.k) + (id * T * sh.Hkv + hk) * NB;
  const __m512i vidx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(static_cast<int32_t>(rs)));
  const __m512 lv16 = _mm512_loadu_ps(st.ktab.data());  // the chunk's levels (16, repeated)
  const float *ks = st.ks.data(), *kz = st.kz.data();  // per channel
  const float* pat = st.kpat_t.data();
  const __mmask16* mask = reinterpret_cast<const __mmask16*>(st.kmask_t.data());
  const float* qr = st.qf.data() + g0 * DC;
  const int64_t p0 = rt.pos[id * T];  // the chunk's positions: p0, p0 + 1, ...
  for (int64_t j = j0; j < j1; j += 16) {
    const uint8_t* kc = kc0 + j * rs;
    const float* rc = rt.cos_t + p0 + j;
    const float* rsn = rt.sin_t + p0 + j;
    __m512 acc[NG][NA];
    for (int g = 0; g < NG; ++g)
      for (int a = 0; a < NA; ++a) acc[g][a] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < H / 8; ++m) {
      const __m512i ga = _mm512_i32gather_epi32(vidx, kc + group_at<BITS, NB>(m), 1);
      const __m512i gb = _mm512_i32gather_epi32(vidx, kc + group_at<BITS, NB>(m + H / 8), 1);
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const int i = 8 * m + t;
        __m512 a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(ga, group_shift<BITS, NB>(m) + BITS * t), lv16),
                                   _mm512_set1_ps(ks[i]), _mm512_set1_ps(kz[i]));
        __m512 b = _mm512_fmadd_ps(
            _mm512_permutexvar_ps(_mm512_srli_epi32(gb, group_shift<BITS, NB>(m + H / 8) + BITS * t), lv16),
            _mm512_set1_ps(ks[i + H]), _mm512_set1_ps(kz[i + H]));
        a = _mm512_mask_loadu_ps(a, _load_mask16(const_cast<__mmask16*>(mask + i * TW + j / 16)), pat + i * T + j);
        b = _mm512_mask_loadu_ps(b, _load_mask16(const_cast<__mmask16*>(mask + (i + H) * TW + j / 16)),
                                 pat + (i + H) * T + j);
        const __m512 c = _mm512_loadu_ps(rc + i * rt.Pt), sn = _mm512_loadu_ps(rsn + i * rt.Pt);
        const __m512 lo = _mm512_fmsub_ps(a, c, _mm512_mul_ps(b, sn));
        const __m512 hi = _mm512_fmadd_ps(b, c, _mm512_mul_ps(a, sn));
        for (int g = 0; g < NG; ++g) {
          __m512& z = acc[g][t % NA];
          z = _mm512_fmadd_ps(_mm512_set1_ps(qr[g * DC + i]), lo, z);
          z = _mm512_fmadd_ps(_mm512_set1_ps(qr[g * DC + i + H]), hi, z);
        }
      }
    }
    for (int g = 0; g < NG; ++g) {
      __m512 z = NA == 4 ? _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_add_ps(acc[g][2], acc[g][3]))
                         : _mm512_add_ps(acc[g][0], acc[g][1]);
      _mm512_storeu_ps(st.sg.data() + (g0 + g) * CHUNK + (j - j0), z);
    }
  }
}

}  // namespace
