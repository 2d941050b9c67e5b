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
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t CHUNK = 64;
constexpr int64_t VW = 8;  // floats per vector (GCC vector extension: AVX, SSE or scalar code alike)
typedef float vfloat __attribute__((vector_size(VW * sizeof(float))));

inline vfloat vload(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void vstore(float* p, vfloat v) { std::memcpy(p, &v, sizeof(v)); }

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// exp for x <= 0 (a score minus its row's max), Cephes' expf polynomial (about 1 ulp) in plain float
// arithmetic, so the compiler vectorizes it and every lane computes the same function.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : y * scale;
}

// One work item = (request b, KV head hk, a block of up to QB query rows). A row's keys are taken
// CHUNK visible keys at a time; the chunk's K is converted to float and stored transposed
// ([D][CHUNK]) and its V as [CHUNK][Dv], and reused by the next row whose chunk has the same keys
// (causal rows share all but their last chunk). Per (row, head): scores s[c] = sum_d q[d] k[d][c]
// summed over d in order (vectorized across keys, no horizontal sums), then the chunk is folded
// into the row's running max / sum / output (online softmax, float32). Nothing in a row's
// arithmetic depends on the block, the reuse or the thread: only on its own keys.
constexpr int64_t QB = 16;

template <typename T>
void attend_kernel(const at::Tensor& q, const at::Tensor& k_src, const at::Tensor& v_src,
                   const at::Tensor& index, const at::Tensor& allowed, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), Lq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Hkv = k_src.size(1), Dv = v_src.size(2), S = index.size(1);
  const int64_t G = H / Hkv, NQB = (Lq + QB - 1) / QB;
  const T* qp = q.data_ptr<T>();
  const T* kp = k_src.data_ptr<T>();
  const T* vp = v_src.data_ptr<T>();
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* ap = allowed.numel() ? allowed.data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, B * Hkv * NQB, 1, [&](int64_t begin, int64_t end) {
    const int64_t R = QB * G;  // (query row, head) pairs of a block
    std::vector<float> qf(R * D), kt(D * CHUNK), vc(CHUNK * Dv), acc(R * Dv), sc(CHUNK), m(R), l(R);
    std::vector<int32_t> cols(QB * S);  // each row's visible columns, in order
    std::vector<int64_t> nv(QB), chunk_cols(CHUNK);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t qb = w % NQB, hk = (w / NQB) % Hkv, b = w / (NQB * Hkv);
      const int64_t i0 = qb * QB, nq = std::min(QB, Lq - i0);
      int64_t max_nv = 0;
      for (int64_t il = 0; il < nq; ++il) {
        const bool* row_allowed = ap ? ap + (b * Lq + i0 + il) * S : nullptr;
        int32_t* rc = cols.data() + il * S;
        int64_t n = 0;
        for (int64_t s = 0; s < S; ++s)
          if (!row_allowed || row_allowed[s]) rc[n++] = static_cast<int32_t>(s);
        nv[il] = n;
        max_nv = std::max(max_nv, n);
        for (int64_t g = 0; g < G; ++g) {
          float* qr = qf.data() + (il * G + g) * D;
          to_float(qp + ((b * Lq + i0 + il) * H + hk * G + g) * D, qr, D);
          for (int64_t d = 0; d < D; ++d) qr[d] *= fscale;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      int64_t built = 0;  // keys in the chunk buffers, chunk_cols[0, built) their columns
      for (int64_t c0 = 0; c0 < max_nv; c0 += CHUNK) {
        // Rows with the most keys first: a causal block builds each chunk once, the shorter rows'
        // chunks are prefixes of it.
        for (int64_t il = nq - 1; il >= 0; --il) {
          if (nv[il] <= c0) continue;
          const int32_t* rc = cols.data() + il * S + c0;
          const int64_t cn = std::min(CHUNK, nv[il] - c0);
          bool covered = cn <= built;
          for (int64_t c = 0; covered && c < cn; ++c) covered = chunk_cols[c] == rc[c];
          if (!covered) {
            for (int64_t c = 0; c < cn; ++c) {
              const int64_t r = ip[b * S + rc[c]];
              const T* kr = kp + (r * Hkv + hk) * D;
              for (int64_t d = 0; d < D; ++d) kt[d * CHUNK + c] = static_cast<float>(kr[d]);
              to_float(vp + (r * Hkv + hk) * Dv, vc.data() + c * Dv, Dv);
              chunk_cols[c] = rc[c];
            }
            for (int64_t c = cn; c < CHUNK; ++c)  // unused lanes: finite, never read back
              for (int64_t d = 0; d < D; ++d) kt[d * CHUNK + c] = 0.f;
            built = cn;
          }
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = il * G + g;
            float* s = sc.data();
            const float* qr = qf.data() + r * D;
            {  // s[c] = sum over d in order of q[d] * k[d][c]: 64 accumulators in 8 registers
              vfloat s_acc[CHUNK / VW] = {};
              for (int64_t d = 0; d < D; ++d) {
                const vfloat qd = vfloat{} + qr[d];
                const float* kd = kt.data() + d * CHUNK;
                for (int64_t j = 0; j < CHUNK / VW; ++j) s_acc[j] += qd * vload(kd + j * VW);
              }
              for (int64_t j = 0; j < CHUNK / VW; ++j) vstore(s + j * VW, s_acc[j]);
            }
            float mc = m[r];
            for (int64_t c = 0; c < cn; ++c) mc = std::max(mc, s[c]);
            const float alpha = std::exp(m[r] - mc);  // exp(-inf) = 0 on the first chunk
#pragma omp simd
            for (int64_t c = 0; c < CHUNK; ++c) s[c] = exp_nonpositive(s[c] - mc);
            float sum = 0.f;
            for (int64_t c = 0; c < cn; ++c) sum += s[c];
            l[r] = l[r] * alpha + sum;
            m[r] = mc;
            float* a = acc.data() + r * Dv;
            for (int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
            if (Dv == 64) {  // the common head size: the output row in 8 registers across the chunk
              vfloat a_acc[64 / VW];
              for (int64_t j = 0; j < 64 / VW; ++j) a_acc[j] = vload(a + j * VW);
              for (int64_t c = 0; c < cn; ++c) {
                const vfloat p = vfloat{} + s[c];
                const float* vr = vc.data() + c * 64;
                for (int64_t j = 0; j < 64 / VW; ++j) a_acc[j] += p * vload(vr + j * VW);
              }
              for (int64_t j = 0; j < 64 / VW; ++j) vstore(a + j * VW, a_acc[j]);
            } else {
              for (int64_t c = 0; c < cn; ++c) {
                const float p = s[c];
                const float* vr = vc.data() + c * Dv;
                for (int64_t d = 0; d < Dv; ++d) a[d] += p * vr[d];
              }
            }
          }
        }
      }
      for (int64_t il = 0; il < nq; ++il)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = il * G + g;
          float* o = op + ((b * Lq + i0 + il) * H + hk * G + g) * Dv;
          const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
          for (int64_t d = 0; d < Dv; ++d) o[d] = acc[r * Dv + d] * inv;
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
