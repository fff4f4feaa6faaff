// Paged decode attention of one sequence over its KV heads [h0, h1), shared by
// paged_decode_attention.cpp (the attention op) and fused_decode.cpp (a whole decode step).
// Layout and conventions: see paged_decode_attention.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace twinserve_attention {

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

}  // namespace twinserve_attention
