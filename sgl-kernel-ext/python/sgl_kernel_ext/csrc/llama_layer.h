// A Llama decoder layer on the CPU in one or two calls, for a decode step's host overhead: the same ops
// as the module chain (rowwise.cpp's rms_norm / rotary / silu_and_mul, sgl_kernel_ext_linear::packed_linear
// and sgl_kernel_ext_cpu::fixed_chunk_attention through the dispatcher, at::add for the residuals), so
// the same bits, in one call instead of ~40 Python-level ones.
//
// Included by rowwise.cpp inside its anonymous namespace, after the row-wise ops.
//
//   llama_attn_in      input_layernorm, qkv_proj, split, RoPE              (before attention)
//   llama_mlp_block    o_proj + residual, post_attention_layernorm, MLP + residual  (after it)
//   llama_decode_layer both, around the KV write (the pool's slots `loc`) and the batch-invariant
//                      attention over the pool in place: a whole layer of a DECODE step (one query per request)
//   llama_decode_layers llama_decode_layer over all of a model's layers in one call

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t n) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("sgl_kernel_ext_linear::packed_linear", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                               at::ScalarType)>();
  return op.call(x, packed, bias, n, x.scalar_type());
}

// hidden [T, hidden] -> (q [T, H, D] and k [T, Hkv, D] rotated, v [T, Hkv, D] a view, the normed hidden):
// input_layernorm, qkv_proj, split, apply_rotary_pos_emb.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> llama_attn_in(
    const at::Tensor& hidden, const at::Tensor& norm_w, double eps, const at::Tensor& qkv_packed,
    const at::Tensor& qkv_bias, int64_t heads, int64_t kv_heads, int64_t head_dim, const at::Tensor& cos,
    const at::Tensor& sin) {
  TORCH_CHECK(hidden.dim() == 2, "llama_attn_in: hidden [T, hidden]");
  const int64_t qs = heads * head_dim, kvs = kv_heads * head_dim, rows = hidden.size(0);
  at::Tensor normed = rms_norm(hidden, norm_w, eps);
  const at::Tensor qkv = linear(normed, qkv_packed, qkv_bias, qs + 2 * kvs);
  const at::Tensor q = qkv.narrow(1, 0, qs).view({rows, heads, head_dim});
  const at::Tensor k = qkv.narrow(1, qs, kvs).view({rows, kv_heads, head_dim});
  at::Tensor v = qkv.narrow(1, qs + kvs, kvs).view({rows, kv_heads, head_dim});
  auto [qr, kr] = rotary(q, k, cos, sin);
  return {qr, kr, v, normed};
}

// hidden + o_proj(attn) -> h; h + down_proj(silu_and_mul(gate_up_proj(post_attention_layernorm(h)))).
at::Tensor llama_mlp_block(const at::Tensor& hidden, const at::Tensor& attn, const at::Tensor& o_packed,
                           const at::Tensor& o_bias, const at::Tensor& norm_w, double eps,
                           const at::Tensor& gate_up_packed, const at::Tensor& gate_up_bias, int64_t n_gate_up,
                           const at::Tensor& down_packed, const at::Tensor& down_bias) {
  const int64_t n = hidden.size(-1);
  const at::Tensor h = hidden + linear(attn, o_packed, o_bias, n);
  const at::Tensor act = silu_and_mul(linear(rms_norm(h, norm_w, eps), gate_up_packed, gate_up_bias, n_gate_up));
  return h + linear(act, down_packed, down_bias, n);
}

// pool[loc[t]] = src[t] for the T rows of src [T, Hkv, D] (last dim contiguous): the pool's
// set_kv_buffer (an index_copy_), a copy of the same bytes.
void write_rows(const at::Tensor& pool, const at::Tensor& loc, const at::Tensor& src) {
  const int64_t rows = src.size(0), heads = src.size(1), d = src.size(2), slots = pool.size(0);
  const int64_t es = src.element_size();
  const int64_t* lp = loc.data_ptr<int64_t>();
  char* dst = static_cast<char*>(pool.data_ptr());
  const char* sp = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "llama_decode_layer: slot ", lp[t], " outside the pool's ", slots);
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + ((lp[t] * heads + h) * d) * es, sp + (t * src.stride(0) + h * src.stride(1)) * es, d * es);
  }
}

// A DECODE step's layer for T requests of one new token each: llama_attn_in; k, v written to the pool
// k_buf / v_buf [slots, Hkv, D] at loc [T]; fixed_chunk_attention of each request's query over its keys
// index [T, S] (allowed [T, 1, S] or empty, start [T, 1] or empty, as the torch backend passes them),
// rounded to the hidden dtype; llama_mlp_block. -> the layer's output hidden [T, hidden].
at::Tensor llama_decode_layer(const at::Tensor& hidden, const at::Tensor& n1_w, double eps1,
                              const at::Tensor& qkv_packed, const at::Tensor& qkv_bias, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& loc,
                              const at::Tensor& index, const at::Tensor& allowed, const at::Tensor& start,
                              double scale, const at::Tensor& o_packed, const at::Tensor& o_bias,
                              const at::Tensor& n2_w, double eps2, const at::Tensor& gate_up_packed,
                              const at::Tensor& gate_up_bias, int64_t n_gate_up, const at::Tensor& down_packed,
                              const at::Tensor& down_bias) {
  static const auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("sgl_kernel_ext_cpu::fixed_chunk_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, double, const at::Tensor&)>();
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(k_buf.dim() == 3 && v_buf.dim() == 3 && k_buf.is_contiguous() && v_buf.is_contiguous() &&
                  k_buf.size(1) == kv_heads && k_buf.size(2) == head_dim && v_buf.size(1) == kv_heads &&
                  v_buf.size(2) == head_dim && v_buf.size(0) == k_buf.size(0),
              "llama_decode_layer: k_buf / v_buf contiguous [slots, kv_heads, head_dim]");
  TORCH_CHECK(k_buf.scalar_type() == hidden.scalar_type() && v_buf.scalar_type() == hidden.scalar_type(),
              "llama_decode_layer: the KV pool must be in the hidden states' dtype");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.size(0) == rows && loc.is_contiguous(),
              "llama_decode_layer: loc int64 [T]");
  TORCH_CHECK(index.dim() == 2 && index.size(0) == rows, "llama_decode_layer: index [T, S], one query per request");
  auto [q, k, v, normed] = llama_attn_in(hidden, n1_w, eps1, qkv_packed, qkv_bias, heads, kv_heads, head_dim, cos, sin);
  write_rows(k_buf, loc, k);
  write_rows(v_buf, loc, v);
  const at::Tensor att = attend.call(q.view({rows, 1, heads, head_dim}), k_buf, v_buf, index, allowed, scale, start);
  const at::Tensor attn = att.to(hidden.scalar_type()).view({rows, heads * head_dim});
  return llama_mlp_block(hidden, attn, o_packed, o_bias, n2_w, eps2, gate_up_packed, gate_up_bias, n_gate_up,
                         down_packed, down_bias);
}

// llama_decode_layer over a model's layers in order (no Python between them): weights holds 10 tensors
// per layer (n1_w, qkv_packed, qkv_bias, o_packed, o_bias, n2_w, gate_up_packed, gate_up_bias,
// down_packed, down_bias), eps 2 per layer (input / post-attention norm), k_bufs / v_bufs 1 each;
// the shapes, the scale and the step's operands (loc, index, allowed, start) are the same for every layer.
at::Tensor llama_decode_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                               at::TensorList weights, at::ArrayRef<double> eps, at::TensorList k_bufs,
                               at::TensorList v_bufs, int64_t heads, int64_t kv_heads, int64_t head_dim,
                               int64_t n_gate_up, double scale, const at::Tensor& loc, const at::Tensor& index,
                               const at::Tensor& allowed, const at::Tensor& start) {
  const size_t layers = k_bufs.size();
  TORCH_CHECK(weights.size() == 10 * layers && eps.size() == 2 * layers && v_bufs.size() == layers,
              "llama_decode_layers: 10 weights, 2 eps, one k_buf and one v_buf per layer");
  at::Tensor h = hidden;
  for (size_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 10 * l;
    h = llama_decode_layer(h, w[0], eps[2 * l], w[1], w[2], heads, kv_heads, head_dim, cos, sin, k_bufs[l], v_bufs[l],
                           loc, index, allowed, start, scale, w[3], w[4], w[5], eps[2 * l + 1], w[6], w[7], n_gate_up,
                           w[8], w[9]);
  }
  return h;
}
