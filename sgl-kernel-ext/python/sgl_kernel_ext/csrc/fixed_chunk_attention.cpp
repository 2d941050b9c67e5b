// Batch-invariant attention on the CPU: every query row is reduced over its visible keys in
// fixed chunks of CHUNK visible keys, in key order, with float32 statistics, by
// attention_common.h's arithmetic (8-lane dot products in a fixed tree, online softmax). A row's
// result is a function of (its query, its visible keys and values) only: not of the batch, the
// number of query rows, the padding, the thread count or where the row sits. Decode rows, verify
// rows and prefill rows of the same position therefore agree bitwise.
//
//   q       [B, Lq, H, D]      float32 / bfloat16 / float16, contiguous
//   k_src   [N, Hkv, D]        same dtype as q, contiguous (a KV pool, or an assembled context)
//   v_src   [N, Hkv, Dv]       same dtype
//   index   [B, S] int64       row of k_src / v_src holding request b's key s
//   allowed [B, Lq, S] bool    key s visible to query i (an empty tensor: every key visible)
//   start   [B, Lq] int64      query i's first visible key (a sliding window); keys s < start are not
//                              scanned or read (an empty tensor: 0 for every query)
//   -> out  [B, Lq, H, Dv]     float32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "attention_common.h"

namespace {

using namespace attn;

// One work item = (request b, KV head hk, a block of up to QB query rows). K / V rows are read
// where they are stored (float32), or converted to float32 into the thread's chunk buffer
// (bfloat16 / float16, exact), one chunk of CHUNK visible keys at a time; the chunk is reused by
// the block's next row whose chunk has the same keys (causal rows share all but their last chunk).
// A row whose visible keys are a prefix of the index (decode, causal prefill and verify) needs no
// column list. The (row, query head) pairs over one chunk go two at a time through attend_chunk2
// (each K / V vector loaded once for both; per pair bitwise attend_chunk, the single pair's path).
// Only the row's own keys reach its arithmetic: never the block, the pairing, the reuse or the thread.
constexpr int64_t QB = 16;

// The chunk loop asks for K / V rows PREFETCH_ROWS ahead (prefetch_bytes): without it bfloat16 decode
// attention at batch 16, context 1600 ran 2.2x slower.
constexpr int64_t PREFETCH_ROWS = 8;

struct Scratch {  // per thread, allocated once
  std::vector<float> qf, kbuf, vbuf, zero, s, acc, m, l;
  std::vector<int32_t> cols;  // rows with a non-prefix mask: their visible columns, in order
  std::vector<int64_t> nv, first, chunk_cols, pend, pend_cn;
  std::vector<char> prefix;
  Scratch(int64_t G, int64_t D, int64_t Dv, int64_t S)
      : qf(QB * G * D), kbuf(CHUNK * D), vbuf(CHUNK * Dv), zero(D, 0.f), s(2 * CHUNK), acc(QB * G * Dv), m(QB * G),
        l(QB * G), cols(QB * S), nv(QB), first(QB), chunk_cols(CHUNK), pend(QB * G), pend_cn(QB * G), prefix(QB) {}
};

// Visible columns of one mask row: n, and whether they are exactly [0, n).
inline int64_t scan_row(const bool* row, int64_t S, int32_t* cols, char* is_prefix) {
  int64_t n = 0;
  while (n < S && row[n]) ++n;
  int64_t s = n;
  while (s < S && !row[s]) ++s;
  if (s == S) {
    *is_prefix = 1;
    return n;
  }
  *is_prefix = 0;
  for (int64_t c = 0; c < n; ++c) cols[c] = static_cast<int32_t>(c);
  for (; s < S; ++s)
    if (row[s]) cols[n++] = static_cast<int32_t>(s);
  return n;
}

void attend_kernel(const at::Tensor& q, const at::Tensor& k_src, const at::Tensor& v_src, const at::Tensor& index,
                   const at::Tensor& allowed, const at::Tensor& start, double scale, at::Tensor& out, Elem elem) {
  const int64_t B = q.size(0), Lq = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Hkv = k_src.size(1), Dv = v_src.size(2), S = index.size(1);
  const int64_t G = H / Hkv, NQB = (Lq + QB - 1) / QB;
  const void* qp = q.data_ptr();
  const void* kp = k_src.data_ptr();
  const void* vp = v_src.data_ptr();
  const int64_t* ip = index.data_ptr<int64_t>();
  const bool* ap = allowed.numel() ? allowed.data_ptr<bool>() : nullptr;
  const int64_t* sp = start.numel() ? start.data_ptr<int64_t>() : nullptr;
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv * NQB, 1, [&](int64_t begin, int64_t end) {
    Scratch st(G, D, Dv, ap ? S : 0);
    const float* krow[CHUNK];
    const float* vrow[CHUNK];
    for (int64_t w = begin; w < end; ++w) {
      const int64_t qb = w % NQB, hk = (w / NQB) % Hkv, b = w / (NQB * Hkv);
      const int64_t i0 = qb * QB, nq = std::min(QB, Lq - i0);
      const int64_t* row_index = ip + b * S;
      int64_t max_nv = 0;
      for (int64_t il = 0; il < nq; ++il) {
        // A row's visible keys: columns [f, S) that the mask allows; a prefix row's are [f, f + nv).
        const int64_t f = sp ? std::min(std::max<int64_t>(sp[b * Lq + i0 + il], 0), S) : 0;
        st.first[il] = f;
        if (ap) {
          int32_t* rc = st.cols.data() + il * S;
          st.nv[il] = scan_row(ap + (b * Lq + i0 + il) * S + f, S - f, rc, &st.prefix[il]);
          if (!st.prefix[il])
            for (int64_t c = 0; c < st.nv[il]; ++c) rc[c] += static_cast<int32_t>(f);
        } else {
          st.nv[il] = S - f;
          st.prefix[il] = 1;
        }
        max_nv = std::max(max_nv, st.nv[il]);
        for (int64_t g = 0; g < G; ++g) {
          float* qr = st.qf.data() + (il * G + g) * D;
          const float* src = exact_row(qp, elem, ((b * Lq + i0 + il) * H + hk * G + g) * D, D, qr);
          for (int64_t d = 0; d < D; ++d) qr[d] = src[d] * fscale;
        }
      }
      std::fill(st.acc.begin(), st.acc.begin() + nq * G * Dv, 0.f);
      std::fill(st.m.begin(), st.m.begin() + nq * G, -std::numeric_limits<float>::infinity());
      std::fill(st.l.begin(), st.l.begin() + nq * G, 0.f);
      for (int64_t c0 = 0; c0 < max_nv; c0 += CHUNK) {
        int64_t built = 0;  // keys in krow / vrow, chunk_cols[0, built) their columns
        int64_t npend = 0;  // (row, head) pairs over the built chunk not yet computed, two at a time
        auto state = [&](int64_t r, int64_t slot) {  // slot: which CHUNK floats of score scratch
          return HeadState{st.qf.data() + r * D, st.s.data() + slot * CHUNK, &st.m[r], &st.l[r], st.acc.data() + r * Dv};
        };
        auto flush = [&]() {
          for (int64_t i = 0; i + 1 < npend; i += 2)
            attend_chunk2(state(st.pend[i], 0), state(st.pend[i + 1], 1), krow, vrow, st.pend_cn[i], st.pend_cn[i + 1], D,
                          Dv);
          if (npend % 2) attend_chunk(state(st.pend[npend - 1], 0), krow, vrow, st.pend_cn[npend - 1], D, Dv);
          npend = 0;
        };
        // Rows with the most keys first: a causal block builds each chunk once, the shorter rows'
        // chunks are prefixes of it.
        for (int64_t il = nq - 1; il >= 0; --il) {
          if (st.nv[il] <= c0) continue;
          const int64_t cn = std::min(CHUNK, st.nv[il] - c0);
          const int32_t* rc = st.prefix[il] ? nullptr : st.cols.data() + il * S + c0;
          const int64_t p0 = st.first[il] + c0;  // a prefix row's chunk: columns p0, p0 + 1, ...
          bool covered = cn <= built;
          for (int64_t c = 0; covered && c < cn; ++c) covered = st.chunk_cols[c] == (rc ? rc[c] : p0 + c);
          if (!covered) {
            flush();
            for (int64_t c = 0; c < cn; ++c) {
              const int64_t col = rc ? rc[c] : p0 + c;
              const int64_t r = row_index[col];
              // rows PREFETCH_ROWS ahead (past the chunk's end: the next chunk's, for a prefix row)
              const int64_t ahead = c + PREFETCH_ROWS;
              if (ahead < cn || (!rc && c0 + ahead < st.nv[il])) {
                const int64_t ra = row_index[rc ? rc[ahead] : p0 + ahead], es = elem == F32 ? 4 : 2;
                prefetch_bytes(kp, (ra * Hkv + hk) * D * es, D * es);
                prefetch_bytes(vp, (ra * Hkv + hk) * Dv * es, Dv * es);
              }
              krow[c] = exact_row(kp, elem, (r * Hkv + hk) * D, D, st.kbuf.data() + c * D);
              vrow[c] = exact_row(vp, elem, (r * Hkv + hk) * Dv, Dv, st.vbuf.data() + c * Dv);
              st.chunk_cols[c] = col;
            }
            for (int64_t c = cn; c < CHUNK; ++c) krow[c] = st.zero.data();  // padding lanes: score -inf
            built = cn;
          }
          for (int64_t g = 0; g < G; ++g) {
            st.pend[npend] = il * G + g;
            st.pend_cn[npend++] = cn;
          }
        }
        flush();
      }
      for (int64_t il = 0; il < nq; ++il)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t r = il * G + g;
          float* o = op + ((b * Lq + i0 + il) * H + hk * G + g) * Dv;
          const float inv = st.l[r] > 0.f ? 1.f / st.l[r] : 0.f;
          for (int64_t d = 0; d < Dv; ++d) o[d] = st.acc[r * Dv + d] * inv;
        }
    }
  });
}

at::Tensor fixed_chunk_attention(const at::Tensor& q, const at::Tensor& k_src, const at::Tensor& v_src,
                                 const at::Tensor& index, const at::Tensor& allowed, double scale,
                                 const at::Tensor& start) {
  TORCH_CHECK(q.dim() == 4 && k_src.dim() == 3 && v_src.dim() == 3 && index.dim() == 2,
              "fixed_chunk_attention: q [B, Lq, H, D], k_src [N, Hkv, D], v_src [N, Hkv, Dv], index [B, S]");
  TORCH_CHECK(q.is_contiguous() && k_src.is_contiguous() && v_src.is_contiguous() && index.is_contiguous(),
              "fixed_chunk_attention: inputs must be contiguous");
  TORCH_CHECK(k_src.scalar_type() == q.scalar_type() && v_src.scalar_type() == q.scalar_type(),
              "fixed_chunk_attention: q, k_src and v_src must share a dtype");
  TORCH_CHECK(index.scalar_type() == at::kLong, "fixed_chunk_attention: index must be int64");
  TORCH_CHECK(q.size(2) % k_src.size(1) == 0 && q.size(3) == k_src.size(2) && q.size(0) == index.size(0) &&
                  k_src.size(0) == v_src.size(0) && k_src.size(1) == v_src.size(1),
              "fixed_chunk_attention: shapes disagree");
  TORCH_CHECK(allowed.numel() == 0 || (allowed.scalar_type() == at::kBool && allowed.is_contiguous() &&
                                       allowed.dim() == 3 && allowed.size(0) == q.size(0) &&
                                       allowed.size(1) == q.size(1) && allowed.size(2) == index.size(1)),
              "fixed_chunk_attention: allowed must be a contiguous bool [B, Lq, S] (or empty)");
  TORCH_CHECK(start.numel() == 0 || (start.scalar_type() == at::kLong && start.is_contiguous() && start.dim() == 2 &&
                                     start.size(0) == q.size(0) && start.size(1) == q.size(1)),
              "fixed_chunk_attention: start must be a contiguous int64 [B, Lq] (or empty)");
  Elem elem;
  switch (q.scalar_type()) {
    case at::kFloat: elem = F32; break;
    case at::kBFloat16: elem = BF16; break;
    case at::kHalf: elem = F16; break;
    default: TORCH_CHECK(false, "fixed_chunk_attention: q must be float32, bfloat16 or float16");
  }
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v_src.size(2)}, q.options().dtype(at::kFloat));
  if (out.numel()) attend_kernel(q, k_src, v_src, index, allowed, start, scale, out, elem);
  return out;
}

}  // namespace

TORCH_LIBRARY(sgl_kernel_ext_cpu, m) {
  m.def("fixed_chunk_attention(Tensor q, Tensor k_src, Tensor v_src, Tensor index, Tensor allowed, float scale, "
        "Tensor start) -> Tensor");
  m.impl("fixed_chunk_attention", c10::DispatchKey::CPU, &fixed_chunk_attention);
}
