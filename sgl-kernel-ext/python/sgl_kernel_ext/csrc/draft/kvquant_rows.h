// Draft-decode attention: kvquant rows one at a time (non-uniform levels, exact outliers merged in, RoPE on
// the key): every build's path; kvquant_segments.h has the AVX-512 one.
#pragma once

#include "dequant_rows.h"
#include "rope_fwht.h"

namespace {

// ---- kvquant / rotatekv rows, each step rounded as the compressor's torch code rounds it

// Codes i..i+7 of a row packed as pack_bits does (8 codes per BITS bytes, code k at bit BITS*k).
template <int BITS>
inline vint code_ints(const uint8_t* packed, int64_t i) {
  const uint8_t* p = packed + i * BITS / 8;
  uint32_t word = p[0];  // BITS bytes, little endian (byte loads: no read past the row)
  if (BITS > 1) word |= static_cast<uint32_t>(p[1]) << 8;
  if (BITS > 2) word |= static_cast<uint32_t>(p[2]) << 16;
  if (BITS > 3) word |= static_cast<uint32_t>(p[3]) << 24;
  const vuint shifts = {0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS};
  return (vint)(((vuint{} + word) >> shifts) & ((1u << BITS) - 1));
}

// lv[c] for 8 codes c < 16, lv's 16 floats given as lo = lv[0:8], hi = lv[8:16] (entries past the
// level count are never picked).
inline vfloat lookup(vfloat lo, vfloat hi, vint c) {
#if defined(ATTN_AVX2) && defined(__AVX512VL__) && defined(__AVX512F__)
  // One two-table permute: index bit 3 picks hi (codes < 16 use bits 0-3 only).
  return (vfloat)_mm256_permutex2var_ps((__m256)lo, (__m256i)c, (__m256)hi);
#elif defined(ATTN_AVX2)
  const __m256i ci = (__m256i)c;
  const __m256 a = _mm256_permutevar8x32_ps((__m256)lo, ci), b = _mm256_permutevar8x32_ps((__m256)hi, ci);
  return (vfloat)_mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(ci, _mm256_set1_epi32(7))));
#else
  float lv[2 * VW];
  std::memcpy(lv, &lo, sizeof(lo));
  std::memcpy(lv + VW, &hi, sizeof(hi));
  vfloat r;
  for (int k = 0; k < VW; ++k) r[k] = lv[c[k]];
  return r;
#endif
}

inline float exact_value(const void* base, Elem e, int64_t i) {
  if (e == F32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  if (e == F16) return half_to_float(h);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// kvquant's outliers of one chunk (K or V), scattered where they belong: patch[flat] = value and bit flat of
// mask set, flat an index into the chunk's [T, Hkv, D]. The row loops merge them into their vectors by
// masked loads before storing a row: no branch per row on how many outliers it holds and no scalar store
// over a stored row (a cursor walking the list row by row and writing them back measured 5% slower).
template <typename I>
inline void scatter_outliers(const I* idx, const void* vals, Elem e, int64_t n_out, float* patch, uint8_t* mask) {
  for (int64_t c = 0; c < n_out; ++c) {
    const int64_t flat = idx[c];
    patch[flat] = exact_value(vals, e, c);
    mask[flat >> 3] |= static_cast<uint8_t>(1u << (flat & 7));
  }
}

inline void chunk_outliers(const Rotated& rt, bool key, int64_t id, float* patch, std::vector<uint8_t>& mask) {
  std::fill(mask.begin(), mask.end(), 0);
  const void* idx = key ? rt.k_out_idx : rt.v_out_idx;
  const void* vals = static_cast<const char*>(key ? rt.k_out_val : rt.v_out_val) +
                     id * rt.n_out * (rt.out_elem == F32 ? 4 : 2);
  if (rt.idx32)
    scatter_outliers(static_cast<const int32_t*>(idx) + id * rt.n_out, vals, rt.out_elem, rt.n_out, patch, mask.data());
  else
    scatter_outliers(static_cast<const int16_t*>(idx) + id * rt.n_out, vals, rt.out_elem, rt.n_out, patch, mask.data());
}

// Bits [f, f + n) of mask (n <= 16; the mask has 4 bytes of padding).
inline uint32_t mask_bits(const uint8_t* mask, int64_t f, int n) {
  uint32_t w;
  std::memcpy(&w, mask + (f >> 3), sizeof(w));
  return (w >> (f & 7)) & ((1u << n) - 1);
}

// x with the lanes set in bits (of 8) taken from p.
inline vfloat merge8(vfloat x, const float* p, uint32_t bits) {
  if (!bits) return x;
  const vint lane = {1, 2, 4, 8, 16, 32, 64, 128};
  return ((vint{} + static_cast<int32_t>(bits)) & lane) != 0 ? vload(p) : x;
}

#ifdef DRAFT_AVX512
// Codes i..i+15 of a row (i a multiple of 16). 3 bits: the 6 bytes from byte 3i/8 (a masked load: no read past
// the row), code k in the 16-bit word at byte 3k/8 (two byte shuffles), shifted by 3k mod 8 and masked.
template <int BITS>
inline __m512i kvq_codes16(const uint8_t* packed, int64_t i) {
  if constexpr (BITS == 3) {
    const __m128i b = _mm_maskz_loadu_epi8(0x3F, packed + i * 3 / 8);
    const __m128i lo = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 1, 0, 1, 0, 1, 1, 2, 1, 2, 1, 2, 2, 3, 2, 3));
    const __m128i hi = _mm_shuffle_epi8(b, _mm_setr_epi8(3, 4, 3, 4, 3, 4, 4, 5, 4, 5, 4, 5, 5, 6, 5, 6));
    const __m512i words = _mm512_cvtepu16_epi32(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
    const __m512i shifts = _mm512_setr_epi32(0, 3, 6, 1, 4, 7, 2, 5, 0, 3, 6, 1, 4, 7, 2, 5);
    return _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(7));
  } else {
    return codes16<BITS>(packed, i);
  }
}
#endif

// A kvquant chunk's levels and its per-channel key ranges of head hk, as float32 into st.
inline void kvquant_chunk_ranges(const Compressed& cp, const Shape& sh, int64_t id, int64_t hk, Scratch& st) {
  const Rotated& rt = cp.rt;
  const int64_t D = sh.D, L = rt.num_levels;
  halves_to_float(rt.k_levels + id * L, st.klv.data(), L);
  halves_to_float(rt.v_levels + id * L, st.vlv.data(), L);
  halves_to_float(cp.k_scale + (id * sh.Hkv + hk) * D, st.ks.data(), D);
  halves_to_float(cp.k_zero + (id * sh.Hkv + hk) * D, st.kz.data(), D);
}

// kvquant row j of chunk id, head hk: level[code] * scale + zero, outliers merged in, RoPE on the key;
// both rounded to TO. Head dims that are not powers of two, and builds without AVX-512: kvquant_rows has the rest.
template <int BITS, Elem TO>
void kvquant_row(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t hk, float* kd, float* vd,
                 Scratch& st) {
  const Rotated& rt = cp.rt;
  const int64_t R = cp.rows, D = sh.D, Hkv = sh.Hkv;
  if (j == 0) {  // a new chunk: its levels, per-channel key ranges and outliers
    kvquant_chunk_ranges(cp, sh, id, hk, st);
    chunk_outliers(rt, true, id, st.k_patch.data(), st.k_mask);
    chunk_outliers(rt, false, id, st.v_patch.data(), st.v_mask);
  }
  const int64_t row = (id * R + j) * Hkv + hk, nb = D * BITS / 8;
  const uint8_t* kc = static_cast<const uint8_t*>(cp.k) + row * nb;
  const uint8_t* vc = static_cast<const uint8_t*>(cp.v) + row * nb;
  float* x = st.pre.data();
  const vfloat klo = vload(st.klv.data()), khi = vload(st.klv.data() + VW);
  const vfloat vlo = vload(st.vlv.data()), vhi = vload(st.vlv.data() + VW);
  const float* ks = st.ks.data();
  const float* kz = st.kz.data();
  const float vsc = half_to_float(cp.v_scale[row]), vz = half_to_float(cp.v_zero[row]);
  const int64_t base = (j * Hkv + hk) * D;  // the row's flat offset in the chunk's outlier patches
  const float* kpat = st.k_patch.data() + base;
  const float* vpat = st.v_patch.data() + base;
  int64_t d = 0;
#ifdef DRAFT_AVX512
  // one 16-entry permute per 16 codes (levels past the count are never picked)
  const __m512 kl16 = _mm512_loadu_ps(st.klv.data()), vl16 = _mm512_loadu_ps(st.vlv.data());
  const __m512 vsc16 = _mm512_set1_ps(vsc), vz16 = _mm512_set1_ps(vz);
  for (; d + 16 <= D; d += 16) {
    const __m512i kq = kvq_codes16<BITS>(kc, d), vq = kvq_codes16<BITS>(vc, d);
    const __m512 kx = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(kq, kl16), _mm512_loadu_ps(ks + d)),
                                    _mm512_loadu_ps(kz + d));
    const __m512 vx = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(vq, vl16), vsc16), vz16);
    const __mmask16 km = mask_bits(st.k_mask.data(), base + d, 16), vm = mask_bits(st.v_mask.data(), base + d, 16);
    _mm512_storeu_ps(x + d, _mm512_mask_loadu_ps(kx, km, kpat + d));
    _mm512_storeu_ps(vd + d, rounded<TO>(_mm512_mask_loadu_ps(vx, vm, vpat + d)));
  }
#endif
  for (; d < D; d += VW) {
    const vfloat kx = lookup(klo, khi, code_ints<BITS>(kc, d)) * vload(ks + d) + vload(kz + d);
    const vfloat vx = lookup(vlo, vhi, code_ints<BITS>(vc, d)) * vsc + vz;
    vstore(x + d, merge8(kx, kpat + d, mask_bits(st.k_mask.data(), base + d, VW)));
    vstore(vd + d, rounded<TO>(merge8(vx, vpat + d, mask_bits(st.v_mask.data(), base + d, VW))));
  }
  rope_row<TO>(x, rope_at(rt, rt.cos, id, R, j, hk, Hkv), rope_at(rt, rt.sin, id, R, j, hk, Hkv), kd, D,
                rt.rope_hc);
}

}  // namespace
