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
//   comp        kind 0 token_drop: [k, v] rows [NC, R, Hkv, D] (float32 / bfloat16 / float16), or [k, v, head]
//                 with head-adaptive budgets: head [NC, R, Hkv] int8 names the KV head of each cell's token (KV
//                 head h attends to its cells in storage order: chunk, row, column)
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
//
// One translation unit: this file checks the arguments and runs the work items; the kernel is in draft/, one
// header a concern, each including what it uses:
//   common.h            kinds, DRAFT_AVX512, rounding to bfloat16 / float16, the call's state (Part, Compressed,
//                       Shape, Scratch)
//   dequant_rows.h      int8, fp8, kivi and min-max rows
//   rope_fwht.h         RoPE on a pre-RoPE key row, rotatekv's Walsh-Hadamard transform
//   kvquant_rows.h      kvquant rows one at a time (levels, exact outliers, RoPE)
//   avx512_paths.h      the AVX-512 paths below, or stand-ins that never apply:
//     kvquant_segments.h  kvquant rows a segment at a time
//     kvquant_scores.h    kvquant keys scored from their codes (the key-score path)
//     value_sums.h        values summed from their codes; the kvquant key-score path's softmax chunk
//     rotatekv_scores.h   rotatekv's key-score path
//     kivi_scores.h       kivi's key-score path
//   rotatekv_rows.h     rotatekv rows (fused in registers under AVX-512)
//   attend.h            prefetches, one compressed row, the attend loop (attend_item)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "draft/attend.h"  // and through it every header of draft/

namespace {

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
  const bool tagged = kind == TOKEN_DROP && comp.size() == 3;
  TORCH_CHECK(kind >= TOKEN_DROP && kind <= ROTATEKV && (comp.size() == want_of[kind] || tagged),
              "draft_decode_attention: kind 0-5 with 2 (or 3), 4, 4, 6, 17 or 11 compressed tensors");
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
    if (tagged) {
      const at::Tensor& hd = comp[2];
      TORCH_CHECK(hd.scalar_type() == at::kChar && hd.dim() == 3 && hd.size(0) == nc && hd.size(1) == R &&
                      hd.size(2) == sh.Hkv,
                  "draft_decode_attention: token-drop head tags must be int8 [NC, R, Hkv]");
      cp.head = hd.data_ptr<int8_t>();
    }
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
