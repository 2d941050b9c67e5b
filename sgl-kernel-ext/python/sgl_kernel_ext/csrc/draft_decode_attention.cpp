// Draft-decode attention on the CPU: one query token per request over
//   [compressed rows | exact tail | draft rows]
// read where they are stored. Compressed rows are token-dropped rows (exact dtype) or quantized
// codes (int8, fp8 e4m3, kivi 2/4-bit, kvquant, rotatekv) dequantized row by row into a 64-key
// buffer, in float32, with the compressor's own arithmetic (code * scale [+ zero], each step
// rounded: the file is built with -ffp-contract=off), so the rows equal compressor.decompress()
// bitwise; with round_to they are rounded to bfloat16 / float16 in registers as they are stored, as
// a context held in that dtype stores them (the model passes none: float32 rows). rotatekv with float32
// rows: the values' inverse transform is applied to their weighted sum (attend_item). Nothing is
// expanded in memory beyond one chunk of 64 keys per thread. Under AVX-512 rows are dequantized 16
// values at a time (the arithmetic is elementwise: the same values).
//
// kvquant, rotatekv and kivi with float32 rows (what the model passes), head dims 64 / 128 and chunks of a multiple of
// 16 rows (at consecutive positions: pre-RoPE keys) build no rows at all under AVX-512 (kvquant_key_scores,
// rotatekv_key_scores, kivi_key_scores; key_scores_apply): keys are scored 16 to a vector from their codes and values
// summed from theirs. The same dequantized values; the scores and sums are rounded in another order (the attention
// as the row path's to float32 rounding, not bitwise).
//
// Reduction order (batch invariant): each (request, KV head) is one work item; its G query heads
// go over the request's keys in order, CHUNK keys at a time, float32 online softmax. A row's
// result depends on its query and its keys only: not on the batch, other rows, padding or the
// thread count. The dot products and the online softmax are attention_common.h's (shared with
// fixed_chunk_attention.cpp).
//
//   q           [B, H, D] float32 (contiguous); round_to 0 none, 1 bfloat16, 2 float16
//   comp        kind 0 token_drop: [k, v] rows [NC, R, Hkv, D] (float32 / bfloat16 / float16)
//               kind 1 int8, 2 fp8: [k, k_scale, v, v_scale] codes [NC, T, Hkv, D] int8 / uint8
//                 (fp8 bytes), scales [NC, T, Hkv] float16
//               kind 3 kivi: [k, k_scale, k_zero, v, v_scale, v_zero] codes [NC, T, Hkv, D*bits/8]
//                 uint8, key scale/zero [NC, T/Gk, Hkv, D], value scale/zero [NC, T, Hkv, D/Gv] f16
//               kind 4 kvquant: [k_codes, k_scale, k_zero, k_levels, k_out_val, k_out_idx, v_codes, v_scale,
//                 v_zero, v_levels, v_out_val, v_out_idx, pos, cos, sin, cos_t, sin_t]: codes [NC, T, Hkv,
//                 D*bits/8] uint8 (bits 2-4, 8 codes per `bits` bytes), key scale/zero [NC, Hkv, D], value scale/zero
//                 [NC, T, Hkv] f16, levels [NC, L] f16, outliers [NC, N_o] (exact dtype; int16 / int32
//                 ascending flat indices into [T, Hkv, D]), pos [NC, T] or [NC, T, Hkv] int32, cos/sin
//                 [P, D] float32 (the compressor's RoPE table), or [P, D/2] where a channel pair's two
//                 halves share one angle (the table's first half); cos_t/sin_t that half pair-major [D/2, Pt >= P]
//                 where it is one (else empty: the key-score paths need it): k = RoPE(level * scale + zero, outliers)
//               kind 5 rotatekv: [k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, pos, cos, sin, cos_t, sin_t]: codes
//                 [NC, T, Hkv, D*bits/8] (bits 2/4), scale/zero [NC, T, Hkv, D/Gr] f16 per group of Gr
//                 rotated channels; params = [key_heads, block]: keys are Hadamard-transformed over the
//                 D channels of key_heads consecutive heads (block == D) or per head in blocks of
//                 `block` channels, values per head in blocks of `block`; RoPE then on the keys
//   params      kind 5: [key_heads, block]; otherwise empty
//   chunk_ids   [B, C] int64, chunk_lens [B]: request b reads chunks chunk_ids[b, :chunk_lens[b]]
//   tail_k/v    [N, Hkv, D|Dv] exact pool; tail_index [B, St] slots, tail_lens [B]
//   draft_k/v   [N', Hkv, D|Dv] draft pool (any float dtype); draft_index [B, Sd], draft_lens [B]
//   -> out      [B, H, Dv] float32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <type_traits>
#include <vector>

#include "attention_common.h"

namespace {

using namespace attn;

enum Kind : int64_t { TOKEN_DROP = 0, INT8 = 1, FP8 = 2, KIVI = 3, KVQUANT = 4, ROTATEKV = 5 };

constexpr int64_t PREFETCH_ROWS = 16;  // compressed rows asked for ahead of the row loop (prefetch_row)

// Where channel d of a 4-bit row lands when its 16-byte groups are widened and split into low / high nibbles
// (value_codes): (2-, 3-bit rows keep channel order).
template <int BITS>
constexpr int64_t code_lane(int64_t d) {
  if constexpr (BITS != 4) return d;
  const int64_t b = d >> 1;
  return 32 * (b >> 4) + 16 * (d & 1) + (b & 15);
}

typedef uint8_t vbyte __attribute__((vector_size(VW)));
typedef int8_t vsbyte __attribute__((vector_size(VW)));
typedef uint32_t vuint __attribute__((vector_size(VW * sizeof(uint32_t))));

// Where AVX-512 is there, rows are dequantized 16 values at a time (the rest 8 at a time). The
// arithmetic is elementwise, so every value is the same whichever width computes it.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DRAFT_AVX512 1
#endif

// ---- Rounding: a dequantized row is rounded as it is stored, to the nearest bfloat16 / float16 (ties
// to even), as a cast to the dtype a context in that dtype holds and back would round it (TO == F32:
// not rounded). Values are finite (dequantized codes).
//
// Where AVX512-BF16 is there, bfloat16 rounding is vcvtneps2bf16. It rounds to nearest even as the
// integer formula does, but treats float32 subnormals (< 2^-126) as zero. Dequantized rows hold none:
// codes times float16 scales plus float16 zeros are 0 or at least 2^-48 in magnitude, and outliers are
// a layer's largest values; a key row after RoPE / the Hadamard transform could only reach one by
// cancelling to below 2^-123, and would then differ from the torch path's row by less than 2^-126 (a
// draft only: verification is exact). The single-key test pins the bits per layout.
template <Elem TO>
inline vfloat rounded(vfloat x) {
  if constexpr (TO == BF16) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    const __m128i h = (__m128i)_mm256_cvtneps_pbh((__m256)x);
    return (vfloat)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
    vint bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & (int32_t)0xFFFF0000u;
    std::memcpy(&x, &bits, sizeof(bits));
    return x;
#endif
  } else if constexpr (TO == F16) {
#ifdef __F16C__
    return (vfloat)_mm256_cvtph_ps(_mm256_cvtps_ph((__m256)x, _MM_FROUND_TO_NEAREST_INT));
#else
    for (int i = 0; i < VW; ++i) x[i] = static_cast<float>(c10::Half(x[i]));
    return x;
#endif
  } else {
    return x;
  }
}

template <Elem TO>
inline float rounded(float x) {  // one value: the integer formula / float16's conversion
  if constexpr (TO == BF16) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits = (bits + (0x7FFFu + ((bits >> 16) & 1u))) & 0xFFFF0000u;
    std::memcpy(&x, &bits, sizeof(bits));
    return x;
  } else if constexpr (TO == F16) {
    return static_cast<float>(c10::Half(x));
  } else {
    return x;
  }
}

#ifdef DRAFT_AVX512
template <Elem TO>
inline __m512 rounded(__m512 x) {
  if constexpr (TO == BF16) {
#ifdef __AVX512BF16__
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
  } else if constexpr (TO == F16) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return x;
  }
}
#endif

// Calls f(std::integral_constant<Elem, TO>{}) for the rounding target `to`.
template <typename F>
inline void with_rounding(Elem to, F&& f) {
  if (to == BF16) f(std::integral_constant<Elem, BF16>{});
  else if (to == F16) f(std::integral_constant<Elem, F16>{});
  else f(std::integral_constant<Elem, F32>{});
}

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

struct Part {  // exact rows (tail or drafts): slot index[b, i], i < lens[b]
  const void* k = nullptr;
  const void* v = nullptr;
  Elem elem = F32;
  const int64_t* index = nullptr;
  int64_t width = 0;  // index row stride
  const int64_t* lens = nullptr;
};

// kvquant / rotatekv: what the min-max kinds do not have.
struct Rotated {
  const uint16_t *k_levels = nullptr, *v_levels = nullptr;  // [NC, L] float16 bits
  int64_t num_levels = 0;
  const void *k_out_val = nullptr, *v_out_val = nullptr;  // [NC, N_o] exact dtype
  Elem out_elem = F32;
  const void *k_out_idx = nullptr, *v_out_idx = nullptr;  // [NC, N_o] int16 / int32, ascending
  bool idx32 = false;
  int64_t n_out = 0;
  const int32_t* pos = nullptr;  // [NC, R] or [NC, R, Hkv]
  bool pos_per_head = false;
  const float *cos = nullptr, *sin = nullptr;  // [P, D], or [P, D / 2]: one angle per channel pair (d, d + D / 2)
  int64_t rope_width = 0;  // the table's row: D or D / 2
  int64_t rope_hc = 0;  // where the upper half's angles are in a row: D / 2 for a [P, D] table, 0 for [P, D / 2]
  int64_t P = 0;
  int64_t group = 0, key_heads = 1, block = 0;  // rotatekv
  // kvquant_key_scores / rotatekv_key_scores: the table pair-major, cos_t / sin_t [D / 2, Pt >= P] (pair i at
  // position p: cos_t[i * Pt + p]), where each channel pair's two halves hold one angle; null otherwise.
  const float *cos_t = nullptr, *sin_t = nullptr;
  int64_t Pt = 0;
};

struct Compressed {
  int64_t kind, rows, bits, key_group, value_group;  // rows = R (token drop) or T (quantizers)
  const void* k;
  const void* v;
  const uint16_t *k_scale, *k_zero, *v_scale, *v_zero;  // float16 bits
  Elem elem;  // token drop rows
  Elem round_to;  // dequantized rows rounded to this dtype (F32: not rounded)
  const int64_t* ids;
  int64_t width;
  const int64_t* lens;
  Rotated rt;
  int64_t row_bytes[2] = {0, 0};  // bytes of one (row, head)'s K / V codes or rows
  int64_t scale_width[4] = {0, 0, 0, 0};  // float16 [k_scale, k_zero, v_scale, v_zero] per (row, head)
};

struct Shape {
  int64_t B, H, Hkv, D, Dv, G;
};


// Per-thread state of one work item: buffers, and the kivi key group last converted.
struct Scratch {
  std::vector<float> qf, kbuf, vbuf, zero, s, acc, m, l, ks, kz, vs, vz, pre, klv, vlv;
  std::vector<const float*> kp, vp;  // [nh][CHUNK] rows of the chunk being scored
  int64_t group_chunk = -1, group = -1;
  std::vector<float> k_patch, v_patch;  // kvquant: the chunk's outliers, dense [T, Hkv, D] (chunk_outliers)
  std::vector<uint8_t> k_mask, v_mask;  // their bits
  std::vector<int32_t> rh_row, rh_head;  // kvquant_rows, Hkv not a power of two: row * Hkv + head -> row, head
  std::vector<float> kpre;  // kvquant_rows: a segment's key rows before RoPE [CHUNK, D]
  int64_t kvq_cursor[2] = {0, 0};  // kvquant_rows: how far the chunk's K / V outlier lists were read
  std::vector<int32_t> own;  // head_outliers: one head's outliers of a chunk
  // kvquant_key_scores: a chunk's levels (repeated to 16), its key outliers channel-major [D, T] with their bits
  // (16-bit words [D, T / 16]); rotatekv_key_scores: the queries times the Hadamard scaling [nh G, D]; both: the
  // scores of up to CHUNK rows [nh G, CHUNK]
  std::vector<float> ktab, kpat_t, qrot, sg;
  std::vector<uint16_t> kmask_t;
  // value_sums / minmax_value_sums: per query head the sum of p * scale * level in the codes' lane order [nh G, D]
  // and of p * zero (one, or one a scale group); the chunk's value scales / zeros ([T]; rotatekv / kivi: [heads *
  // groups, T]; vtmp: every head's, converted); kvquant's value outliers as (row, channel, exact - dequantized)
  // lists; the window's p * scale
  std::vector<float> accq, zsum, vsc, vzr, vtmp, vo_x, pp;
  // rotatekv_key_scores: the keys' scales / zeros [heads * groups, T], a block's dequantized channels
  // [nh * D, 16]; kivi_key_scores: q . zero [T / key_group, G]
  std::vector<float> ksc, kzr, xbuf, zsc;
  std::vector<int32_t> vo_j, vo_d;
  int64_t vo_n = 0;
  Scratch(const Shape& sh, int64_t rows)
      : qf(sh.H * sh.D), kbuf(sh.Hkv * CHUNK * sh.D), vbuf(sh.Hkv * CHUNK * sh.Dv), zero(sh.D, 0.f), s(2 * CHUNK),
        acc(sh.H * sh.Dv), m(sh.H), l(sh.H), ks(sh.D), kz(sh.D), vs(sh.Dv), vz(sh.Dv), pre(sh.Hkv * sh.D),
        klv(16, 0.f), vlv(16, 0.f), kp(sh.Hkv * CHUNK), vp(sh.Hkv * CHUNK), k_patch(rows * sh.Hkv * sh.D + VW),
        v_patch(rows * sh.Hkv * sh.D + VW), k_mask(rows * sh.Hkv * sh.D / 8 + 4), v_mask(rows * sh.Hkv * sh.D / 8 + 4),
        kpre(rows ? CHUNK * sh.D : 0), ktab(rows ? 16 : 0), kpat_t(rows * sh.D), qrot(rows ? (rows + sh.Hkv) * sh.G * sh.D : 0),
        sg(rows ? sh.H * CHUNK : 0), kmask_t(rows * sh.D / 16 + 1), accq(rows ? sh.H * sh.D : 0),
        zsum(sh.H * (sh.D / 16 + 1)), vsc(rows * sh.Hkv * (sh.D / 16 + 1) + 16), vzr(vsc.size()),
        vtmp(rows * sh.Hkv * (sh.D / 16 + 1) + 16), pp(rows ? sh.H * (sh.D / 16 + 1) * CHUNK : 0), ksc(vsc.size()),
        kzr(vsc.size()), xbuf(rows ? 16 * sh.Hkv * sh.D : 0), zsc(rows * sh.G) {
    if (sh.Hkv & (sh.Hkv - 1)) {  // kvq_this_head splits a power-of-two count by shifts
      rh_row.resize(rows * sh.Hkv), rh_head.resize(rows * sh.Hkv);
      for (int64_t i = 0; i < rows * sh.Hkv; ++i)
        rh_row[i] = static_cast<int32_t>(i / sh.Hkv), rh_head[i] = static_cast<int32_t>(i % sh.Hkv);
    }
  }
};

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

// out = x * cos + rotate_half(x) * sin (three roundings, as ChunkRope.rotate), rounded to TO;
// rotate_half(x) = [-x2, x1]. The upper half's angles are at c / s + hc (Rotated::rope_hc).
template <Elem TO>
inline void rope_row(const float* x, const float* c, const float* s, float* out, int64_t D, int64_t hc) {
  const int64_t h = D / 2;
  if (h % VW == 0) {
    int64_t d = 0;
#ifdef DRAFT_AVX512
    for (; d + 16 <= h; d += 16) {
      const __m512 a = _mm512_loadu_ps(x + d), b = _mm512_loadu_ps(x + d + h);
      // a*c + (-b)*s as a*c - b*s: (-b)*s is -(b*s) exactly, and x + (-y) is x - y
      const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + d)), _mm512_mul_ps(b, _mm512_loadu_ps(s + d)));
      const __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + d + hc)), _mm512_mul_ps(a, _mm512_loadu_ps(s + d + hc)));
      _mm512_storeu_ps(out + d, rounded<TO>(lo));
      _mm512_storeu_ps(out + d + h, rounded<TO>(hi));
    }
#endif
    for (; d < h; d += VW) {
      const vfloat a = vload(x + d), b = vload(x + d + h);
      vstore(out + d, rounded<TO>(a * vload(c + d) + (-b) * vload(s + d)));
      vstore(out + d + h, rounded<TO>(b * vload(c + d + hc) + a * vload(s + d + hc)));
    }
    return;
  }
  for (int64_t d = 0; d < h; ++d) out[d] = rounded<TO>(x[d] * c[d] + (-x[d + h]) * s[d]);
  for (int64_t d = h; d < D; ++d) out[d] = rounded<TO>(x[d] * c[d - h + hc] + x[d - h] * s[d - h + hc]);
}

// float(1 / sqrt(n)) for n = 2^k, computed in double as rotatekv.fwht does (once: a table by k).
inline float fwht_scale(int64_t n) {
  static const auto table = [] {
    std::array<float, 63> t{};
    for (int k = 0; k < 63; ++k) t[k] = static_cast<float>(1.0 / std::sqrt(static_cast<double>(int64_t{1} << k)));
    return t;
  }();
  return table[__builtin_ctzll(static_cast<unsigned long long>(n))];
}

// Butterflies at strides 1, 2, 4 within one 8-aligned vector ((a, b) -> (a + b, a - b), in fwht's order).
inline vfloat fwht8(vfloat v) {
  typedef int32_t vidx __attribute__((vector_size(VW * sizeof(int32_t))));
  vfloat a = __builtin_shuffle(v, vidx{0, 0, 2, 2, 4, 4, 6, 6}), b = __builtin_shuffle(v, vidx{1, 1, 3, 3, 5, 5, 7, 7});
  v = __builtin_shuffle(a + b, a - b, vidx{0, 9, 2, 11, 4, 13, 6, 15});
  a = __builtin_shuffle(v, vidx{0, 1, 0, 1, 4, 5, 4, 5}), b = __builtin_shuffle(v, vidx{2, 3, 2, 3, 6, 7, 6, 7});
  v = __builtin_shuffle(a + b, a - b, vidx{0, 1, 10, 11, 4, 5, 14, 15});
  a = __builtin_shuffle(v, vidx{0, 1, 2, 3, 0, 1, 2, 3}), b = __builtin_shuffle(v, vidx{4, 5, 6, 7, 4, 5, 6, 7});
  return __builtin_shuffle(a + b, a - b, vidx{0, 1, 2, 3, 12, 13, 14, 15});
}

#ifdef DRAFT_AVX512
// Butterflies at strides 1, 2, 4, 8 within 16 lanes: lane i takes x[i] + x[i ^ h] where bit h of i is
// clear, x[i ^ h] - x[i] where it is set (fwht's (a, b) -> (a + b, a - b)). One swap of the lanes at
// distance h and one fma(v, +-1, swapped) per stride: v * +-1 is exact, so the fma rounds once, as the
// addition or subtraction does (the same value, signed zeros included).
inline __m512 fwht16(__m512 v) {
  const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  v = _mm512_fmadd_ps(v, s1, _mm512_permute_ps(v, 0xB1));        // lanes (1, 0, 3, 2) in each 128 bits
  v = _mm512_fmadd_ps(v, s2, _mm512_permute_ps(v, 0x4E));        // (2, 3, 0, 1)
  v = _mm512_fmadd_ps(v, s4, _mm512_shuffle_f32x4(v, v, 0xB1));  // 128-bit blocks (1, 0, 3, 2)
  return _mm512_fmadd_ps(v, s8, _mm512_shuffle_f32x4(v, v, 0x4E));  // (2, 3, 0, 1)
}

#endif

// fwht8 / fwht16 as types, so fwht_regs's calls of them are inlined (as function pointers they were not).
struct Fwht8 {
  vfloat operator()(vfloat v) const { return fwht8(v); }
};
#ifdef DRAFT_AVX512
struct Fwht16 {
  __m512 operator()(__m512 v) const { return fwht16(v); }
};
#endif

// The butterflies at stride H (in vectors) over v[0, NV): v[i], v[i + H] -> a + b, a - b where bit H of i
// is clear. Indices are constants (template recursion, not loops) so the vectors stay in registers.
template <typename V, int NV, int H, int I = 0>
__attribute__((always_inline)) inline void fwht_stride(V* v) {
  if constexpr (I < NV) {
    if constexpr ((I & H) == 0) {
      const V a = v[I], b = v[I + H];
      v[I] = a + b;
      v[I + H] = a - b;
    }
    fwht_stride<V, NV, H, I + 1>(v);
  }
}

template <typename V, int NV, int H = 1>
__attribute__((always_inline)) inline void fwht_strides(V* v) {
  if constexpr (H < NV) {
    fwht_stride<V, NV, H>(v);
    fwht_strides<V, NV, 2 * H>(v);
  }
}

// fwht of NV vectors of V (8 or 16 floats) held in registers: within(v) does the strides inside one vector
// (fwht8 / fwht16), then the wider strides across vectors: the same butterflies, no store between strides.
template <typename V, int NV, Elem TO, typename Within>
inline void fwht_regs(float* x, float f, Within within) {
  constexpr int L = sizeof(V) / sizeof(float);
  V v[NV];
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) {
    std::memcpy(&v[i], x + i * L, sizeof(V));
    v[i] = within(v[i]);
  }
  fwht_strides<V, NV>(v);
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) {
    const V r = rounded<TO>(v[i] * f);
    std::memcpy(x + i * L, &r, sizeof(V));
  }
}

// rotatekv.fwht: orthonormal Walsh-Hadamard over n (a power of two) values, butterflies
// (a, b) -> (a + b, a - b) at strides h = 1, 2, 4, ..., then one scaling by float(1 / sqrt(n)). Strides
// below 8 (below 16 under AVX-512) mix lanes of one aligned vector only, so each vector goes through them
// on its own; the additions are the same, so the result is bitwise fwht's. The result is rounded to TO.
template <Elem TO>
inline void fwht(float* x, int64_t n) {
  const float f = fwht_scale(n);
  if (n < VW) {
    for (int64_t h = 1; h < n; h *= 2)
      for (int64_t s = 0; s < n; s += 2 * h)
        for (int64_t i = s; i < s + h; ++i) {
          const float a = x[i], b = x[i + h];
          x[i] = a + b;
          x[i + h] = a - b;
        }
    for (int64_t i = 0; i < n; ++i) x[i] = rounded<TO>(x[i] * f);
    return;
  }
  switch (n) {  // the head dims of real models (and 2 heads of them): in registers
    case 8: return fwht_regs<vfloat, 1, TO>(x, f, Fwht8{});
#ifdef DRAFT_AVX512
    case 16: return fwht_regs<__m512, 1, TO>(x, f, Fwht16{});
    case 32: return fwht_regs<__m512, 2, TO>(x, f, Fwht16{});
    case 64: return fwht_regs<__m512, 4, TO>(x, f, Fwht16{});
    case 128: return fwht_regs<__m512, 8, TO>(x, f, Fwht16{});
#else
    case 16: return fwht_regs<vfloat, 2, TO>(x, f, Fwht8{});
    case 32: return fwht_regs<vfloat, 4, TO>(x, f, Fwht8{});
    case 64: return fwht_regs<vfloat, 8, TO>(x, f, Fwht8{});
    case 128: return fwht_regs<vfloat, 16, TO>(x, f, Fwht8{});
#endif
    default: break;
  }
  for (int64_t i = 0; i < n; i += VW) vstore(x + i, fwht8(vload(x + i)));
  for (int64_t h = VW; h < n; h *= 2)
    for (int64_t s = 0; s < n; s += 2 * h)
      for (int64_t i = s; i < s + h; i += VW) {
        const vfloat a = vload(x + i), b = vload(x + i + h);
        vstore(x + i, a + b);
        vstore(x + i + h, a - b);
      }
  for (int64_t i = 0; i < n; i += VW) vstore(x + i, rounded<TO>(vload(x + i) * f));
}

// fwht over each block of `block` values of x[0, n) (rotatekv's per-head transform when D is not a
// power of two: its largest power-of-two blocks).
template <Elem TO>
inline void fwht_blocks(float* x, int64_t n, int64_t block) {
  for (int64_t b = 0; b < n; b += block) fwht<TO>(x + b, block);
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

inline const float* rope_at(const Rotated& rt, const float* table, int64_t id, int64_t R, int64_t j, int64_t hk,
                            int64_t Hkv) {
  const int64_t p = rt.pos_per_head ? rt.pos[(id * R + j) * Hkv + hk] : rt.pos[id * R + j];
  return table + p * rt.rope_width;
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

#ifdef DRAFT_AVX512
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
#else
inline bool key_scores_apply(const Compressed&, const Shape&) { return false; }
inline bool key_scores_request(const Compressed&, int64_t) { return false; }
inline void scored_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, Scratch&) {}
inline void rkv_scored_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, Scratch&) {}
inline void kivi_scored_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, Scratch&) {}
inline bool kvquant_segments(const Compressed&, const Shape&) { return false; }
template <Elem TO>
void kvquant_rows(const Compressed&, const Shape&, int64_t, int64_t, int64_t, int64_t, float*, float*, Scratch&) {}
#endif

// rotatekv with float32 rows (TO == F32): value rows stay in the rotated basis, and attend_item transforms
// their weighted sum instead (the transform is linear). Rounded rows are transformed one by one.
template <Elem TO>
constexpr bool folds_values = TO == F32;

// rotatekv row j of chunk id for the heads hk0.. of one Hadamard group (key_heads of them when block == D,
// else one): min-max codes in the rotated basis, the transform back, RoPE on the keys. Head hh's key row
// goes to kd + hh * stride, its value row to vd + hh * stride_v; both rounded to TO (values: see folds_values).
template <Elem TO>
void rotatekv_rows(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t hk0, int64_t nh, float* kd,
                   float* vd, int64_t stride, int64_t stride_v, Scratch& st) {
  const Rotated& rt = cp.rt;
  const int64_t R = cp.rows, D = sh.D, Hkv = sh.Hkv, nb = D * cp.bits / 8, ng = D / rt.group;
  const uint8_t* kc = static_cast<const uint8_t*>(cp.k);
  float* x = st.pre.data();
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t r2 = (id * R + j) * Hkv + hk0 + hh;
    minmax_row(kc + r2 * nb, cp.bits, cp.k_scale + r2 * ng, cp.k_zero + r2 * ng, rt.group, x + hh * D, D);
  }
  if (rt.block == D) fwht<F32>(x, nh * D);
  else fwht_blocks<F32>(x, D, rt.block);  // nh == 1
  for (int64_t hh = 0; hh < nh; ++hh) {
    const int64_t hk = hk0 + hh, row = (id * R + j) * Hkv + hk;
    rope_row<TO>(x + hh * D, rope_at(rt, rt.cos, id, R, j, hk, Hkv), rope_at(rt, rt.sin, id, R, j, hk, Hkv),
             kd + hh * stride, D, rt.rope_hc);
    float* v = vd + hh * stride_v;
    minmax_row(static_cast<const uint8_t*>(cp.v) + row * nb, cp.bits, cp.v_scale + row * ng, cp.v_zero + row * ng,
               rt.group, v, D);
    if constexpr (!folds_values<TO>)
      fwht_blocks<TO>(v, D, rt.block);
  }
}

#ifdef DRAFT_AVX512
// rotatekv_rows for a head dim DC known at compile time and NHK heads per Hadamard group (block == DC, scale
// groups of whole vectors): each head's key row dequantized, the heads' transform done and each key rotated
// in registers (no pre-transform copy stored and read back). The same operations on the same values as
// rotatekv_rows: the rows bitwise.
template <int BITS, Elem TO, int DC, int NHK>
void rotatekv_rows_fused(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t hk0, float* kd,
                         float* vd, int64_t stride, int64_t stride_v) {
  constexpr int NV = DC / 16, N = NV * NHK;
  const Rotated& rt = cp.rt;
  const int64_t R = cp.rows, Hkv = sh.Hkv, nb = DC * BITS / 8, ng = DC / rt.group, gv = rt.group / 16;
  // min-max codes * scale + zero (two roundings) for the NV vectors of row r (K or V) into x
  auto dequant = [&](const void* codes, const uint16_t* scale, const uint16_t* zero, int64_t r, __m512* x) {
    const uint8_t* c = static_cast<const uint8_t*>(codes) + r * nb;
    __m512i q[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; i += 2) {
      if constexpr (BITS == 4) codes32_4(c, 16 * i, &q[i], &q[i + 1]);
      else q[i] = codes16<BITS>(c, 16 * i), q[i + 1] = codes16<BITS>(c, 16 * i + 16);
    }
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      const int64_t g = r * ng + i / gv;
      x[i] = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q[i]), _mm512_set1_ps(half_to_float(scale[g]))),
                           _mm512_set1_ps(half_to_float(zero[g])));
    }
  };
  __m512 x[N];
#pragma GCC unroll 4
  for (int hh = 0; hh < NHK; ++hh) dequant(cp.k, cp.k_scale, cp.k_zero, (id * R + j) * Hkv + hk0 + hh, x + hh * NV);
  // fwht over the NHK * DC channels (fwht_regs's butterflies), then its scaling
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) x[i] = fwht16(x[i]);
  fwht_strides<__m512, N>(x);
  const __m512 f = _mm512_set1_ps(fwht_scale(NHK * DC));
#pragma GCC unroll 16
  for (int i = 0; i < N; ++i) x[i] = _mm512_mul_ps(x[i], f);
#pragma GCC unroll 4
  for (int hh = 0; hh < NHK; ++hh) {
    const int64_t hk = hk0 + hh;
    const float* c = rope_at(rt, rt.cos, id, R, j, hk, Hkv);
    const float* sn = rope_at(rt, rt.sin, id, R, j, hk, Hkv);
    float* ko = kd + hh * stride;
    rope_regs<TO, NV>(x + hh * NV, c, sn, rt.rope_hc, ko);
    __m512 v[NV];
    dequant(cp.v, cp.v_scale, cp.v_zero, (id * R + j) * Hkv + hk, v);
    float* vo = vd + hh * stride_v;
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(vo + 16 * i, v[i]);
    if constexpr (!folds_values<TO>) fwht_blocks<TO>(vo, DC, rt.block);
  }
}
#endif

// rotatekv_rows, through rotatekv_rows_fused where it serves the layout.
template <Elem TO>
void rotatekv_rows_any(const Compressed& cp, const Shape& sh, int64_t id, int64_t j, int64_t hk0, int64_t nh, float* kd,
                       float* vd, int64_t stride, int64_t stride_v, Scratch& st) {
#ifdef DRAFT_AVX512
  const int64_t D = sh.D;
  if (cp.rt.block == D && cp.rt.group % 16 == 0 && (cp.bits == 2 || cp.bits == 4)) {
    auto go = [&](auto bits, auto dc, auto nhk) {
      rotatekv_rows_fused<decltype(bits)::value, TO, decltype(dc)::value, decltype(nhk)::value>(cp, sh, id, j, hk0, kd, vd,
                                                                                              stride, stride_v);
    };
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    using I1 = std::integral_constant<int, 1>;
    using D64 = std::integral_constant<int, 64>;
    using D128 = std::integral_constant<int, 128>;
    const bool b4 = cp.bits == 4;
    if (D == 64 && nh == 1) return b4 ? go(I4{}, D64{}, I1{}) : go(I2{}, D64{}, I1{});
    if (D == 64 && nh == 2) return b4 ? go(I4{}, D64{}, I2{}) : go(I2{}, D64{}, I2{});
    if (D == 64 && nh == 4) return b4 ? go(I4{}, D64{}, I4{}) : go(I2{}, D64{}, I4{});
    if (D == 128 && nh == 1) return b4 ? go(I4{}, D128{}, I1{}) : go(I2{}, D128{}, I1{});
    if (D == 128 && nh == 2) return b4 ? go(I4{}, D128{}, I2{}) : go(I2{}, D128{}, I2{});
  }
#endif
  rotatekv_rows<TO>(cp, sh, id, j, hk0, nh, kd, vd, stride, stride_v, st);
}

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
  const int64_t n_comp = cp.lens[b] * cp.rows, n_tail = tail.lens[b];
  const int64_t n = n_comp + n_tail + (draft.lens ? draft.lens[b] : 0);
  const int64_t* ids = cp.ids + b * cp.width;
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
  else for (int64_t a = 0; a < std::min(n_comp, PREFETCH_ROWS); ++a) ahead();
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
      if (i < n_comp && segments) {  // the rest of this window's rows of the chunk at the cursor, at once
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

Elem elem_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    default: TORCH_CHECK(false, "draft_decode_attention: ", what, " must be float32, bfloat16 or float16");
  }
  return F32;
}

void check_index(const at::Tensor& index, const at::Tensor& lens, int64_t B, const char* what) {
  TORCH_CHECK(index.dim() == 2 && index.size(0) == B && index.scalar_type() == at::kLong && index.is_contiguous(),
              "draft_decode_attention: ", what, " index must be a contiguous int64 [B, S]");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == B && lens.scalar_type() == at::kLong && lens.is_contiguous(),
              "draft_decode_attention: ", what, " lens must be a contiguous int64 [B]");
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(l[b] >= 0 && l[b] <= index.size(1), "draft_decode_attention: ", what, " lens[", b, "] = ", l[b],
                " is outside [0, ", index.size(1), "]");
}

Part exact_part(const at::Tensor& k, const at::Tensor& v, const at::Tensor& index, const at::Tensor& lens,
                const Shape& sh, const char* what) {
  Part p;
  if (lens.numel() == 0) return p;  // no such part
  check_index(index, lens, sh.B, what);
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.size(1) == sh.Hkv && v.size(1) == sh.Hkv && k.size(2) == sh.D &&
                  v.size(2) == sh.Dv && k.size(0) == v.size(0) && k.is_contiguous() && v.is_contiguous() &&
                  k.scalar_type() == v.scalar_type(),
              "draft_decode_attention: ", what, " k/v must be contiguous [N, Hkv, D] of one dtype");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.numel(); ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < k.size(0), "draft_decode_attention: ", what, " slot out of range");
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.elem = elem_of(k, what);
  p.index = idx;
  p.width = index.size(1);
  p.lens = lens.data_ptr<int64_t>();
  return p;
}

// kvquant / rotatekv tensors (comp in the order of the header) into cp.rt, checked.
template <typename F16>
void set_rotated(Compressed& cp, at::TensorList comp, at::IntArrayRef params, const Shape& sh, int64_t nc, F16 f16) {
  const int64_t R = cp.rows, D = sh.D, Hkv = sh.Hkv, bits = cp.bits;
  const bool kvq = cp.kind == KVQUANT;
  const char* name = kvq ? "kvquant" : "rotatekv";
  TORCH_CHECK(sh.Dv == D && D % 2 == 0, "draft_decode_attention: ", name, " needs equal, even K / V head dims");
  TORCH_CHECK(kvq ? (bits >= 2 && bits <= 4) : (bits == 2 || bits == 4), "draft_decode_attention: ", name,
              " bits must be ", kvq ? "2, 3 or 4" : "2 or 4");
  const at::Tensor& ck = comp[0];
  const at::Tensor& cv = comp[kvq ? 6 : 3];
  TORCH_CHECK(ck.scalar_type() == at::kByte && cv.scalar_type() == at::kByte && ck.size(3) == D * bits / 8 &&
                  cv.size(3) == D * bits / 8,
              "draft_decode_attention: ", name, " codes must be uint8 [NC, T, Hkv, D*bits/8]");
  Rotated& rt = cp.rt;
  const at::Tensor &pos = comp[kvq ? 12 : 6], &cos = comp[kvq ? 13 : 7], &sin = comp[kvq ? 14 : 8];
  TORCH_CHECK(pos.scalar_type() == at::kInt && pos.size(0) == nc && pos.size(1) == R &&
                  (pos.dim() == 2 || (pos.dim() == 3 && pos.size(2) == Hkv)),
              "draft_decode_attention: pos must be int32 [NC, T] or [NC, T, Hkv]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.dim() == 2 && (cos.size(1) == D || cos.size(1) == D / 2) &&
                  sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat,
              "draft_decode_attention: cos / sin must be float32 [P, D] or [P, D / 2]");
  rt.rope_width = cos.size(1);
  rt.rope_hc = cos.size(1) == D ? D / 2 : 0;
  rt.pos = pos.data_ptr<int32_t>();
  rt.pos_per_head = pos.dim() == 3;
  rt.cos = cos.data_ptr<float>();
  rt.sin = sin.data_ptr<float>();
  rt.P = cos.size(0);
  const at::Tensor &cos_t = comp[kvq ? 15 : 9], &sin_t = comp[kvq ? 16 : 10];
  if (cos_t.numel()) {
    TORCH_CHECK(cos_t.scalar_type() == at::kFloat && cos_t.dim() == 2 && cos_t.size(0) == D / 2 &&
                    cos_t.size(1) >= rt.P && sin_t.sizes() == cos_t.sizes() && sin_t.scalar_type() == at::kFloat,
                "draft_decode_attention: cos_t / sin_t must be float32 [D / 2, >= P] (or empty)");
    rt.cos_t = cos_t.data_ptr<float>();
    rt.sin_t = sin_t.data_ptr<float>();
    rt.Pt = cos_t.size(1);
  }
  if (kvq) {
    rt.num_levels = int64_t{1} << bits;
    cp.k_scale = f16(comp[1], {nc, Hkv, D}, "k_scale");
    cp.k_zero = f16(comp[2], {nc, Hkv, D}, "k_zero");
    rt.k_levels = f16(comp[3], {nc, rt.num_levels}, "k_levels");
    cp.v_scale = f16(comp[7], {nc, R, Hkv}, "v_scale");
    cp.v_zero = f16(comp[8], {nc, R, Hkv}, "v_zero");
    rt.v_levels = f16(comp[9], {nc, rt.num_levels}, "v_levels");
    const at::Tensor &kov = comp[4], &koi = comp[5], &vov = comp[10], &voi = comp[11];
    rt.n_out = kov.dim() == 2 ? kov.size(1) : -1;
    TORCH_CHECK(rt.n_out >= 0 && kov.size(0) == nc && kov.sizes() == koi.sizes() && vov.sizes() == kov.sizes() &&
                    voi.sizes() == kov.sizes() && kov.scalar_type() == vov.scalar_type() &&
                    koi.scalar_type() == voi.scalar_type() &&
                    (koi.scalar_type() == at::kShort || koi.scalar_type() == at::kInt),
                "draft_decode_attention: kvquant outliers must be [NC, N_o] values and int16 / int32 indices");
    rt.out_elem = elem_of(kov, "kvquant outlier values");
    rt.idx32 = koi.scalar_type() == at::kInt;
    rt.k_out_val = kov.data_ptr();
    rt.v_out_val = vov.data_ptr();
    rt.k_out_idx = koi.data_ptr();
    rt.v_out_idx = voi.data_ptr();
  } else {
    const int64_t ng = comp[1].dim() == 4 ? comp[1].size(3) : 0;
    TORCH_CHECK(ng > 0 && D % ng == 0, "draft_decode_attention: rotatekv scales must be [NC, T, Hkv, D/G]");
    rt.group = D / ng;
    cp.k_scale = f16(comp[1], {nc, R, Hkv, ng}, "k_scale");
    cp.k_zero = f16(comp[2], {nc, R, Hkv, ng}, "k_zero");
    cp.v_scale = f16(comp[4], {nc, R, Hkv, ng}, "v_scale");
    cp.v_zero = f16(comp[5], {nc, R, Hkv, ng}, "v_zero");
    rt.key_heads = params[0];
    rt.block = params[1];
    auto pow2 = [](int64_t n) { return n > 0 && (n & (n - 1)) == 0; };
    TORCH_CHECK(pow2(rt.block) && D % rt.block == 0 && pow2(rt.key_heads) && Hkv % rt.key_heads == 0 &&
                    (rt.key_heads == 1 || rt.block == D),
                "draft_decode_attention: rotatekv params [key_heads, block] must be powers of two dividing Hkv "
                "and D (key_heads 1 unless block == D)");
  }
}

// Every position the requests read lies in the RoPE table.
void check_positions(const Compressed& cp, const Shape& sh) {
  const int64_t per = cp.rows * (cp.rt.pos_per_head ? sh.Hkv : 1);
  for (int64_t b = 0; b < sh.B; ++b)
    for (int64_t c = 0; c < cp.lens[b]; ++c) {
      const int32_t* p = cp.rt.pos + cp.ids[b * cp.width + c] * per;
      for (int64_t i = 0; i < per; ++i)
        TORCH_CHECK(p[i] >= 0 && p[i] < cp.rt.P, "draft_decode_attention: position ", p[i],
                    " is outside the RoPE table [0, ", cp.rt.P, ")");
    }
}

at::Tensor draft_decode_attention(const at::Tensor& q, int64_t kind, int64_t bits, int64_t round_to,
                                  at::TensorList comp,
                                  const at::Tensor& chunk_ids, const at::Tensor& chunk_lens, const at::Tensor& tail_k,
                                  const at::Tensor& tail_v, const at::Tensor& tail_index, const at::Tensor& tail_lens,
                                  const at::Tensor& draft_k, const at::Tensor& draft_v, const at::Tensor& draft_index,
                                  const at::Tensor& draft_lens, double scale, at::IntArrayRef params) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "draft_decode_attention: q must be a contiguous float32 [B, H, D]");
  Shape sh{q.size(0), q.size(1), tail_k.dim() == 3 ? tail_k.size(1) : 0, q.size(2),
           tail_v.dim() == 3 ? tail_v.size(2) : 0, 0};
  TORCH_CHECK(round_to >= F32 && round_to <= F16, "draft_decode_attention: round_to must be 0, 1 or 2");
  TORCH_CHECK(sh.Hkv > 0 && sh.H % sh.Hkv == 0, "draft_decode_attention: H must be a multiple of Hkv");
  TORCH_CHECK(sh.D % VW == 0 && sh.Dv % VW == 0, "draft_decode_attention: head dims must be multiples of 8");
  sh.G = sh.H / sh.Hkv;
  TORCH_CHECK(tail_lens.numel() == sh.B, "draft_decode_attention: tail_lens must be [B]");
  const Part tail = exact_part(tail_k, tail_v, tail_index, tail_lens, sh, "tail");
  const Part draft = exact_part(draft_k, draft_v, draft_index, draft_lens, sh, "draft");

  check_index(chunk_ids, chunk_lens, sh.B, "chunk");
  static const size_t want_of[] = {2, 4, 4, 6, 17, 11};
  TORCH_CHECK(kind >= TOKEN_DROP && kind <= ROTATEKV && comp.size() == want_of[kind],
              "draft_decode_attention: kind 0-5 with 2, 4, 4, 6, 17 or 11 compressed tensors");
  TORCH_CHECK(params.size() == (kind == ROTATEKV ? 2u : 0u), "draft_decode_attention: params must be "
              "[key_heads, block] for rotatekv, empty otherwise");
  for (const auto& t : comp) TORCH_CHECK(t.is_contiguous(), "draft_decode_attention: compressed tensors must be contiguous");
  static const int v_at[] = {1, 2, 2, 3, 6, 3};
  const at::Tensor& ck = comp[0];
  const at::Tensor& cv = comp[v_at[kind]];
  TORCH_CHECK(ck.dim() == 4 && cv.dim() == 4 && ck.size(2) == sh.Hkv && ck.size(1) == cv.size(1) &&
                  ck.size(0) == cv.size(0),
              "draft_decode_attention: compressed k/v must be [NC, rows, Hkv, *]");
  Compressed cp{kind, ck.size(1), bits, 1, 1, ck.data_ptr(), cv.data_ptr(), nullptr, nullptr, nullptr, nullptr,
                F32, static_cast<Elem>(round_to), chunk_ids.data_ptr<int64_t>(), chunk_ids.size(1), chunk_lens.data_ptr<int64_t>()};
  const int64_t nc = ck.size(0), R = cp.rows;
  auto f16 = [&](const at::Tensor& t, std::vector<int64_t> shape, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.sizes() == at::IntArrayRef(shape), "draft_decode_attention: ",
                what, " must be float16 ", at::IntArrayRef(shape));
    return reinterpret_cast<const uint16_t*>(t.data_ptr());
  };
  if (kind == TOKEN_DROP) {
    TORCH_CHECK(ck.size(3) == sh.D && cv.size(3) == sh.Dv && ck.scalar_type() == cv.scalar_type(),
                "draft_decode_attention: token-drop rows must be [NC, R, Hkv, D] of one dtype");
    cp.elem = elem_of(ck, "token-drop rows");
  } else if (kind == INT8 || kind == FP8) {
    const auto code = kind == INT8 ? at::kChar : at::kByte;
    TORCH_CHECK(ck.scalar_type() == code && cv.scalar_type() == code && ck.size(3) == sh.D && cv.size(3) == sh.Dv,
                "draft_decode_attention: int8 codes must be int8, fp8 codes uint8 bytes, [NC, T, Hkv, D]");
    cp.k_scale = f16(comp[1], {nc, R, sh.Hkv}, "k_scale");
    cp.v_scale = f16(comp[3], {nc, R, sh.Hkv}, "v_scale");
  } else if (kind == KVQUANT || kind == ROTATEKV) {
    set_rotated(cp, comp, params, sh, nc, f16);
  } else {
    TORCH_CHECK(bits == 2 || bits == 4, "draft_decode_attention: kivi bits must be 2 or 4");
    TORCH_CHECK(ck.scalar_type() == at::kByte && cv.scalar_type() == at::kByte && ck.size(3) == sh.D * bits / 8 &&
                    cv.size(3) == sh.Dv * bits / 8 && sh.D % (8 / bits) == 0 && sh.Dv % (8 / bits) == 0,
                "draft_decode_attention: kivi codes must be uint8 [NC, T, Hkv, D*bits/8]");
    const int64_t key_groups = comp[1].dim() == 4 ? comp[1].size(1) : 0;
    const int64_t value_groups = comp[4].dim() == 4 ? comp[4].size(3) : 0;
    TORCH_CHECK(key_groups > 0 && R % key_groups == 0 && value_groups > 0 && sh.Dv % value_groups == 0,
                "draft_decode_attention: kivi scales must be [NC, T/Gk, Hkv, D] and [NC, T, Hkv, Dv/Gv]");
    cp.key_group = R / key_groups;
    cp.value_group = sh.Dv / value_groups;
    cp.k_scale = f16(comp[1], {nc, key_groups, sh.Hkv, sh.D}, "k_scale");
    cp.k_zero = f16(comp[2], {nc, key_groups, sh.Hkv, sh.D}, "k_zero");
    cp.v_scale = f16(comp[4], {nc, R, sh.Hkv, value_groups}, "v_scale");
    cp.v_zero = f16(comp[5], {nc, R, sh.Hkv, value_groups}, "v_zero");
  }
  const bool whole = kind == TOKEN_DROP || kind == INT8 || kind == FP8;  // one element per channel
  const int64_t es = kind == TOKEN_DROP ? (cp.elem == F32 ? 4 : 2) : 1;
  cp.row_bytes[0] = whole ? sh.D * es : sh.D * bits / 8;
  cp.row_bytes[1] = whole ? sh.Dv * es : sh.Dv * bits / 8;
  if (kind == INT8 || kind == FP8) cp.scale_width[0] = cp.scale_width[2] = 1;
  if (kind == KIVI) cp.scale_width[2] = cp.scale_width[3] = sh.Dv / cp.value_group;
  if (kind == KVQUANT) cp.scale_width[2] = cp.scale_width[3] = 1;
  if (kind == ROTATEKV) for (auto& w : cp.scale_width) w = sh.D / cp.rt.group;
  const int64_t* ids = cp.ids;
  for (int64_t i = 0; i < chunk_ids.numel(); ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < nc, "draft_decode_attention: chunk id out of range");
  if (cp.rt.pos != nullptr) check_positions(cp, sh);

  auto out = at::empty({sh.B, sh.H, sh.Dv}, q.options());
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // Work items: (request, KV head), or (request, Hadamard group of KV heads) for rotatekv
  const int64_t nh = kind == ROTATEKV && cp.rt.block == sh.D ? cp.rt.key_heads : 1, per = sh.Hkv / nh;
  with_rounding(cp.round_to, [&](auto to) {
    at::parallel_for(0, sh.B * per, 1, [&](int64_t begin, int64_t end) {
      Scratch st(sh, kind == KVQUANT || kind == ROTATEKV || kind == KIVI ? cp.rows : 0);
      for (int64_t w = begin; w < end; ++w)
        attend_item<decltype(to)::value>(qp, cp, tail, draft, sh, fscale, w / per, w % per * nh, nh, op, st);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sgl_kernel_ext_draft_cpu, m) {
  m.def(
      "draft_decode_attention(Tensor q, int kind, int bits, int round_to, Tensor[] comp, Tensor chunk_ids, Tensor chunk_lens, "
      "Tensor tail_k, Tensor tail_v, Tensor tail_index, Tensor tail_lens, Tensor draft_k, Tensor draft_v, "
      "Tensor draft_index, Tensor draft_lens, float scale, int[] params=[]) -> Tensor");
  m.impl("draft_decode_attention", c10::DispatchKey::CPU, &draft_decode_attention);
}
