// Draft-decode attention: rotatekv rows (min-max codes in the rotated basis, the transform back, RoPE on the
// keys), fused in registers under AVX-512 where the layout allows.
#pragma once

#include "dequant_rows.h"
#include "rope_fwht.h"

namespace {

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

}  // namespace
