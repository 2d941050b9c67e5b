// Draft-decode attention, AVX-512 only (included by avx512_paths.h): kvquant rows a segment at a time.
#pragma once

#include "kvquant_rows.h"

namespace {

// ---- kvquant rows a segment at a time: the rows kvquant_row gives, bitwise, with the exact outliers
// stored over the dequantized rows by masked scatters (16 per instruction) instead of merged lane by lane
// (mask bits and a masked load per 16 values of every row) and without a chunk-wide patch of them scattered first.
// The bundled model's bf16 draft step at batch 16, context 1600 on an AMD EPYC (Zen 4), against the fixed-chunk
// DECODE step: kvquant4 1.26x -> 1.09x, kvquant3 1.55x -> 1.05x (3-bit codes also decoded 16 at a time).

// The outliers of a chunk's list (ascending flat indices into [T, Hkv, D], D = 1 << shift) from *cursor on that
// lie in rows below r1, in order, 16 at a time: f(lanes, rh, d, x) with lanes the valid ones, rh = row * Hkv +
// head, d the channel, x the exact value (float32). Vectors, not a loop per outlier: a scalar walk branching on
// the head (with two KV heads half the list is another head's) mispredicts about every other outlier, and each
// outlier's chain of dependent loads is serial (measured: ~45 cycles an outlier on an AMD EPYC, Zen 4).
template <typename F>
inline void kvq_outlier_groups(const Rotated& rt, bool key, int64_t id, int64_t* cursor, int64_t r1, int64_t Hkv,
                               int shift, F&& f) {
  const int64_t n = rt.n_out, end = (r1 * Hkv) << shift;
  const void* idx = static_cast<const char*>(key ? rt.k_out_idx : rt.v_out_idx) + id * n * (rt.idx32 ? 4 : 2);
  const void* vals = static_cast<const char*>(key ? rt.k_out_val : rt.v_out_val) +
                     id * n * (rt.out_elem == F32 ? 4 : 2);
  const int32_t* i32 = static_cast<const int32_t*>(idx);
  const int16_t* i16 = static_cast<const int16_t*>(idx);
  int64_t e = *cursor;
  while (e < n && (rt.idx32 ? i32[e] : i16[e]) < end) ++e;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i dmask = _mm512_set1_epi32((1 << shift) - 1);
  for (int64_t c = *cursor; c < e; c += 16) {
    const __mmask16 m = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(e - c)));
    const __m512i flat = rt.idx32 ? _mm512_maskz_loadu_epi32(m, i32 + c)
                                  : _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, i16 + c));
    __m512 x;
    if (rt.out_elem == F32) {
      x = _mm512_maskz_loadu_ps(m, static_cast<const float*>(vals) + c);
    } else {
      const __m256i hv = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(vals) + c);
      x = rt.out_elem == F16 ? _mm512_cvtph_ps(hv) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hv), 16));
    }
    f(m, _mm512_srli_epi32(flat, shift), _mm512_and_si512(flat, dmask), x);
  }
  *cursor = e;
}

// The lanes of KV head hk among m (rh = row * Hkv + head), and their rows (*row; 0 in the other lanes).
inline __mmask16 kvq_this_head(const Scratch& st, int64_t Hkv, int64_t hk, __mmask16 m, __m512i rh, __m512i* row) {
  const __m512i vhk = _mm512_set1_epi32(static_cast<int32_t>(hk));
  if ((Hkv & (Hkv - 1)) == 0) {
    const int hs = __builtin_ctzll(static_cast<unsigned long long>(Hkv));
    const __mmask16 on = _mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(rh, _mm512_set1_epi32(static_cast<int32_t>(Hkv - 1))), vhk);
    *row = _mm512_maskz_srli_epi32(on, rh, hs);
    return on;
  }
  const __mmask16 on = _mm512_mask_cmpeq_epi32_mask(m, _mm512_mask_i32gather_epi32(vhk, m, rh, st.rh_head.data(), 4), vhk);
  *row = _mm512_maskz_mov_epi32(on, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), on, rh, st.rh_row.data(), 4));
  return on;
}

// rope_row's arithmetic on a row held in NV registers (16 lanes each), stored rounded to TO at out.
template <Elem TO, int NV>
__attribute__((always_inline)) inline void rope_regs(const __m512* x, const float* c, const float* s, int64_t hc,
                                                     float* out) {
  constexpr int NH = NV / 2;
#pragma GCC unroll 4
  for (int i = 0; i < NH; ++i) {
    const __m512 a = x[i], b = x[i + NH];
    const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + 16 * i)), _mm512_mul_ps(b, _mm512_loadu_ps(s + 16 * i)));
    const __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + hc + 16 * i)),
                                    _mm512_mul_ps(a, _mm512_loadu_ps(s + hc + 16 * i)));
    _mm512_storeu_ps(out + 16 * i, rounded<TO>(lo));
    _mm512_storeu_ps(out + NH * 16 + 16 * i, rounded<TO>(hi));
  }
}

// The exact outliers of chunk id's K (key) or V rows of KV head hk, dense: patch[j * D + d] = value and bit
// j * D + d of mask set (16-bit words, D = 1 << shift), for the fused row loop to merge 16 lanes at a time by
// masked loads (the patch written once per chunk, long before its rows read it).
inline void head_outliers(const Rotated& rt, bool key, int64_t id, int64_t T, int64_t Hkv, int64_t hk, int shift,
                          float* patch, uint16_t* mask, Scratch& st) {
  std::memset(mask, 0, (T << shift) / 8);
  if (static_cast<int64_t>(st.own.size()) < rt.n_out + 16) st.own.resize(rt.n_out + 16);
  int32_t* own = st.own.data();  // this head's flat indices into [T, D], in order
  int64_t cursor = 0, n = 0;
  kvq_outlier_groups(rt, key, id, &cursor, T, Hkv, shift, [&](__mmask16 m, __m512i rh, __m512i d, __m512 x) {
    __m512i j;
    const __mmask16 on = kvq_this_head(st, Hkv, hk, m, rh, &j);
    const __m512i flat = _mm512_add_epi32(_mm512_slli_epi32(j, shift), d);
    _mm512_mask_i32scatter_ps(patch, on, flat, x, 4);
    _mm512_mask_compressstoreu_epi32(own + n, on, flat);
    n += __builtin_popcount(on);
  });
  // the mask bits after every group's compressed store (a scalar load right behind a compressed store waits for it)
  for (int64_t i = 0; i < n; ++i) mask[own[i] >> 4] |= uint16_t(1u << (own[i] & 15));
}

// kvquant_rows for a head dim DC known at compile time (64, 128): each row dequantized, its outliers merged
// and its key rotated in registers (no pre-RoPE copy stored and read back), the channel ranges held in
// registers. The same operations on the same values as kvquant_row: the rows bitwise.
template <int BITS, Elem TO, int DC>
void kvquant_rows_fused(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                        float* kd, float* vd, Scratch& st) {
  constexpr int NV = DC / 16, shift = __builtin_ctz(DC);
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, Hkv = sh.Hkv, nb = DC * BITS / 8, rs = Hkv * nb;
  float* kpat = st.k_patch.data();
  float* vpat = st.v_patch.data();
  uint16_t* kmask = reinterpret_cast<uint16_t*>(st.k_mask.data());
  uint16_t* vmask = reinterpret_cast<uint16_t*>(st.v_mask.data());
  if (j0 == 0) {  // a new chunk: its levels, per-channel key ranges and this head's outliers
    kvquant_chunk_ranges(cp, sh, id, hk, st);
    head_outliers(rt, true, id, T, Hkv, hk, shift, kpat, kmask, st);
    head_outliers(rt, false, id, T, Hkv, hk, shift, vpat, vmask, st);
  }
  const __m512 kl16 = _mm512_loadu_ps(st.klv.data()), vl16 = _mm512_loadu_ps(st.vlv.data());
  __m512 ks[NV], kz[NV];
  for (int i = 0; i < NV; ++i) ks[i] = _mm512_loadu_ps(st.ks.data() + 16 * i), kz[i] = _mm512_loadu_ps(st.kz.data() + 16 * i);
  const uint8_t* kc0 = static_cast<const uint8_t*>(cp.k) + id * T * rs + hk * nb;
  const uint8_t* vc0 = static_cast<const uint8_t*>(cp.v) + id * T * rs + hk * nb;
  const uint16_t* vs0 = cp.v_scale + id * T * Hkv + hk;
  const uint16_t* vz0 = cp.v_zero + id * T * Hkv + hk;
  for (int64_t j = j0; j < j1; ++j) {
    const uint8_t* kc = kc0 + j * rs;
    const uint8_t* vc = vc0 + j * rs;
    const float* c = rope_at(rt, rt.cos, id, T, j, hk, Hkv);
    const float* sn = rope_at(rt, rt.sin, id, T, j, hk, Hkv);
    float* ko = kd + (j - j0) * DC;
    float* vo = vd + (j - j0) * DC;
    __m512 x[NV];
    __m512i kq[NV], vq[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; i += 2) {
      if constexpr (BITS == 4) {
        codes32_4(kc, 16 * i, &kq[i], &kq[i + 1]);
        codes32_4(vc, 16 * i, &vq[i], &vq[i + 1]);
      } else {
        kq[i] = kvq_codes16<BITS>(kc, 16 * i), kq[i + 1] = kvq_codes16<BITS>(kc, 16 * i + 16);
        vq[i] = kvq_codes16<BITS>(vc, 16 * i), vq[i + 1] = kvq_codes16<BITS>(vc, 16 * i + 16);
      }
    }
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      x[i] = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(kq[i], kl16), ks[i]), kz[i]);
      x[i] = _mm512_mask_loadu_ps(x[i], _cvtu32_mask16(kmask[j * NV + i]), kpat + j * DC + 16 * i);
    }
    rope_regs<TO, NV>(x, c, sn, rt.rope_hc, ko);
    const __m512 vsc16 = _mm512_set1_ps(half_to_float(vs0[j * Hkv])), vz16 = _mm512_set1_ps(half_to_float(vz0[j * Hkv]));
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(vq[i], vl16), vsc16), vz16);
      _mm512_storeu_ps(vo + 16 * i, rounded<TO>(_mm512_mask_loadu_ps(v, _cvtu32_mask16(vmask[j * NV + i]), vpat + j * DC + 16 * i)));
    }
  }
}

// Whether kvquant_rows serves this layout: 16-lane rows of a power-of-two head dim (the outliers' flat
// indices split by shifts).
inline bool kvquant_segments(const Compressed& cp, const Shape& sh) {
  return cp.kind == KVQUANT && sh.D == sh.Dv && sh.D >= 16 && (sh.D & (sh.D - 1)) == 0;
}

// Rows [j0, j1) of chunk id, KV head hk, as kvquant_row makes them: keys to kd + (j - j0) * D, values to
// vd + (j - j0) * D. A chunk's rows come in order from row 0 (segments may split a chunk between two 64-key
// windows): its first segment loads its ranges, st.kvq_cursor carries how far its outlier lists were read.
template <int BITS, Elem TO>
void kvquant_rows_any_dim(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk,
                          float* kd, float* vd, Scratch& st) {
  const Rotated& rt = cp.rt;
  const int64_t T = cp.rows, D = sh.D, Hkv = sh.Hkv, nb = D * BITS / 8, rs = Hkv * nb;
  const int shift = __builtin_ctzll(static_cast<unsigned long long>(D));
  if (j0 == 0) {  // a new chunk: its levels, per-channel key ranges; its outlier lists from the start
    kvquant_chunk_ranges(cp, sh, id, hk, st);
    st.kvq_cursor[0] = st.kvq_cursor[1] = 0;
  }
  const float *ks = st.ks.data(), *kz = st.kz.data();
  const __m512 kl16 = _mm512_loadu_ps(st.klv.data()), vl16 = _mm512_loadu_ps(st.vlv.data());
  const uint8_t* kc0 = static_cast<const uint8_t*>(cp.k) + id * T * rs + hk * nb;
  const uint8_t* vc0 = static_cast<const uint8_t*>(cp.v) + id * T * rs + hk * nb;
  float* kpre = st.kpre.data();  // the segment's keys before RoPE
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t row = (id * T + j) * Hkv + hk;
    const __m512 vsc16 = _mm512_set1_ps(half_to_float(cp.v_scale[row])), vz16 = _mm512_set1_ps(half_to_float(cp.v_zero[row]));
    float* x = kpre + (j - j0) * D;
    float* v = vd + (j - j0) * D;
    for (int64_t d = 0; d < D; d += 16) {
      _mm512_storeu_ps(x + d, _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(kvq_codes16<BITS>(kc0 + j * rs, d), kl16),
                                                          _mm512_loadu_ps(ks + d)),
                                            _mm512_loadu_ps(kz + d)));
      _mm512_storeu_ps(v + d, _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(kvq_codes16<BITS>(vc0 + j * rs, d), vl16), vsc16),
                                            vz16));
    }
  }
  // the exact outliers of rows [j0, j1) of head hk over them
  const __m512i vj0 = _mm512_set1_epi32(static_cast<int32_t>(j0));
  for (int key = 0; key < 2; ++key) {
    float* dst = key ? kpre : vd;
    kvq_outlier_groups(rt, key, id, &st.kvq_cursor[key], j1, Hkv, shift, [&](__mmask16 m, __m512i rh, __m512i d, __m512 x) {
      __m512i j;
      const __mmask16 on = kvq_this_head(st, Hkv, hk, m, rh, &j);
      _mm512_mask_i32scatter_ps(dst, on, _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(j, vj0), shift), d), x, 4);
    });
  }
  for (int64_t j = j0; j < j1; ++j) {
    rope_row<TO>(kpre + (j - j0) * D, rope_at(rt, rt.cos, id, T, j, hk, Hkv), rope_at(rt, rt.sin, id, T, j, hk, Hkv),
                 kd + (j - j0) * D, D, rt.rope_hc);
    if constexpr (TO != F32) {
      float* v = vd + (j - j0) * D;
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(v + d, rounded<TO>(_mm512_loadu_ps(v + d)));
    }
  }
}

// Rows [j0, j1) of chunk id, KV head hk: kvquant_rows_fused for head dims 64 and 128, else kvquant_rows_any_dim.
template <int BITS, Elem TO>
void kvquant_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk, float* kd,
                  float* vd, Scratch& st) {
  if (sh.D == 64) kvquant_rows_fused<BITS, TO, 64>(cp, sh, id, j0, j1, hk, kd, vd, st);
  else if (sh.D == 128) kvquant_rows_fused<BITS, TO, 128>(cp, sh, id, j0, j1, hk, kd, vd, st);
  else kvquant_rows_any_dim<BITS, TO>(cp, sh, id, j0, j1, hk, kd, vd, st);
}

template <Elem TO>
void kvquant_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j0, int64_t j1, int64_t hk, float* kd,
                  float* vd, Scratch& st) {
  if (cp.bits == 2) kvquant_rows<2, TO>(cp, sh, id, j0, j1, hk, kd, vd, st);
  else if (cp.bits == 3) kvquant_rows<3, TO>(cp, sh, id, j0, j1, hk, kd, vd, st);
  else kvquant_rows<4, TO>(cp, sh, id, j0, j1, hk, kd, vd, st);
}

}  // namespace
