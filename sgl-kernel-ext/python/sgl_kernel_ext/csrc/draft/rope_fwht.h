// Draft-decode attention: RoPE on a dequantized pre-RoPE key row (the compressor's own table) and the
// Walsh-Hadamard transform of rotatekv, in rotatekv.fwht's order of butterflies.
#pragma once

#include "common.h"

namespace {

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

inline const float* rope_at(const Rotated& rt, const float* table, int64_t id, int64_t R, int64_t j, int64_t hk,
                            int64_t Hkv) {
  const int64_t p = rt.pos_per_head ? rt.pos[(id * R + j) * Hkv + hk] : rt.pos[id * R + j];
  return table + p * rt.rope_width;
}

}  // namespace
