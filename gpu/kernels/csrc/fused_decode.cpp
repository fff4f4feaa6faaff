// A whole decode step of a dense Llama-family model in one call: for every layer RMSNorm, the
// fused q/k/v product, RoPE, the K/V write into the paged cache, paged attention, o-proj +
// residual, RMSNorm, gate/up, SiLU * up, down (+ residual at the next layer), then the final norm.
// The per-op path (gpu/models/model.py with gpu/quantization/quant_linear.py) is its plain reference and
// computes the same values with the same kernels; here the ~20 torch ops a layer (each paying
// Python, dispatch and allocation, which at batch 1 added up to more than the products) become
// loops over small fp32 buffers. Threads: the products split rows, the attention splits sequences and KV
// heads (at::parallel_for, OpenMP: the extension is built with -fopenmp, cpu_kernel.py); the norms,
// RoPE, SiLU and residual adds split over tokens from 16 up.
//
// Every token is a sequence of its own in its decode step (query length 1). Weights, per layer:
//   weights[10 l + 0..9] = input_norm, qkv, qkv_scale, o, o_scale, post_norm, gate_up, gate_up_scale,
//                          down, down_scale; weights[10 L] = the final norm
//   formats[8 l + 0..7]  = (format id, group) of qkv, o, gate_up, down
//   packed[4 l + 0..3]   = qkv, o, gate_up, down in the 8-row packed layout (quant_packed.h), or
//                          empty: the int8 products read it where present (Q4_0, Q4_1)
// A product takes the integer path (quant_q8.h) when `q8` is set and its format has one, else the
// fp32-activation path (quant_blocks.h): the reference path makes the same choice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "fused_attention.h"
#include "paged_attention.h"
#include "quant_blocks.h"
#include "quant_packed.h"
#include "quant_q8.h"

namespace {

using namespace twinserve_quant;

struct Linear {
  const uint8_t* data;
  const float* scale;   // nullptr: no row scale
  const uint8_t* packed;  // nullptr: not packed
  int64_t rows, fmt, group;
};

struct Layer {
  const float* input_norm;
  const float* post_norm;
  Linear qkv, o, gate_up, down;
};

struct Dims {
  int64_t tokens, hidden, heads, kv_heads, head_dim, inter;
};

Linear linear_at(const std::vector<at::Tensor>& w, const std::vector<int64_t>& f, const at::Tensor& packed,
                 size_t wi, size_t fi, int64_t in_features) {
  const at::Tensor& data = w[wi];
  const at::Tensor& scale = w[wi + 1];
  const int64_t fmt = f[fi], group = f[fi + 1];
  TORCH_CHECK(data.is_contiguous() && data.dim() == 2 && data.element_size() == 1,
              "fused_decode_step: weight ", wi, " must be a contiguous 2-d byte tensor");
  dispatch(fmt, group, [&](auto fmt_tag) {
    TORCH_CHECK(data.size(1) == row_bytes_of<decltype(fmt_tag)>(in_features), "fused_decode_step: weight ",
                wi, " does not have ", in_features, " inputs");
  });
  TORCH_CHECK(scale.numel() == 0 || (scale.scalar_type() == at::kFloat && scale.numel() == data.size(0)),
              "fused_decode_step: row scale ", wi + 1, " must be fp32 [rows] or empty");
  if (packed.numel()) {
    TORCH_CHECK(packable(fmt) && packed.is_contiguous() && packed.dim() == 2 && packed.element_size() == 1 &&
                    packed.size(0) == packed_groups(data.size(0)) && packed.size(1) == data.size(1) * kGroupRows,
                "fused_decode_step: the packed copy of weight ", wi, " does not match it");
  }
  return {static_cast<const uint8_t*>(data.data_ptr()), scale.numel() ? scale.data_ptr<float>() : nullptr,
          packed.numel() ? static_cast<const uint8_t*>(packed.data_ptr()) : nullptr, data.size(0), fmt, group};
}

const float* vector_at(const at::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == n, "fused_decode_step: ",
              what, " must be fp32 [", n, "]");
  return t.data_ptr<float>();
}

// Per-token work of a step (norms, RoPE, SiLU, residual adds, quantizing activations) split over
// tokens where there are enough of them to pay a parallel region (at batch 64, run on one thread
// while the other waited, they were a tenth of the step's CPU time); one token runs inline.
constexpr int64_t kTokenGrain = 8;

template <typename Fn>
void per_token(int64_t tokens, Fn&& fn) {
  if (tokens < 2 * kTokenGrain) {
    for (int64_t t = 0; t < tokens; ++t) fn(t);
    return;
  }
  at::parallel_for(0, tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(t);
  });
}

// out[t] = w * x[t] / rms(x[t]) (HF's RMSNorm in fp32).
void rms_norm(const float* x, const float* w, int64_t tokens, int64_t n, float eps, float* out) {
  per_token(tokens, [&](int64_t t) {
    const float* __restrict xt = x + t * n;
    float* __restrict ot = out + t * n;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) ss += xt[i] * xt[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i) ot[i] = w[i] * (xt[i] * r);
  });
}

// The scratch one step's products reuse: the quantized activations, where a product has them.
struct Product {
  bool q8;
  std::vector<XBlock> xq;

  void operator()(const float* x, int64_t tokens, int64_t k, const Linear& w, float* out) {
    if (q8 && has_q8_dot(w.fmt)) {
      xq.resize(tokens * k / 32);
      XBlock* q = xq.data();
      per_token(tokens, [&](int64_t t) { quantize_row_q8(x + t * k, k, q + t * (k / 32)); });
      if (w.packed) matmul_q8_packed(xq.data(), tokens, k, w.packed, w.rows, out, w.fmt);
      else matmul_q8(xq.data(), tokens, k, w.data, w.rows, out, w.fmt);
    } else {
      matmul_f32(x, tokens, k, w.data, w.scale, w.rows, out, w.fmt, w.group);
    }
  }
};

// Rotates the first `heads` heads of each token's row (HF rotate_half layout).
void rope(float* qkv, int64_t tokens, int64_t row, int64_t heads, int64_t d, const float* cos,
          const float* sin, const int64_t* positions) {
  const int64_t half = d / 2;
  per_token(tokens, [&](int64_t t) {
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* x = qkv + t * row + h * d;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  });
}

struct Attention {
  const at::Tensor& key_cache;
  const at::Tensor& value_cache;
  const int32_t* tables;
  const int32_t* lens;
  const int64_t* slots;
  int64_t max_blocks;
  float scale;
  bool fast;  // attend_f32 (fused_attention.h; head_dim % 8 == 0), else the reference attend()
};

// K and V of each token into the cache, then each token's query over its sequence's context.
void attention(const float* qkv, const Dims& dm, const Attention& a, float* out) {
  const int64_t row = (dm.heads + 2 * dm.kv_heads) * dm.head_dim, kv = dm.kv_heads * dm.head_dim;
  float* kc = a.key_cache.data_ptr<float>();
  float* vc = a.value_cache.data_ptr<float>();
  for (int64_t t = 0; t < dm.tokens; ++t) {
    const float* k = qkv + t * row + dm.heads * dm.head_dim;
    std::memcpy(kc + a.slots[t] * kv, k, kv * sizeof(float));
    std::memcpy(vc + a.slots[t] * kv, k + kv, kv * sizeof(float));
  }
  const twinserve_attention::Shape s{dm.heads, dm.kv_heads, dm.head_dim, a.key_cache.size(1), a.max_blocks};
  // One token: one thread walks its context for every head (sharing its KV heads out to the
  // threads, each reading only its heads' columns, was slower; docs/quantization.md).
  const int64_t split = dm.tokens >= 4 * at::get_num_threads() || dm.tokens == 1 ? 1 : dm.kv_heads;
  const int64_t per = dm.kv_heads / split, q_row = dm.heads * dm.head_dim;
  at::parallel_for(0, dm.tokens * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / split, h0 = (item % split) * per;
      if (a.fast)
        twinserve_attention::attend_f32(qkv + t * row, kc, vc, a.tables + t * a.max_blocks, a.lens[t], s, h0,
                                        h0 + per, a.scale, out + t * q_row, scratch);
      else
        twinserve_attention::attend<float>(qkv + t * row, kc, vc, a.tables + t * a.max_blocks, a.lens[t], 0, s,
                                           h0, h0 + per, a.scale, 0.f, out + t * q_row, scratch);
    }
  });
}

// out[i] = silu(g[i]) * g[n + i] (gate, then up, in one row): the exp by exp256 (scalar std::exp
// was a visible share of a many-token step; docs/quantization.md).
void silu_mul(const float* g, int64_t n, float* out) {
  int64_t i = 0;
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = twinserve_attention::exp256(_mm256_sub_ps(zero, x));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(g + n + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * g[n + i];
}

// residual[t] += delta[t]
void add_rows(float* residual, const float* delta, int64_t tokens, int64_t n) {
  per_token(tokens, [&](int64_t t) {
    float* __restrict r = residual + t * n;
    const float* __restrict d = delta + t * n;
    for (int64_t i = 0; i < n; ++i) r[i] += d[i];
  });
}

void layer_step(const Layer& ly, const Dims& dm, float eps, const Attention& attn, const float* cos,
                const float* sin, const int64_t* positions, Product& product, float* residual,
                float* hidden) {
  const int64_t t = dm.tokens, h = dm.hidden, row = (dm.heads + 2 * dm.kv_heads) * dm.head_dim;
  std::vector<float> x(t * h), qkv(t * row), att(t * dm.heads * dm.head_dim), gu(t * 2 * dm.inter),
      act(t * dm.inter);
  rms_norm(residual, ly.input_norm, t, h, eps, x.data());
  product(x.data(), t, h, ly.qkv, qkv.data());
  rope(qkv.data(), t, row, dm.heads + dm.kv_heads, dm.head_dim, cos, sin, positions);
  attention(qkv.data(), dm, attn, att.data());
  product(att.data(), t, dm.heads * dm.head_dim, ly.o, hidden);
  add_rows(residual, hidden, t, h);
  rms_norm(residual, ly.post_norm, t, h, eps, x.data());
  product(x.data(), t, h, ly.gate_up, gu.data());
  per_token(t, [&](int64_t r) { silu_mul(gu.data() + r * 2 * dm.inter, dm.inter, act.data() + r * dm.inter); });
  product(act.data(), t, dm.inter, ly.down, hidden);
}

at::Tensor fused_decode_step(const at::Tensor& embedded, at::TensorList weights, at::IntArrayRef formats,
                             at::TensorList packed, at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& cos,
                             const at::Tensor& sin, const at::Tensor& positions, const at::Tensor& slot_mapping,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                             int64_t num_kv_heads, double eps, double scale, bool q8) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 10 * layers + 1 && static_cast<int64_t>(formats.size()) == 8 * layers &&
                  static_cast<int64_t>(value_caches.size()) == layers && static_cast<int64_t>(packed.size()) == 4 * layers,
              "fused_decode_step: 10 weights, 8 formats and 4 packed copies per layer, one cache pair per layer, "
              "then the final norm");
  TORCH_CHECK(embedded.scalar_type() == at::kFloat && embedded.dim() == 2, "fused_decode_step: hidden [T, H] fp32");
  const int64_t tokens = embedded.size(0), hidden = embedded.size(1);
  TORCH_CHECK(layers > 0 && key_caches[0].dim() == 4, "fused_decode_step: caches [N, block, Hkv, D]");
  const int64_t head_dim = key_caches[0].size(3);
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == tokens && slot_mapping.numel() == tokens,
              "fused_decode_step: positions and slot_mapping int64 [T]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.dim() == 2 && block_tables.size(0) == tokens && seq_lens.numel() == tokens,
              "fused_decode_step: one sequence per token (block_tables [T, M], seq_lens [T] int32)");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && cos.dim() == 2 &&
                  cos.size(1) == head_dim / 2 && sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "fused_decode_step: cos/sin fp32 [positions, head_dim / 2]");
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const at::Tensor pos = positions.contiguous(), slots = slot_mapping.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t block_size = key_caches[0].size(1), cache_slots = key_caches[0].size(0) * block_size;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0) && pp[t] == lp[t] - 1 && sp[t] >= 0 && sp[t] < cache_slots &&
                    lp[t] <= tables.size(1) * block_size,
                "fused_decode_step: token ", t, " is not a decode (position ", pp[t], ", length ", lp[t], ")");
  const std::vector<at::Tensor> w(weights.begin(), weights.end());
  const std::vector<int64_t> f(formats.begin(), formats.end());
  const int64_t qkv_rows = (num_heads + 2 * num_kv_heads) * head_dim;
  const int64_t inter = w[6].size(0) / 2;
  const Dims dm{tokens, hidden, num_heads, num_kv_heads, head_dim, inter};
  at::Tensor residual_t = embedded.contiguous().clone();
  float* residual = residual_t.data_ptr<float>();
  at::Tensor out = at::empty({tokens, hidden}, embedded.options());
  std::vector<float> layer_out(tokens * hidden);
  Product product{q8, {}};
  for (int64_t l = 0; l < layers; ++l) {
    const size_t wi = 10 * l, fi = 8 * l;
    const Layer ly{vector_at(w[wi], hidden, "input norm"), vector_at(w[wi + 5], hidden, "post-attention norm"),
                   linear_at(w, f, packed[4 * l], wi + 1, fi, hidden),
                   linear_at(w, f, packed[4 * l + 1], wi + 3, fi + 2, num_heads * head_dim),
                   linear_at(w, f, packed[4 * l + 2], wi + 6, fi + 4, hidden),
                   linear_at(w, f, packed[4 * l + 3], wi + 8, fi + 6, inter)};
    TORCH_CHECK(ly.qkv.rows == qkv_rows && ly.o.rows == hidden && ly.gate_up.rows == 2 * inter &&
                    ly.down.rows == hidden, "fused_decode_step: layer ", l, " has other shapes than layer 0");
    const at::Tensor& kc = key_caches[l];
    const at::Tensor& vc = value_caches[l];
    TORCH_CHECK(kc.scalar_type() == at::kFloat && kc.is_contiguous() && vc.sizes() == kc.sizes() &&
                    vc.scalar_type() == at::kFloat && vc.is_contiguous() && kc.size(0) * kc.size(1) == cache_slots &&
                    kc.size(2) == num_kv_heads && kc.size(3) == head_dim,
                "fused_decode_step: layer ", l, "'s caches must be fp32 [N, block, Hkv, D] like layer 0's");
    if (l > 0) add_rows(residual, layer_out.data(), tokens, hidden);
    const Attention attn{kc, vc, tables.data_ptr<int32_t>(), lp, sp, tables.size(1), static_cast<float>(scale),
                         head_dim % 8 == 0};
    layer_step(ly, dm, static_cast<float>(eps), attn, cos.data_ptr<float>(), sin.data_ptr<float>(), pp, product,
               residual, layer_out.data());
  }
  add_rows(residual, layer_out.data(), tokens, hidden);
  rms_norm(residual, vector_at(w[10 * layers], hidden, "final norm"), tokens, hidden,
           static_cast<float>(eps), out.data_ptr<float>());
  return out;
}

// The step's attention alone, fast (attend_f32) or the reference attend(), over the cache as it is
// (nothing written): query [T, heads * head_dim] fp32, one sequence per row (the test's comparison).
at::Tensor fused_attention_check(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                 const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
                                 int64_t num_kv_heads, double scale, bool fast) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.scalar_type() == at::kFloat && key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == at::kFloat && key_cache.size(2) == num_kv_heads,
              "fused_attention_check: caches fp32 [N, block, Hkv, D]");
  const int64_t d = key_cache.size(3), tokens = query.size(0);
  TORCH_CHECK(!fast || d % 8 == 0, "fused_attention_check: the fast path needs head_dim % 8 == 0");
  TORCH_CHECK(query.scalar_type() == at::kFloat && query.dim() == 2 && query.size(1) == num_heads * d &&
                  num_heads % num_kv_heads == 0,
              "fused_attention_check: query fp32 [T, heads * head_dim]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.size(0) == tokens && seq_lens.numel() == tokens,
              "fused_attention_check: block_tables [T, M], seq_lens [T] int32");
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(lp[t] >= 1 && lp[t] <= tables.size(1) * key_cache.size(1), "fused_attention_check: length ", lp[t]);
  at::Tensor out = at::empty_like(q);
  const twinserve_attention::Shape sh{num_heads, num_kv_heads, d, key_cache.size(1), tables.size(1)};
  std::vector<float> scratch;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* qt = q.data_ptr<float>() + t * num_heads * d;
    const int32_t* table = tables.data_ptr<int32_t>() + t * tables.size(1);
    float* ot = out.data_ptr<float>() + t * num_heads * d;
    if (fast)
      twinserve_attention::attend_f32(qt, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), table, lp[t],
                                      sh, 0, num_kv_heads, static_cast<float>(scale), ot, scratch);
    else
      twinserve_attention::attend<float>(qt, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), table,
                                         lp[t], 0, sh, 0, num_kv_heads, static_cast<float>(scale), 0.f, ot, scratch);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(twinserve_quant, m) {
  m.def("fused_decode_step(Tensor hidden, Tensor[] weights, int[] formats, Tensor[] packed, Tensor[] key_caches, "
        "Tensor[] value_caches, Tensor cos, Tensor sin, Tensor positions, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, int num_heads, int num_kv_heads, float eps, float scale, "
        "bool q8) -> Tensor");
  m.def("fused_attention_check(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, int num_heads, int num_kv_heads, float scale, bool fast) -> Tensor");
}

TORCH_LIBRARY_IMPL(twinserve_quant, CPU, m) {
  m.impl("fused_decode_step", &fused_decode_step);
  m.impl("fused_attention_check", &fused_attention_check);
}
