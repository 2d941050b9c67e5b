// Draft-decode attention (draft_decode_attention.cpp): what every part shares. The kinds, DRAFT_AVX512,
// the rounding of dequantized rows to bfloat16 / float16, and the state of a call: its exact parts, its
// compressed layer, its shape and one work item's scratch buffers.
#pragma once

#include <array>
#include <type_traits>
#include <vector>

#include "../attention_common.h"

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
  // token drop with head-adaptive budgets: [NC, R, Hkv] int8, the KV head whose token each cell (row, column)
  // holds (KV head h attends to the cells tagged h, in storage order); null: cell (row, h) is head h's
  const int8_t* head = nullptr;
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
  std::vector<int64_t> cells;  // head-tagged token drop: the work item's cells, (chunk id * R + row) * Hkv + column
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

}  // namespace
