// Paged decode attention for the CPU backend: one query token per sequence, attending to its whole
// context straight from the paged KV cache. Each (sequence, KV head) pair reads its keys and values
// once, in place: no gathered copy, no padding to the batch's longest context.
//
// Layout (gpu/kv_cache.py): key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim];
// query, out [num_seqs, num_heads, head_dim]; block_tables [num_seqs, max_blocks] int32;
// seq_lens [num_seqs] int32. Query heads are grouped by KV head (GQA).
// Sliding window (window > 0): a sequence of length L attends to positions [max(0, L - window), L)
// only; blocks before them may be freed (their table entries are never read). Soft-capping
// (softcap > 0, Gemma 2): each score s becomes softcap * tanh(s / softcap) before the softmax.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
};

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Eight float lanes (GCC/Clang vector extension: AVX where the compiler targets it, SSE pairs otherwise).
typedef float Lanes __attribute__((vector_size(32)));

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// The dot products of G query heads with one key: G independent accumulator chains (a single
// reduction chain is FMA-latency bound). Needs head_dim % 8 == 0.
template <int G>
inline void group_dots(const float* q, const float* k, int64_t d, float scale, float* out,
                       int64_t out_stride) {
  Lanes acc[G] = {};
  for (int64_t i = 0; i < d; i += 8) {
    const Lanes kv = load_lanes(k + i);
    for (int g = 0; g < G; ++g) acc[g] += load_lanes(q + g * d + i) * kv;
  }
  for (int g = 0; g < G; ++g) {
    float sum = 0.f;
    for (int l = 0; l < 8; ++l) sum += acc[g][l];
    out[g * out_stride] = sum * scale;
  }
}

using GroupDots = void (*)(const float*, const float*, int64_t, float, float*, int64_t);

inline GroupDots group_dots_for(int64_t group, int64_t head_dim) {
  if (head_dim % 8 != 0) return nullptr;
  switch (group) {
    case 1: return &group_dots<1>;
    case 2: return &group_dots<2>;
    case 3: return &group_dots<3>;
    case 4: return &group_dots<4>;
    case 5: return &group_dots<5>;
    case 6: return &group_dots<6>;
    case 7: return &group_dots<7>;
    case 8: return &group_dots<8>;
    default: return nullptr;
  }
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <typename T>
inline const float* as_float(const T* src, float* buf, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i]);
    return buf;
  }
}

// One sequence, KV heads [h0, h1): scores for their query heads, softmax, weighted sum of values.
// A token's keys (or values) for all KV heads are one contiguous row, so walking the context token
// by token reads each block front to back; hardware prefetch then keeps up, which a walk per head
// (a 1/num_kv_heads strided read) did not: that ran at ~1.2 GB/s here.
template <typename T>
void attend(const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
            int64_t seq_len, int64_t first, const Shape& s, int64_t h0, int64_t h1, float scale,
            float softcap, T* out, std::vector<float>& scratch) {
  const int64_t context = seq_len - first;  // positions first .. seq_len - 1
  const int64_t group = s.num_heads / s.num_kv_heads, d = s.head_dim;
  const int64_t q0 = h0 * group, nq = (h1 - h0) * group, row_len = s.num_kv_heads * d;
  scratch.resize(nq * d * 2 + nq * context + row_len + nq);
  float* q = scratch.data();
  float* acc = q + nq * d;
  float* scores = acc + nq * d;
  float* row = scores + nq * context;
  float* inv_sum = row + row_len;
  const GroupDots dots = group_dots_for(group, d);
  for (int64_t i = 0; i < nq * d; ++i) q[i] = static_cast<float>(query[q0 * d + i]);
  for (int64_t t = 0; t < context; ++t) {
    const int64_t p = first + t;
    const int64_t slot = static_cast<int64_t>(table[p / s.block_size]) * s.block_size + p % s.block_size;
    const float* k = as_float(key_cache + slot * row_len, row, row_len);
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t j = (h - h0) * group;
      if (dots != nullptr) {
        dots(q + j * d, k + h * d, d, scale, scores + j * context + t, context);
      } else {
        for (int64_t g = 0; g < group; ++g)
          scores[(j + g) * context + t] = dot(q + (j + g) * d, k + h * d, d) * scale;
      }
    }
  }
  if (softcap > 0.f) {
    for (int64_t i = 0; i < nq * context; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  }
  for (int64_t j = 0; j < nq; ++j) {
    float* sc = scores + j * context;
    const float mx = *std::max_element(sc, sc + context);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < context; ++t) {
      sc[t] = std::exp(sc[t] - mx);
      sum += sc[t];
    }
    inv_sum[j] = 1.f / sum;
  }
  std::fill(acc, acc + nq * d, 0.f);
  for (int64_t t = 0; t < context; ++t) {
    const int64_t p = first + t;
    const int64_t slot = static_cast<int64_t>(table[p / s.block_size]) * s.block_size + p % s.block_size;
    const float* v = as_float(value_cache + slot * row_len, row, row_len);
    for (int64_t j = 0; j < nq; ++j) axpy(scores[j * context + t], v + (h0 + j / group) * d, acc + j * d, d);
  }
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t i = 0; i < d; ++i) out[(q0 + j) * d + i] = static_cast<T>(acc[j * d + i] * inv_sum[j]);
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double softcap) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D], caches [N, bs, Hkv, D]");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const at::Tensor q = query.contiguous(), tables = block_tables.contiguous(), lens = seq_lens.contiguous();
  const Shape s{q.size(1), key_cache.size(2), q.size(2), key_cache.size(1), tables.size(1)};
  TORCH_CHECK(s.head_dim == key_cache.size(3) && s.num_heads % s.num_kv_heads == 0, "head shapes mismatch");
  const int64_t num_seqs = q.size(0);
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == num_seqs && tables.size(0) == num_seqs,
              "block_tables and seq_lens need one row per sequence");
  if (num_seqs > 0) {
    const auto [low, high] = std::minmax_element(lens.const_data_ptr<int32_t>(),
                                                 lens.const_data_ptr<int32_t>() + num_seqs);
    TORCH_CHECK(*low >= 1 && *high <= s.max_blocks * s.block_size,
                "seq_lens must lie in [1, block_tables.size(1) * block_size]");
  }
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    const scalar_t* kp = key_cache.const_data_ptr<scalar_t>();
    const scalar_t* vp = value_cache.const_data_ptr<scalar_t>();
    const int32_t* tp = tables.const_data_ptr<int32_t>();
    const int32_t* lp = lens.const_data_ptr<int32_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int64_t seq_stride = s.num_heads * s.head_dim;
    // Whole sequences per work item; split by KV head only when sequences are too few to share out.
    const int64_t split = num_seqs >= 4 * at::get_num_threads() ? 1 : s.num_kv_heads;
    const int64_t heads = s.num_kv_heads / split;
    at::parallel_for(0, num_seqs * split, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / split, h0 = (item % split) * heads;
        const int64_t first = window > 0 ? std::max<int64_t>(0, lp[b] - window) : 0;
        attend<scalar_t>(qp + b * seq_stride, kp, vp, tp + b * s.max_blocks, lp[b], first, s, h0,
                         h0 + heads, static_cast<float>(scale), static_cast<float>(softcap),
                         op + b * seq_stride, scratch);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(twinserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0, "
        "float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(twinserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
