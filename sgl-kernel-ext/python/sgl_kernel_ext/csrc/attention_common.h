// Arithmetic shared by the CPU attention kernels (fixed_chunk_attention.cpp, draft_decode_attention.cpp).
//
// Invariant: a query row's attention output is a function of its query and its keys / values only.
// Keys are taken CHUNK at a time in order; a score is a dot product over D in 8-lane partial sums
// (one fused multiply-add per lane and step), the lanes added in a fixed tree; each chunk is folded
// into the row's running max / sum / output (float32 online softmax). Nothing here depends on other
// rows, the batch, padding or the thread. Built with -ffp-contract=off: only the explicit fmadd fuses.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ATTN_AVX2 1
#if defined(__AVX512F__)
#define ATTN_AVX512 1  // 16-lane P.V accumulation: each lane's chain is the 8-lane code's
#endif
#elif defined(__F16C__)
#include <immintrin.h>
#endif

namespace attn {

constexpr int64_t CHUNK = 64;
constexpr int64_t VW = 8;  // floats per vector (GCC vector extension: AVX, SSE or scalar code alike)
typedef float vfloat __attribute__((vector_size(VW * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(VW * sizeof(int32_t))));

enum Elem : int { F32 = 0, BF16 = 1, F16 = 2 };

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }
inline vfloat vload_part(const float* p, int64_t n) {  // p[0, n), n < 8, then zeros
  vfloat v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {  // a * b + c
#ifdef ATTN_AVX2
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline void halves_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

inline void bf16s_to_float(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

// A row of an exact-dtype source as float32: a pointer into the source when it is float32,
// else converted into buf (exactly: every bfloat16 / float16 value is a float32 value).
inline const float* exact_row(const void* base, Elem e, int64_t offset, int64_t n, float* buf) {
  if (e == F32) return static_cast<const float*>(base) + offset;
  const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
  if (e == BF16)
    bf16s_to_float(src, buf, n);
  else
    halves_to_float(src, buf, n);
  return buf;
}

// Asks for the cache lines of bytes [offset, offset + n) of base: a hint, no value depends on it. The
// kernels' row loops call it ahead of the rows they convert, so a row's lines are on their way while the
// rows before it are worked on (without it each row's load is waited on in turn).
inline void prefetch_bytes(const void* base, int64_t offset, int64_t n) {
  const char* p = static_cast<const char*>(base) + offset;
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b);
}

// The 8 lane sums of each accumulator a[i] -> out[i], ((0+1)+(2+3))+((4+5)+(6+7)).
inline void lane_sums8(const vfloat* a, float* out) {
#ifdef ATTN_AVX2
  const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
  const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  for (int c = 0; c < 8; ++c) {
    const vfloat v = a[c];
    out[c] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
  }
#endif
}

// s[c] = dot(q, k[c]) for 8 keys: lane j sums q[d] k[c][d] over d = j mod 8 in order (a tail of
// D mod 8 read as zeros), then lane_sums8.
inline void dot8(const float* q, const float* const* k, int64_t D, float* s) {
  vfloat a[8] = {};
  int64_t j = 0;
  for (; j + VW <= D; j += VW) {
    const vfloat qj = vload(q + j);
    for (int c = 0; c < 8; ++c) a[c] = fmadd(qj, vload(k[c] + j), a[c]);
  }
  if (j < D) {
    const vfloat qj = vload_part(q + j, D - j);
    for (int c = 0; c < 8; ++c) a[c] = fmadd(qj, vload_part(k[c] + j, D - j), a[c]);
  }
  lane_sums8(a, s);
}

// dot8's arithmetic for two queries over the same 4 keys (each K vector loaded once):
// s0[c] = dot(q0, k[c]), s1[c] = dot(q1, k[c]), c < 4, bitwise what dot8 gives.
inline void dot4x2(const float* q0, const float* q1, const float* const* k, int64_t D, float* s0, float* s1) {
  vfloat a[8] = {};
  int64_t j = 0;
  for (; j + VW <= D; j += VW) {
    const vfloat x0 = vload(q0 + j), x1 = vload(q1 + j);
    for (int c = 0; c < 4; ++c) {
      const vfloat kc = vload(k[c] + j);
      a[c] = fmadd(x0, kc, a[c]);
      a[4 + c] = fmadd(x1, kc, a[4 + c]);
    }
  }
  if (j < D) {
    const vfloat x0 = vload_part(q0 + j, D - j), x1 = vload_part(q1 + j, D - j);
    for (int c = 0; c < 4; ++c) {
      const vfloat kc = vload_part(k[c] + j, D - j);
      a[c] = fmadd(x0, kc, a[c]);
      a[4 + c] = fmadd(x1, kc, a[4 + c]);
    }
  }
  float out[8];
  lane_sums8(a, out);
  std::memcpy(s0, out, 4 * sizeof(float));
  std::memcpy(s1, out + 4, 4 * sizeof(float));
}

// acc[d0 : d0 + 8*NV] += sum over c < cn of p[c] * v[c][d0 : ...], keys in order.
template <int NV>
inline void pv_block(float* acc, const float* p, const float* const* v, int64_t cn, int64_t d0) {
#ifdef ATTN_AVX512
  if constexpr (NV % 2 == 0) {  // the same fused multiply-add per lane and key, 16 lanes a vector
    __m512 a[NV / 2];
    for (int j = 0; j < NV / 2; ++j) a[j] = _mm512_loadu_ps(acc + d0 + j * 16);
    for (int64_t c = 0; c < cn; ++c) {
      const __m512 pc = _mm512_set1_ps(p[c]);
      const float* vr = v[c] + d0;
      for (int j = 0; j < NV / 2; ++j) a[j] = _mm512_fmadd_ps(pc, _mm512_loadu_ps(vr + j * 16), a[j]);
    }
    for (int j = 0; j < NV / 2; ++j) _mm512_storeu_ps(acc + d0 + j * 16, a[j]);
    return;
  }
#endif
  vfloat a[NV];
  for (int j = 0; j < NV; ++j) a[j] = vload(acc + d0 + j * VW);
  for (int64_t c = 0; c < cn; ++c) {
    const vfloat pc = vfloat{} + p[c];
    const float* vr = v[c] + d0;
    for (int j = 0; j < NV; ++j) a[j] = fmadd(pc, vload(vr + j * VW), a[j]);
  }
  for (int j = 0; j < NV; ++j) vstore(acc + d0 + j * VW, a[j]);
}

// acc[0, Dv) += sum over c < cn of p[c] * v[c][0, Dv), keys in order, one fused multiply-add per step.
inline void pv(float* acc, const float* p, const float* const* v, int64_t cn, int64_t Dv) {
  int64_t d0 = 0;
  for (; d0 + 64 <= Dv; d0 += 64) pv_block<8>(acc, p, v, cn, d0);
  switch ((Dv - d0) / VW) {
    case 7: pv_block<7>(acc, p, v, cn, d0); break;
    case 6: pv_block<6>(acc, p, v, cn, d0); break;
    case 5: pv_block<5>(acc, p, v, cn, d0); break;
    case 4: pv_block<4>(acc, p, v, cn, d0); break;
    case 3: pv_block<3>(acc, p, v, cn, d0); break;
    case 2: pv_block<2>(acc, p, v, cn, d0); break;
    case 1: pv_block<1>(acc, p, v, cn, d0); break;
    default: break;
  }
  for (int64_t d = d0 + (Dv - d0) / VW * VW; d < Dv; ++d)  // a tail of Dv mod 8
    for (int64_t c = 0; c < cn; ++c) acc[d] = std::fma(p[c], v[c][d], acc[d]);
}

// acc[d] += p[c] * v[c][d] for keys c in [c_lo, c_hi) in order and lanes d in [d_lo, d_hi) (d_lo a
// multiple of 8): pv's arithmetic lane by lane (lanes of whole 8-vectors fmadd, the Dv mod 8 tail
// std::fma, as pv), so a chain split into key ranges computed one after another is pv's chain.
inline void pv_range(float* acc, const float* p, const float* const* v, int64_t c_lo, int64_t c_hi, int64_t d_lo,
                     int64_t d_hi, int64_t Dv) {
  const int64_t dv8 = Dv / VW * VW, vec_end = std::min(d_hi, dv8);
  for (int64_t d0 = d_lo; d0 < vec_end; d0 += VW) {
    vfloat a = vload(acc + d0);
    for (int64_t c = c_lo; c < c_hi; ++c) a = fmadd(vfloat{} + p[c], vload(v[c] + d0), a);
    vstore(acc + d0, a);
  }
  for (int64_t d = std::max(d_lo, dv8); d < d_hi; ++d)
    for (int64_t c = c_lo; c < c_hi; ++c) acc[d] = std::fma(p[c], v[c][d], acc[d]);
}

// exp for x <= 0 (a score minus its row's max), Cephes' expf polynomial (about 1 ulp), 8 lanes
// at a time; each step rounded on its own (no contraction), so every lane computes the same function.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat lo = vfloat{} - 87.0f;
  const vfloat xc = x < lo ? lo : x;
  const vfloat t = xc * 1.44269504088896341f + 0.5f;
#ifdef ATTN_AVX2
  const vfloat n = (vfloat)_mm256_floor_ps((__m256)t);
#else
  vfloat n;
  for (int i = 0; i < VW; ++i) n[i] = std::floor(t[i]);
#endif
  vfloat r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vfloat y = vfloat{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vfloat e = y * scale;
  return x < lo ? vfloat{} : e;
}

inline float lane_max(vfloat v) {
  float m = v[0];
  for (int i = 1; i < VW; ++i) m = std::max(m, v[i]);
  return m;
}

// The online-softmax state of one query head: its scaled query, running max / sum, unnormalized
// output acc[0, Dv), and CHUNK floats of score scratch s.
struct HeadState {
  const float* q;
  float* s;
  float* m;
  float* l;
  float* acc;
};

inline int64_t round8(int64_t n) { return (n + VW - 1) / VW * VW; }

// Scores s[0, cn8) -> probabilities (padding lanes [cn, cn8): 0), the head's max / sum / acc rescaled.
inline void softmax_chunk(const HeadState& h, int64_t cn, int64_t Dv) {
  const int64_t cn8 = round8(cn);
  float* s = h.s;
  for (int64_t c = cn; c < cn8; ++c) s[c] = -std::numeric_limits<float>::infinity();
  vfloat vmax = vfloat{} + *h.m;
  for (int64_t c = 0; c < cn8; c += VW) {
    const vfloat x = vload(s + c);
    vmax = x > vmax ? x : vmax;
  }
  const float mc = lane_max(vmax);
  const float alpha = std::exp(*h.m - mc);  // exp(-inf) = 0 on the first chunk
  vfloat vsum = {};
  for (int64_t c = 0; c < cn8; c += VW) {
    const vfloat p = exp_nonpositive(vload(s + c) - mc);  // padding lanes: 0
    vstore(s + c, p);
    vsum += p;
  }
  const float sum = ((vsum[0] + vsum[1]) + (vsum[2] + vsum[3])) + ((vsum[4] + vsum[5]) + (vsum[6] + vsum[7]));
  *h.l = *h.l * alpha + sum;
  *h.m = mc;
  for (int64_t d = 0; d < Dv; ++d) h.acc[d] *= alpha;
}

// One query head over one chunk of cn <= CHUNK keys: kp[c] its key rows (kp[cn, round8(cn)) any
// finite rows, e.g. zeros: their scores are set to -inf), vp[c] its value rows.
inline void attend_chunk(const HeadState& h, const float* const* kp, const float* const* vp, int64_t cn, int64_t D,
                         int64_t Dv) {
  for (int64_t c = 0; c < round8(cn); c += VW) dot8(h.q, kp + c, D, h.s + c);
  softmax_chunk(h, cn, Dv);
  pv(h.acc, h.s, vp, cn, Dv);
}

// acc0 / acc1 [d0, d0 + 32) += p0[c] / p1[c] * v[c][d0, ...] over c in [c_lo, c_hi), keys in order:
// pv's arithmetic (one fused multiply-add per key and lane), each V vector loaded once for both.
inline void pv2_block(float* acc0, float* acc1, const float* p0, const float* p1, const float* const* v, int64_t c_lo,
                      int64_t c_hi, int64_t d0) {
#ifdef ATTN_AVX512
  __m512 z[4];
  for (int j = 0; j < 2; ++j) z[j] = _mm512_loadu_ps(acc0 + d0 + j * 16), z[2 + j] = _mm512_loadu_ps(acc1 + d0 + j * 16);
  for (int64_t c = c_lo; c < c_hi; ++c) {
    const __m512 x0 = _mm512_set1_ps(p0[c]), x1 = _mm512_set1_ps(p1[c]);
    const float* vr = v[c] + d0;
    for (int j = 0; j < 2; ++j) {
      const __m512 vj = _mm512_loadu_ps(vr + j * 16);
      z[j] = _mm512_fmadd_ps(x0, vj, z[j]);
      z[2 + j] = _mm512_fmadd_ps(x1, vj, z[2 + j]);
    }
  }
  for (int j = 0; j < 2; ++j) _mm512_storeu_ps(acc0 + d0 + j * 16, z[j]), _mm512_storeu_ps(acc1 + d0 + j * 16, z[2 + j]);
  return;
#endif
  vfloat a[8];
  for (int j = 0; j < 4; ++j) a[j] = vload(acc0 + d0 + j * VW), a[4 + j] = vload(acc1 + d0 + j * VW);
  for (int64_t c = c_lo; c < c_hi; ++c) {
    const vfloat x0 = vfloat{} + p0[c], x1 = vfloat{} + p1[c];
    const float* vr = v[c] + d0;
    for (int j = 0; j < 4; ++j) {
      const vfloat vj = vload(vr + j * VW);
      a[j] = fmadd(x0, vj, a[j]);
      a[4 + j] = fmadd(x1, vj, a[4 + j]);
    }
  }
  for (int j = 0; j < 4; ++j) vstore(acc0 + d0 + j * VW, a[j]), vstore(acc1 + d0 + j * VW, a[4 + j]);
}

// attend_chunk for two query heads over the same key rows (their first cn0 / cn1 keys), bitwise
// what attend_chunk gives each: the K and V vectors are loaded once for both.
inline void attend_chunk2(const HeadState& h0, const HeadState& h1, const float* const* kp, const float* const* vp,
                          int64_t cn0, int64_t cn1, int64_t D, int64_t Dv) {
  const int64_t cn8 = round8(std::max(cn0, cn1));
  for (int64_t c = 0; c < cn8; c += 4) dot4x2(h0.q, h1.q, kp + c, D, h0.s + c, h1.s + c);
  softmax_chunk(h0, cn0, Dv);
  softmax_chunk(h1, cn1, Dv);
  const int64_t both = std::min(cn0, cn1), dv32 = Dv / 32 * 32;
  for (int64_t d0 = 0; d0 < dv32; d0 += 32) pv2_block(h0.acc, h1.acc, h0.s, h1.s, vp, 0, both, d0);
  // What is left, each lane's chain continuing in key order: keys [both, cn) of lanes [0, dv32),
  // all keys of lanes [dv32, Dv).
  for (const auto& [h, cn] : {std::pair<const HeadState*, int64_t>{&h0, cn0}, {&h1, cn1}}) {
    pv_range(h->acc, h->s, vp, both, cn, 0, dv32, Dv);
    pv_range(h->acc, h->s, vp, 0, cn, dv32, Dv, Dv);
  }
}

}  // namespace attn
