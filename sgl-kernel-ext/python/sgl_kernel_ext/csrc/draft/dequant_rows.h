// Draft-decode attention: int8, fp8 and kivi / min-max rows dequantized in float32 (each step rounded as the
// compressor's torch code rounds it), 8 values at a time, 16 under AVX-512.
#pragma once

#include "common.h"

namespace {

// ---- int8, fp8 and kivi rows (n a multiple of 8)

// dst[i] = float(src[i]) * scale (an exact conversion, one rounding), rounded to TO.
template <Elem TO>
inline void int8_row(const int8_t* src, float scale, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef DRAFT_AVX512
  const __m512 s16 = _mm512_set1_ps(scale);
  for (; i + 16 <= n; i += 16) {
    const __m512i c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm512_storeu_ps(dst + i, rounded<TO>(_mm512_mul_ps(_mm512_cvtepi32_ps(c), s16)));
  }
#endif
#ifdef ATTN_AVX2  // the same conversion 8 at a time (the vector-extension loop below compiled to ~2x slower drafting)
  const __m256 s8 = _mm256_set1_ps(scale);
  for (; i < n; i += VW) {
    const __m256i c = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    vstore(dst + i, rounded<TO>((vfloat)_mm256_mul_ps(_mm256_cvtepi32_ps(c), s8)));
  }
#endif
  for (; i < n; i += VW) {
    vsbyte raw;
    std::memcpy(&raw, src + i, sizeof(raw));
    vstore(dst + i, rounded<TO>(__builtin_convertvector(__builtin_convertvector(raw, vint), vfloat) * scale));
  }
}

// dst[i] = float(float8_e4m3fn byte src[i]) * scale, exactly as torch converts (bias 7, no
// infinities, 0x7F / 0xFF NaN), rounded to TO.
template <Elem TO>
inline void fp8_row(const uint8_t* src, float scale, float* dst, int64_t n) {
  int64_t i = 0;
  // e4m3 bits moved into a float16's (sign, exponent, mantissa) are the same number times 2^-8,
  // subnormals included; the hardware conversion is exact, and (x * 2^-8) * (scale * 2^8) rounds
  // once, exactly as x * scale.
#ifdef DRAFT_AVX512
  const __m512 s512 = _mm512_set1_ps(scale * 256.0f), nan512 = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
  const __m256i sign16 = _mm256_set1_epi16(0x80), mag16 = _mm256_set1_epi16(0x7F);
  for (; i + 16 <= n; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    const __m256i m = _mm256_and_si256(b, mag16);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, sign16), 8), _mm256_slli_epi16(m, 7));
    const __m512 f = _mm512_mul_ps(_mm512_cvtph_ps(h), s512);
    _mm512_storeu_ps(dst + i, rounded<TO>(_mm512_mask_blend_ps(_mm256_cmpeq_epi16_mask(m, mag16), f, nan512)));
  }
#endif
#if defined(ATTN_AVX2) && defined(__F16C__)
  const __m256 s256 = _mm256_set1_ps(scale * 256.0f);
  const __m128i sign = _mm_set1_epi16(0x80), mag = _mm_set1_epi16(0x7F);
  for (; i < n; i += VW) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign), 8), _mm_slli_epi16(_mm_and_si128(b, mag), 7));
    __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), s256);
    const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_cvtepu16_epi32(_mm_and_si128(b, mag)),
                                                              _mm256_set1_epi32(0x7F)));
    f = _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
    vstore(dst + i, rounded<TO>((vfloat)f));
  }
  return;
#endif
  for (; i < n; i += VW) {  // integer ops
#ifdef ATTN_AVX2
    const vint byte = (vint)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)));
#else
    vbyte raw;
    std::memcpy(&raw, src + i, sizeof(raw));
    const vint byte = __builtin_convertvector(raw, vint);
#endif
    const vint em = byte & 0x7F;
    const vint normal = (em << 20) + (120 << 23);  // exponent e + 120, mantissa to the top 3 bits
    const vfloat sub_f = __builtin_convertvector(em & 7, vfloat) * 0.001953125f;  // m * 2^-9
    vint sub;
    std::memcpy(&sub, &sub_f, sizeof(sub));
    vint bits = (em >> 3) == 0 ? sub : normal;
    bits = em == 0x7F ? vint{} + 0x7FC00000 : bits;
    bits |= (byte & 0x80) << 24;
    vfloat f;
    std::memcpy(&f, &bits, sizeof(f));
    vstore(dst + i, rounded<TO>(f * scale));
  }
}

// Codes i..i+7 of a kivi row (8 codes fill BITS bytes, code k at bits BITS*k) as floats.
template <int BITS>
inline vfloat kivi_codes(const uint8_t* packed, int64_t i) {
  uint32_t word = 0;
  std::memcpy(&word, packed + i * BITS / 8, BITS);  // little endian: code k of the 8 at bit BITS*k
  const vuint shifts = {0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS};
  const vuint codes = ((vuint{} + word) >> shifts) & ((1u << BITS) - 1);
  return __builtin_convertvector((vint)codes, vfloat);  // < 16: the signed conversion is exact
}

#ifdef DRAFT_AVX512
// Codes i..i+15 of a row packed 8 codes per BITS bytes (BITS 2 or 4: each byte copied to the lanes
// of its codes, shifted and masked).
template <int BITS>
inline __m512i codes16(const uint8_t* packed, int64_t i) {
  static_assert(BITS == 2 || BITS == 4, "2 or 4 bits (3: two code_ints)");
  __m128i bytes;
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(packed + i / 2));
    bytes = _mm_unpacklo_epi8(b, b);
  } else {
    int32_t w;
    std::memcpy(&w, packed + i / 4, sizeof(w));
    bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(w), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  }
  const __m512i shifts = BITS == 4 ? _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4)
                                   : _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  return _mm512_and_si512(_mm512_srlv_epi32(_mm512_cvtepu8_epi32(bytes), shifts), _mm512_set1_epi32((1 << BITS) - 1));
}

// Codes i..i+31 of a 4-bit row (i a multiple of 32) as two vectors of 16 in order: the 16 bytes widened once,
// low / high nibbles (the even / odd codes) split, then interleaved back (7 instructions for 32 codes where two
// codes16 take 8, and 2 fewer on the shuffle port).
inline void codes32_4(const uint8_t* packed, int64_t i, __m512i* lo, __m512i* hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + i / 2)));
  const __m512i even = _mm512_and_si512(b, _mm512_set1_epi32(15)), odd = _mm512_srli_epi32(b, 4);
  *lo = _mm512_permutex2var_epi32(even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd);
  *hi = _mm512_permutex2var_epi32(even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31), odd);
}

template <int BITS>
inline __m512 kivi_codes16(const uint8_t* packed, int64_t i) {
  return _mm512_cvtepi32_ps(codes16<BITS>(packed, i));  // < 16: exact
}
#endif

// dst = code * scale + zero (two roundings, as compressor.decompress), per channel scale / zero,
// rounded to TO.
template <int BITS, Elem TO>
inline void kivi_row(const uint8_t* packed, const float* scale, const float* zero, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef DRAFT_AVX512
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, rounded<TO>(_mm512_add_ps(_mm512_mul_ps(kivi_codes16<BITS>(packed, i), _mm512_loadu_ps(scale + i)),
                                                        _mm512_loadu_ps(zero + i))));
#endif
  for (; i < n; i += VW) vstore(dst + i, rounded<TO>(kivi_codes<BITS>(packed, i) * vload(scale + i) + vload(zero + i)));
}

// The same with one scale / zero per group of `group` channels (float16 bits), group a multiple of 8.
template <int BITS, Elem TO>
inline void kivi_row_grouped(const uint8_t* packed, const uint16_t* scale, const uint16_t* zero, int64_t group,
                             float* dst, int64_t n) {
  for (int64_t i = 0, gi = 0; i < n; i += group, ++gi) {
    const float sc = half_to_float(scale[gi]), z = half_to_float(zero[gi]);
    int64_t e = i;
#ifdef DRAFT_AVX512
    const __m512 sc16 = _mm512_set1_ps(sc), z16 = _mm512_set1_ps(z);
    for (; e + 16 <= i + group; e += 16)
      _mm512_storeu_ps(dst + e, rounded<TO>(_mm512_add_ps(_mm512_mul_ps(kivi_codes16<BITS>(packed, e), sc16), z16)));
#endif
    for (; e < i + group; e += VW) vstore(dst + e, rounded<TO>(kivi_codes<BITS>(packed, e) * sc + z));
  }
}

// code * scale + zero with one float16 scale / zero per `group` channels (two roundings).
template <int BITS>
inline void minmax_row(const uint8_t* packed, const uint16_t* sc16, const uint16_t* z16, int64_t group, float* dst,
                       int64_t n) {
  if (group % VW == 0) return kivi_row_grouped<BITS, F32>(packed, sc16, z16, group, dst, n);
  for (int64_t i = 0; i < n; i += VW) vstore(dst + i, kivi_codes<BITS>(packed, i));
  for (int64_t d = 0, gi = 0; d < n; ++gi) {
    const float sc = half_to_float(sc16[gi]), z = half_to_float(z16[gi]);
    for (int64_t e = 0; e < group; ++e, ++d) dst[d] = dst[d] * sc + z;
  }
}

inline void minmax_row(const uint8_t* packed, int64_t bits, const uint16_t* sc16, const uint16_t* z16, int64_t group,
                       float* dst, int64_t n) {
  if (bits == 2) minmax_row<2>(packed, sc16, z16, group, dst, n);
  else minmax_row<4>(packed, sc16, z16, group, dst, n);
}

}  // namespace
