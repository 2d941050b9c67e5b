// Batch-invariant CPU linear layer: y = x W^T + b, every output element computed by ONE float32
// accumulation over k in order,
//
//   acc = 0;  for k in 0..K-1: acc = fma(x[m, k], w[n, k], acc);  y[m, n] = round(acc + b[n])
//
// (x and w converted to float32 exactly, b added in float32, one rounding to the output dtype).
// Nothing else reaches an element's arithmetic: not the number of rows M, the row's tile, the thread
// count (threads split rows and weight panels, never K), the instruction set (AVX-512, AVX2 and the
// scalar fallback run the same fused multiply-add chain per element). A row's output is the same
// alone, in any batch, at any offset: batch-invariant by construction, nothing to probe.
//
// The weight is packed once at load into panels of NR = 16 output features, [NP][K][NR] in its
// stored dtype (float32, bfloat16 or float16; the last panel zero-padded), so the microkernel reads
// each panel as one contiguous stream and converts half values to float32 in registers: decode reads
// every weight byte once per step, in the dtype it is stored in.
//
//   x       [M, K]       float32 / bfloat16 / float16, contiguous
//   packed  [NP, K, 16]  float32 / bfloat16 / float16, contiguous (pack_weight in cpu_linear.py)
//   bias    [N] or empty float32
//   -> y    [M, N]       out_dtype
//
// Built with -ffp-contract=off: only the explicit fused multiply-adds fuse.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// LIN_FORCE_SCALAR (tests): the scalar fallback on any CPU, registered as LIN_NS.
#ifndef LIN_NS
#define LIN_NS sgl_kernel_ext_linear
#endif
#if defined(LIN_FORCE_SCALAR)
#elif defined(__AVX512F__)
#include <immintrin.h>
#define LIN_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LIN_AVX2 1
#endif

namespace {

constexpr int64_t NR = 16;  // output features per panel
constexpr int64_t MR = 6;   // rows per microkernel tile
constexpr int64_t MB = 48;  // rows per work item (its float32 x block stays in L2 over its panels)

enum Elem : int { F32 = 0, BF16 = 1, F16 = 2 };

// V16: 16 float32 lanes, one per output feature of a panel; every lane is its own accumulation.
#if defined(LIN_AVX512)
struct V16 {
  __m512 v;
};
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vbcast(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
template <int E>
inline V16 vload(const void* p) {
  if constexpr (E == F32) {
    return {_mm512_loadu_ps(static_cast<const float*>(p))};
  } else if constexpr (E == BF16) {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(h, 16))};
  } else {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)))};
  }
}
constexpr int VREGS = 32;
#elif defined(LIN_AVX2)
struct V16 {
  __m256 lo, hi;
};
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vbcast(float x) {
  const __m256 b = _mm256_set1_ps(x);
  return {b, b};
}
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
// bfloat16: the 16 values as 8 32-bit words, each word's low half (features 0, 2, .., 14) shifted up
// and its high half (1, 3, .., 15) masked: lo holds the even features, hi the odd ones (one load and
// two ALU ops, no shuffles); vstore_e<BF16> puts them back in order. Each lane is still one feature.
template <int E>
inline V16 vload(const void* p) {
  if constexpr (E == F32) {
    const float* f = static_cast<const float*>(p);
    return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
  } else if constexpr (E == BF16) {
    const __m256i w = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))))};
  } else {
    const __m128i* h = static_cast<const __m128i*>(p);
    return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
  }
}
constexpr int VREGS = 8;  // two registers per V16: as many V16 as AVX-512 holds in 16
#else  // scalar fallback: the same fused multiply-add per lane (std::fma rounds once)
struct V16 {
  float f[NR];
};
inline V16 vzero() { return {}; }
inline V16 vbcast(float x) {
  V16 r;
  for (int i = 0; i < NR; ++i) r.f[i] = x;
  return r;
}
inline V16 vfma(V16 a, V16 b, V16 c) {
  for (int i = 0; i < NR; ++i) c.f[i] = std::fma(a.f[i], b.f[i], c.f[i]);
  return c;
}
inline void vstore(float* p, V16 a) { std::memcpy(p, a.f, sizeof(a.f)); }
template <int E>
inline V16 vload(const void* p) {
  V16 r;
  for (int i = 0; i < NR; ++i) {
    if constexpr (E == F32) {
      r.f[i] = static_cast<const float*>(p)[i];
    } else if constexpr (E == BF16) {
      const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(p)[i]) << 16;
      std::memcpy(&r.f[i], &bits, sizeof(float));
    } else {
      r.f[i] = c10::detail::fp16_ieee_to_fp32_value(static_cast<const uint16_t*>(p)[i]);
    }
  }
  return r;
}
constexpr int VREGS = 8;
#endif

// A V16 of panel lanes in feature order: vload's lanes are, except AVX2's bfloat16 (even | odd features).
template <int E>
inline void vstore_e(float* p, V16 a) {
#if defined(LIN_AVX2)
  if constexpr (E == BF16) {
    const __m256 lo = _mm256_unpacklo_ps(a.lo, a.hi), hi = _mm256_unpackhi_ps(a.lo, a.hi);
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
    return;
  }
#endif
  vstore(p, a);
}

template <int E>
constexpr int64_t elem_size() {
  return E == F32 ? 4 : 2;
}

// Rows [0, R) of x (row stride ldx) times NPAN consecutive panels (first at w, panel stride pstride
// elements) over all K: acc[r][p] lane j = the dot product of row r with output feature p * NR + j.
// Written to out [R][NPAN * NR] float32.
template <int E, int R, int NPAN>
void micro(const float* __restrict x, int64_t ldx, const char* __restrict w, int64_t pstride, int64_t K,
           float* __restrict out) {
  constexpr int64_t es = elem_size<E>();
  V16 acc[R][NPAN];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NPAN; ++p) acc[r][p] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    V16 wv[NPAN];
#pragma GCC unroll 8
    for (int p = 0; p < NPAN; ++p) wv[p] = vload<E>(w + (p * pstride + k * NR) * es);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const V16 xb = vbcast(x[r * ldx + k]);
#pragma GCC unroll 8
      for (int p = 0; p < NPAN; ++p) acc[r][p] = vfma(xb, wv[p], acc[r][p]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < NPAN; ++p) vstore_e<E>(out + (r * NPAN + p) * NR, acc[r][p]);
}

using MicroFn = void (*)(const float*, int64_t, const char*, int64_t, int64_t, float*);

// Panels per microkernel call (1, 2 or 4) for a tile of R rows: enough independent accumulations to
// hide the fused multiply-add latency, within the vector registers.
inline int panels_for(int64_t R) {
  const int64_t most = std::min<int64_t>((VREGS * 3 / 4) / R, R <= 2 ? 4 : 2);
  return most >= 4 ? 4 : most >= 2 ? 2 : 1;
}

template <int E, int R>
MicroFn pick_npan(int npan) {
  switch (npan) {
    case 4: return &micro<E, R, 4>;
    case 2: return &micro<E, R, 2>;
    default: return &micro<E, R, 1>;
  }
}

template <int E>
MicroFn pick(int64_t R, int npan) {
  switch (R) {
    case 1: return pick_npan<E, 1>(npan);
    case 2: return pick_npan<E, 2>(npan);
    case 3: return pick_npan<E, 3>(npan);
    case 4: return pick_npan<E, 4>(npan);
    case 5: return pick_npan<E, 5>(npan);
    default: return pick_npan<E, 6>(npan);
  }
}

// Rounds float32 results + bias to the output dtype (one rounding, as c10's conversions do).
template <typename T>
inline void write_row(const float* acc, const float* bias, T* y, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float v = bias ? acc[j] + bias[j] : acc[j];
    y[j] = static_cast<T>(v);
  }
}

// Rows [m0, m1) of x as float32 (exact): a pointer into x when it is float32, else converted into buf.
inline const float* rows_as_float(const at::Tensor& x, int64_t m0, int64_t m1, std::vector<float>& buf) {
  const int64_t K = x.size(1);
  if (x.scalar_type() == at::kFloat) return x.data_ptr<float>() + m0 * K;
  buf.resize((m1 - m0) * K);
  const int64_t n = (m1 - m0) * K;
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(x.data_ptr()) + m0 * K;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(&buf[i], &bits, sizeof(float));
    }
  } else {
    const c10::Half* src = x.data_ptr<c10::Half>() + m0 * K;
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
  }
  return buf.data();
}

template <int E>
void linear_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), NP = packed.size(0), N = y.size(1);
  constexpr int64_t es = elem_size<E>();
  const char* wp = static_cast<const char*>(packed.data_ptr());
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const int64_t pstride = K * NR;
  const at::ScalarType out_type = y.scalar_type();
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t ysize = y.element_size();
  // Work item = (a block of up to MB rows, a group of panels); rows-major, so a thread's run of items
  // reuses its x block (converted to float32 once per run) over consecutive panels. Decode-sized M:
  // one block, panel groups only: about 4 per thread and a multiple of the threads, at most 16 panels
  // each, sizes differing by one panel at most (group pg: panels [pg * NP / n_pg, (pg + 1) * NP / n_pg)),
  // so the threads' shares of the weight (parallel_for gives each a run of whole items) are even.
  // Small products run on one thread (a parallel region costs more).
  const int64_t n_mb = (M + MB - 1) / MB;
  const int64_t threads = M * K * NP * NR < (int64_t{1} << 17) ? 1 : at::get_num_threads();
  const int64_t want = (threads * 4 + n_mb - 1) / n_mb;
  const int64_t fewest = (NP + 15) / 16, per_thread = (std::max(want, fewest) + threads - 1) / threads;
  const int64_t n_pg = std::min(NP, n_mb == 1 ? per_thread * threads : std::max(want, fewest));
  auto work = [&](int64_t begin, int64_t end) {
    alignas(64) float acc[MR * 4 * NR];
    std::vector<float> xbuf;
    int64_t x_mb = -1;
    const float* xb = nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t mb = item / n_pg, pg = item % n_pg;
      const int64_t m0 = mb * MB, m1 = std::min(M, m0 + MB);
      const int64_t p0 = pg * NP / n_pg, p1 = (pg + 1) * NP / n_pg;
      if (mb != x_mb) {
        xb = rows_as_float(x, m0, m1, xbuf);
        x_mb = mb;
      }
      for (int64_t t0 = m0; t0 < m1; t0 += MR) {
        const int64_t R = std::min<int64_t>(MR, m1 - t0);
        const int npan_full = panels_for(R);
        for (int64_t p = p0; p < p1;) {
          const int npan = p + npan_full <= p1 ? npan_full : p + 2 <= p1 && npan_full > 2 ? 2 : 1;
          pick<E>(R, npan)(xb + (t0 - m0) * K, K, wp + p * pstride * es, pstride, K, acc);
          for (int64_t r = 0; r < R; ++r)
            for (int q = 0; q < npan; ++q) {
              const int64_t n0 = (p + q) * NR, n = std::min(NR, N - n0);
              if (n <= 0) continue;
              const float* a = acc + (r * npan + q) * NR;
              const float* b = bp ? bp + n0 : nullptr;
              char* dst = yp + ((t0 + r) * N + n0) * ysize;
              switch (out_type) {
                case at::kFloat: write_row(a, b, reinterpret_cast<float*>(dst), n); break;
                case at::kBFloat16: write_row(a, b, reinterpret_cast<c10::BFloat16*>(dst), n); break;
                default: write_row(a, b, reinterpret_cast<c10::Half*>(dst), n); break;
              }
            }
          p += npan;
        }
      }
    }
  };
  if (threads == 1) {
    work(0, n_mb * n_pg);
  } else {
    at::parallel_for(0, n_mb * n_pg, 1, work);
  }
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t N,
                         at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == NR,
              "packed_linear: x [M, K], packed [NP, K, 16]");
  TORCH_CHECK(packed.is_contiguous(), "packed_linear: packed weight must be contiguous");
  TORCH_CHECK(x.size(1) == packed.size(1), "packed_linear: x has ", x.size(1), " features, the weight ",
              packed.size(1));
  TORCH_CHECK(N > (packed.size(0) - 1) * NR && N <= packed.size(0) * NR, "packed_linear: N ", N,
              " does not fit ", packed.size(0), " panels");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.numel() == N && bias.is_contiguous()),
              "packed_linear: bias must be float32 [N] (or empty)");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              "packed_linear: out_dtype must be float32, bfloat16 or float16");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "packed_linear: x must be float32, bfloat16 or float16");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(out_dtype));
  if (y.numel() == 0) return y;
  if (x.size(1) == 0) return bias.numel() ? bias.expand({x.size(0), N}).to(out_dtype) : y.zero_();
  switch (packed.scalar_type()) {
    case at::kFloat: linear_kernel<F32>(xc, packed, bias, y); break;
    case at::kBFloat16: linear_kernel<BF16>(xc, packed, bias, y); break;
    case at::kHalf: linear_kernel<F16>(xc, packed, bias, y); break;
    default: TORCH_CHECK(false, "packed_linear: the weight must be float32, bfloat16 or float16");
  }
  return y;
}

const char* isa() {
#if defined(LIN_AVX512)
  return "avx512";
#elif defined(LIN_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

std::string linear_isa() { return isa(); }

}  // namespace

#define LIN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
LIN_LIBRARY(LIN_NS, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor bias, int N, ScalarType out_dtype) -> Tensor");
  m.impl("packed_linear", c10::DispatchKey::CPU, &packed_linear);
  m.def("linear_isa() -> str", &linear_isa);
}
