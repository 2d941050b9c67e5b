// The decoder layer's row-wise CPU ops, each one call instead of a chain of torch ops, computing the
// SAME bits as that chain (references in cpu_rowwise.py): every step rounds where torch's chain
// rounds, and does the IEEE operation torch does (+, -, *, /, sqrt are correctly rounded; float32 ->
// bfloat16 / float16 round to nearest even, as c10's conversions do). The two reductions that are
// not a fixed elementwise formula (RMSNorm's sum, SiLU's exp) are torch's own ops, called from here
// on the same float32 values with the same shape. So a token's values do not depend on the other rows,
// the thread count (threads split rows only) or the instruction set: the loops are plain C++.
//
//   rotary(q, k, cos, sin)        q [T, H, D], k [T, Hkv, D] (last dim contiguous), cos / sin [T, 1, D]
//       -> q * cos + rotate_half(q) * sin, the same for k   (Hugging Face's apply_rotary_pos_emb)
//   silu_and_mul(x)               x [..., 2d] -> (g / (1 + exp(-g))).to(x.dtype) * up, g = gate in float32
//   rms_norm(x, w, eps)           x [..., n] -> w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), the mean as
//                                 torch's CPU mean computes it: torch's float32 sum, then / n
//                                 (Hugging Face's LlamaRMSNorm; out dtype = promote(w, x))
//
// Built with -ffp-contract=off: no multiply-add is fused (torch's chains round between the two).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

constexpr int64_t GRAIN = 16;  // rows per parallel task (decode: one task, no parallel region)

template <typename T>
inline float f32(T v) {
  return static_cast<float>(v);
}

// Rows [T, H, D] of x (strides xs0, xs1; last dim contiguous) rotated into out [T, H, D] contiguous.
// Per element, as torch computes it in x's dtype T: a = T(x * cos), b = T(rotate_half(x) * sin),
// out = T(a + b); rotate_half(x)[i] = -x[i + D/2] for i < D/2, else x[i - D/2] (negation is exact).
template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t rows = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), cs0 = cos.stride(0), ss0 = sin.stride(0);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* c = cp + t * cs0;
      const T* s = sp + t * ss0;
      for (int64_t h = 0; h < heads; ++h) {
        const T* r = xp + t * xs0 + h * xs1;
        T* o = op + (t * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float rot = i < half ? -f32(r[i + half]) : f32(r[i - half]);
          const T a = static_cast<T>(f32(r[i]) * f32(c[i]));
          const T b = static_cast<T>(rot * f32(s[i]));
          o[i] = static_cast<T>(f32(a) + f32(b));
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                          const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary: q [T, H, D], k [T, Hkv, D] with D even");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary: q and k need a contiguous last dim");
  const int64_t rows = q.size(0), d = q.size(2);
  TORCH_CHECK(cos.dim() == 3 && sin.dim() == 3 && cos.size(0) == rows && cos.size(1) == 1 && cos.size(2) == d &&
                  sin.sizes() == cos.sizes() && cos.stride(2) == 1 && sin.stride(2) == 1,
              "rotary: cos / sin [T, 1, D] with a contiguous last dim");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(k.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype,
              "rotary: q, k, cos and sin must share one dtype");
  at::Tensor qo = at::empty(q.sizes(), q.options());
  at::Tensor ko = at::empty(k.sizes(), k.options());
  switch (dtype) {
    case at::kFloat: rotate<float>(q, cos, sin, qo), rotate<float>(k, cos, sin, ko); break;
    case at::kBFloat16: rotate<c10::BFloat16>(q, cos, sin, qo), rotate<c10::BFloat16>(k, cos, sin, ko); break;
    case at::kHalf: rotate<c10::Half>(q, cos, sin, qo), rotate<c10::Half>(k, cos, sin, ko); break;
    default: TORCH_CHECK(false, "rotary: float32, bfloat16 or float16 only");
  }
  return {qo, ko};
}

// silu(gate) * up with silu in float32 as g / (1 + exp(-g)), rounded to T, times up in T.
template <typename T>
void silu_mul_rows(const T* x, const float* e, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = x + r * 2 * d;
      const T* u = g + d;
      const float* er = e + r * d;
      T* o = out + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const T s = static_cast<T>(f32(g[j]) / (1.0f + er[j]));
        o[j] = static_cast<T>(f32(s) * f32(u[j]));
      }
    }
  });
}

template <typename T>
void neg_gate(const T* x, float* e, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < d; ++j) e[r * d + j] = -f32(x[r * 2 * d + j]);
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "silu_and_mul: x [..., 2d]");
  const at::Tensor x = x_in.contiguous();
  const int64_t d = x.size(-1) / 2, rows = d ? x.numel() / (2 * d) : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = d;
  at::Tensor out = at::empty(shape, x.options());
  if (out.numel() == 0) return out;
  // exp(-g) by torch's own exp (its kernel, on a contiguous float32 [rows, d] as torch.exp(-g) gets)
  at::Tensor e = at::empty({rows, d}, x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat: neg_gate(x.data_ptr<float>(), e.data_ptr<float>(), rows, d); break;
    case at::kBFloat16: neg_gate(x.data_ptr<c10::BFloat16>(), e.data_ptr<float>(), rows, d); break;
    case at::kHalf: neg_gate(x.data_ptr<c10::Half>(), e.data_ptr<float>(), rows, d); break;
    default: TORCH_CHECK(false, "silu_and_mul: float32, bfloat16 or float16 only");
  }
  e.exp_();
  switch (x.scalar_type()) {
    case at::kFloat: silu_mul_rows(x.data_ptr<float>(), e.data_ptr<float>(), out.data_ptr<float>(), rows, d); break;
    case at::kBFloat16:
      silu_mul_rows(x.data_ptr<c10::BFloat16>(), e.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), rows, d);
      break;
    default: silu_mul_rows(x.data_ptr<c10::Half>(), e.data_ptr<float>(), out.data_ptr<c10::Half>(), rows, d); break;
  }
  return out;
}

// h = x in float32 (the source when x is float32 itself: h == x then), sq = h * h.
template <typename T>
void square_rows(const T* x, float* h, float* sq, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * n; i < r1 * n; ++i) {
      const float v = f32(x[i]);
      if constexpr (!std::is_same_v<T, float>) h[i] = v;
      sq[i] = v * v;
    }
  });
}

// out = O(w * I(h * r)), r = 1 / sqrt(sum / n + eps) per row; h = x in float32, I = x's dtype, O = the promoted dtype.
template <typename I, typename W, typename O>
void norm_rows(const float* h, const float* sum, const W* w, O* out, float eps, int64_t rows, int64_t n) {
  const float fn = static_cast<float>(n);
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float inv = 1.0f / std::sqrt(sum[r] / fn + eps);
      const float* hr = h + r * n;
      O* o = out + r * n;
      for (int64_t j = 0; j < n; ++j) {
        const I hc = static_cast<I>(hr[j] * inv);
        o[j] = static_cast<O>(f32(w[j]) * f32(hc));
      }
    }
  });
}

template <typename I, typename W>
void norm_out(const float* h, const float* sum, const at::Tensor& w, at::Tensor& out, float eps, int64_t rows,
              int64_t n) {
  const W* wp = w.data_ptr<W>();
  switch (out.scalar_type()) {
    case at::kFloat: norm_rows<I, W, float>(h, sum, wp, out.data_ptr<float>(), eps, rows, n); break;
    case at::kBFloat16: norm_rows<I, W, c10::BFloat16>(h, sum, wp, out.data_ptr<c10::BFloat16>(), eps, rows, n); break;
    default: norm_rows<I, W, c10::Half>(h, sum, wp, out.data_ptr<c10::Half>(), eps, rows, n); break;
  }
}

template <typename I>
void norm_weight(const float* h, const float* sum, const at::Tensor& w, at::Tensor& out, float eps, int64_t rows,
                 int64_t n) {
  switch (w.scalar_type()) {
    case at::kFloat: norm_out<I, float>(h, sum, w, out, eps, rows, n); break;
    case at::kBFloat16: norm_out<I, c10::BFloat16>(h, sum, w, out, eps, rows, n); break;
    default: norm_out<I, c10::Half>(h, sum, w, out, eps, rows, n); break;
  }
}

inline bool supported(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1),
              "rms_norm: x [..., n], weight [n]");
  TORCH_CHECK(supported(x.scalar_type()) && supported(weight.scalar_type()),
              "rms_norm: float32, bfloat16 or float16 only");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  const at::ScalarType out_type = at::promote_types(weight.scalar_type(), x.scalar_type());
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(out_type));
  if (out.numel() == 0) return out;
  // h = x in float32 (exact), h^2 (torch's pow(h, 2) is h * h), then torch's own float32 sum over rows of n
  // (the reduction mean(-1) runs: its order is torch's), divided by n as mean's div_ does (in norm_rows)
  const at::Tensor xc = x.contiguous();
  const at::Tensor h = x.scalar_type() == at::kFloat ? xc : at::empty({rows, n}, x.options().dtype(at::kFloat));
  at::Tensor sq = at::empty({rows, n}, x.options().dtype(at::kFloat));
  switch (x.scalar_type()) {
    case at::kFloat: square_rows(xc.data_ptr<float>(), h.data_ptr<float>(), sq.data_ptr<float>(), rows, n); break;
    case at::kBFloat16:
      square_rows(xc.data_ptr<c10::BFloat16>(), h.data_ptr<float>(), sq.data_ptr<float>(), rows, n);
      break;
    default: square_rows(xc.data_ptr<c10::Half>(), h.data_ptr<float>(), sq.data_ptr<float>(), rows, n); break;
  }
  const at::Tensor sums = at::sum(sq, {1}, true);
  const at::Tensor w = weight.contiguous();
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat: norm_weight<float>(h.data_ptr<float>(), sums.data_ptr<float>(), w, out, e, rows, n); break;
    case at::kBFloat16:
      norm_weight<c10::BFloat16>(h.data_ptr<float>(), sums.data_ptr<float>(), w, out, e, rows, n);
      break;
    default: norm_weight<c10::Half>(h.data_ptr<float>(), sums.data_ptr<float>(), w, out, e, rows, n); break;
  }
  return out;
}

#include "llama_layer.h"

}  // namespace

TORCH_LIBRARY(sgl_kernel_ext_rowwise, m) {
  m.def("llama_attn_in(Tensor hidden, Tensor norm_w, float eps, Tensor qkv_packed, Tensor qkv_bias, int heads, "
        "int kv_heads, int head_dim, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor, Tensor)");
  m.impl("llama_attn_in", c10::DispatchKey::CPU, &llama_attn_in);
  m.def("llama_mlp_block(Tensor hidden, Tensor attn, Tensor o_packed, Tensor o_bias, Tensor norm_w, float eps, "
        "Tensor gate_up_packed, Tensor gate_up_bias, int n_gate_up, Tensor down_packed, Tensor down_bias) -> Tensor");
  m.impl("llama_mlp_block", c10::DispatchKey::CPU, &llama_mlp_block);
  m.def("llama_decode_layer(Tensor hidden, Tensor n1_w, float eps1, Tensor qkv_packed, Tensor qkv_bias, int heads, "
        "int kv_heads, int head_dim, Tensor cos, Tensor sin, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc, "
        "Tensor index, Tensor allowed, Tensor start, float scale, Tensor o_packed, Tensor o_bias, Tensor n2_w, "
        "float eps2, Tensor gate_up_packed, Tensor gate_up_bias, int n_gate_up, Tensor down_packed, "
        "Tensor down_bias) -> Tensor");
  m.impl("llama_decode_layer", c10::DispatchKey::CPU, &llama_decode_layer);
  m.def("llama_decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, float[] eps, "
        "Tensor(a!)[] k_bufs, Tensor(b!)[] v_bufs, int heads, int kv_heads, int head_dim, int n_gate_up, "
        "float scale, Tensor loc, Tensor index, Tensor allowed, Tensor start) -> Tensor");
  m.impl("llama_decode_layers", c10::DispatchKey::CPU, &llama_decode_layers);
  m.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
}
