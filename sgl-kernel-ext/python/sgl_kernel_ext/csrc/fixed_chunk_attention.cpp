// Batch-invariant attention on the CPU: every query row is reduced over its visible keys in
// fixed chunks of CHUNK visible keys, in key order, with float32 statistics. A row's result is a
// function of (its query, its visible keys and values) only: not of the batch, the number of query
// rows, the padding, the thread count or where the row sits. Decode rows, verify rows and prefill
// rows of the same position therefore agree bitwise.
//
//   q       [B, Lq, H, D]      float32 / bfloat16 / float16, contiguous
//   k_src   [N, Hkv, D]        same dtype as q, contiguous (a KV pool, or an assembled context)
//   v_src   [N, Hkv, Dv]       same dtype
//   index   [B, S] int64       row of k_src / v_src holding request b's key s
//   allowed [B, Lq, S] bool    key s visible to query i (an empty tensor: every key visible)
//   -> out  [B, Lq, H, Dv]     float32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t CHUNK = 64;

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

template <typename T>
void attend_kernel(const at::Tensor& q, const at::Tensor& k_src, const at::Tensor& v_src,
                   const at::Tensor& index, const at::Tensor& allowed, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Lq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Hkv = k_src.size(1), Dv = v_src.size(2), S = index.size(1);
  const int64_t G = H / Hkv;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_src.data_ptr<T>();
  const T* vp = v_src.data_ptr<T>();
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* ap = allowed.numel() ? allowed.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * Lq * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), kf(D), vf(Dv), acc(G * Dv), m(G), l(G), scores(G * CHUNK), alpha(G);
    std::vector<int64_t> rows(CHUNK);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t hk = w % Hkv, i = (w / Hkv) % Lq, b = w / (Hkv * Lq);
      for (int64_t g = 0; g < G; ++g) {
        to_float(qp + ((b * Lq + i) * H + hk * G + g) * D, qf.data() + g * D, D);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] *= fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const bool* row_allowed = ap ? ap + (b * Lq + i) * S : nullptr;
      int64_t n = 0;  // visible keys in the current chunk
      auto flush = [&]() {
        for (int64_t g = 0; g < G; ++g) {
          float* sc = scores.data() + g * CHUNK;
          float mc = m[g];
          for (int64_t c = 0; c < n; ++c) mc = std::max(mc, sc[c]);
          alpha[g] = std::exp(m[g] - mc);  // exp(-inf) = 0 on the first chunk
          float sum = 0.f;
          for (int64_t c = 0; c < n; ++c) {
            sc[c] = std::exp(sc[c] - mc);
            sum += sc[c];
          }
          l[g] = l[g] * alpha[g] + sum;
          m[g] = mc;
          float* a = acc.data() + g * Dv;
          for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha[g];
        }
        for (int64_t c = 0; c < n; ++c) {
          to_float(vp + (rows[c] * Hkv + hk) * Dv, vf.data(), Dv);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * CHUNK + c];
            float* a = acc.data() + g * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) a[d] += p * vf[d];
          }
        }
        n = 0;
      };
      for (int64_t s = 0; s < S; ++s) {
        if (row_allowed && !row_allowed[s]) continue;
        const int64_t r = ip[b * S + s];
        to_float(kp + (r * Hkv + hk) * D, kf.data(), D);
        for (int64_t g = 0; g < G; ++g) scores[g * CHUNK + n] = dot(qf.data() + g * D, kf.data(), D);
        rows[n++] = r;
        if (n == CHUNK) flush();
      }
      if (n) flush();
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + ((b * Lq + i) * H + hk * G + g) * Dv;
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        for (int64_t d = 0; d < Dv; ++d) o[d] = acc[g * Dv + d] * inv;
      }
    }
  });
}

at::Tensor fixed_chunk_attention(const at::Tensor& q, const at::Tensor& k_src, const at::Tensor& v_src,
                                 const at::Tensor& index, const at::Tensor& allowed, double scale) {
  TORCH_CHECK(q.dim() == 4 && k_src.dim() == 3 && v_src.dim() == 3 && index.dim() == 2,
              "fixed_chunk_attention: q [B, Lq, H, D], k_src [N, Hkv, D], v_src [N, Hkv, Dv], index [B, S]");
  TORCH_CHECK(q.is_contiguous() && k_src.is_contiguous() && v_src.is_contiguous() && index.is_contiguous(),
              "fixed_chunk_attention: inputs must be contiguous");
  TORCH_CHECK(k_src.scalar_type() == q.scalar_type() && v_src.scalar_type() == q.scalar_type(),
              "fixed_chunk_attention: q, k_src and v_src must share a dtype");
  TORCH_CHECK(index.scalar_type() == at::kLong, "fixed_chunk_attention: index must be int64");
  TORCH_CHECK(q.size(2) % k_src.size(1) == 0 && q.size(3) == k_src.size(2) && q.size(0) == index.size(0),
              "fixed_chunk_attention: shapes disagree");
  TORCH_CHECK(allowed.numel() == 0 || (allowed.scalar_type() == at::kBool && allowed.is_contiguous() &&
                                       allowed.dim() == 3 && allowed.size(0) == q.size(0) &&
                                       allowed.size(1) == q.size(1) && allowed.size(2) == index.size(1)),
              "fixed_chunk_attention: allowed must be a contiguous bool [B, Lq, S] (or empty)");
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v_src.size(2)}, q.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "fixed_chunk_attention", [&] {
    attend_kernel<scalar_t>(q, k_src, v_src, index, allowed, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(sgl_kernel_ext_cpu, m) {
  m.def("fixed_chunk_attention(Tensor q, Tensor k_src, Tensor v_src, Tensor index, Tensor allowed, float scale) -> Tensor");
  m.impl("fixed_chunk_attention", c10::DispatchKey::CPU, &fixed_chunk_attention);
}
