// The fused decode step's attention (fp32 KV cache, one query token per sequence) and its vector
// exp, with AVX2 intrinsics (fused_decode.cpp is built -march=native). The plain reference is
// paged_attention.h's attend(), which the per-op path's paged_decode_attention op runs too; the
// fused_attention_check op (fused_decode.cpp) runs either on the same inputs and
// tests/test_fused_decode.py compares them.
//
// attend() walks the context token by token and, per token, each query head with a dot of
// head_dim floats (a horizontal sum each) and then an axpy per head, a large share of a
// many-sequence step (figures in docs/quantization.md, "The fused step's kernels"). Here a block's
// tokens are contiguous rows of the cache, so the scores of 8 tokens for a query head are 8
// accumulator chains reduced with one hadd tree (one vector store of 8 scores), the softmax's exp
// is a vector polynomial (exp256), and the weighted sum of values keeps a tile of query heads x 32
// dimensions in registers over the whole context, each value row loaded once per tile.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paged_attention.h"

namespace twinserve_attention {

// e^x for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial),
// within 2 ulp of std::exp on [-87, 88]; inputs are clamped to [-88.38, 88.38] (e^-inf is 0: the
// clamped -88.38 gives a zero exponent field).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// One sequential read of the sequence's K and V rows before the scores: a step's caches come from
// memory (evicted between layers by the weights), and the passes below read them in an order the
// hardware prefetchers follow poorly (a head's floats of each row, then the next head's), at
// under half the rate of a plain pass; software prefetches of the next block did not help
// (docs/quantization.md, "The fused step's kernels"). The rows then sit in L2.
inline void touch_blocks(const float* key_cache, const float* value_cache, const int32_t* table, int64_t seq_len,
                         int64_t bs, int64_t row_len) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < seq_len; t0 += bs) {
    const int64_t off = static_cast<int64_t>(table[t0 / bs]) * bs * row_len, n = std::min(bs, seq_len - t0) * row_len;
    for (int64_t j = 0; j < n; j += 16)  // one load per 64-byte line
      a = _mm256_add_ps(a, _mm256_add_ps(_mm256_loadu_ps(key_cache + off + j), _mm256_loadu_ps(value_cache + off + j)));
  }
  alignas(32) float sink[8];
  _mm256_store_ps(sink, a);
  asm volatile("" : : "r"(sink) : "memory");  // the loads are kept
}

// lane i = the sum of a[i]'s 8 lanes.
inline __m256 hsum8x8(const __m256* a) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores[0..nt) = scale * q . k_i for nt <= 8 key rows k + i * stride (d % 8 == 0).
inline void score_rows(const float* q, const float* k, int64_t stride, int64_t nt, int64_t d, float scale,
                       float* scores) {
  __m256 acc[8];
  for (auto& a : acc) a = _mm256_setzero_ps();
  if (nt == 8) {
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * stride + i), acc[t]);
    }
  } else {
    for (int64_t i = 0; i < d; i += 8) {
      const __m256 qv = _mm256_loadu_ps(q + i);
      for (int64_t t = 0; t < nt; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + t * stride + i), acc[t]);
    }
  }
  const __m256 s = _mm256_mul_ps(hsum8x8(acc), _mm256_set1_ps(scale));
  if (nt == 8) return _mm256_storeu_ps(scores, s);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, s);
  for (int64_t t = 0; t < nt; ++t) scores[t] = lanes[t];
}

// acc[NH heads][NV vectors] += sum over the context of p[h][t] * v_t[NV * 8 dims from dim0];
// p: NH rows of probabilities (stride ps), v rows of the block walk.
template <int NH, int NV>
inline void weighted_values(const float* p, int64_t ps, const float* value_cache, const int32_t* table,
                            int64_t context, int64_t block_size, int64_t row_len, int64_t col, float* acc,
                            int64_t acc_stride) {
  __m256 a[NH][NV];
  for (auto& row : a)
    for (auto& v : row) v = _mm256_setzero_ps();
  for (int64_t t0 = 0; t0 < context; t0 += block_size) {
    const float* base = value_cache + static_cast<int64_t>(table[t0 / block_size]) * block_size * row_len + col;
    const int64_t nt = std::min(block_size, context - t0);
    for (int64_t i = 0; i < nt; ++i) {
      const float* v = base + i * row_len;
      __m256 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = _mm256_loadu_ps(v + 8 * j);
      for (int h = 0; h < NH; ++h) {
        const __m256 w = _mm256_set1_ps(p[h * ps + t0 + i]);
        for (int j = 0; j < NV; ++j) a[h][j] = _mm256_fmadd_ps(w, vv[j], a[h][j]);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int j = 0; j < NV; ++j) _mm256_storeu_ps(acc + h * acc_stride + 8 * j, a[h][j]);
}

template <int NV>
inline void weighted_values_heads(int64_t nh, const float* p, int64_t ps, const float* vc, const int32_t* table,
                                  int64_t context, int64_t bs, int64_t row_len, int64_t col, float* acc,
                                  int64_t acc_stride) {
  int64_t h = 0;
  for (; h + 3 <= nh; h += 3)
    weighted_values<3, NV>(p + h * ps, ps, vc, table, context, bs, row_len, col, acc + h * acc_stride, acc_stride);
  if (nh - h == 2) weighted_values<2, NV>(p + h * ps, ps, vc, table, context, bs, row_len, col, acc + h * acc_stride, acc_stride);
  if (nh - h == 1) weighted_values<1, NV>(p + h * ps, ps, vc, table, context, bs, row_len, col, acc + h * acc_stride, acc_stride);
}

// attend() for fp32 caches, the whole context (no window, no soft-capping), head_dim % 8 == 0;
// query heads of KV heads [h0, h1) into out (rows of head_dim, the query's head order).
inline void attend_f32(const float* query, const float* key_cache, const float* value_cache, const int32_t* table,
                       int64_t seq_len, const Shape& s, int64_t h0, int64_t h1, float scale, float* out,
                       std::vector<float>& scratch) {
  const int64_t group = s.num_heads / s.num_kv_heads, d = s.head_dim, bs = s.block_size;
  const int64_t q0 = h0 * group, nq = (h1 - h0) * group, row_len = s.num_kv_heads * d;
  const int64_t padded = (seq_len + 7) / 8 * 8;
  scratch.resize(nq * padded + nq * d + nq);
  float* scores = scratch.data();
  float* acc = scores + nq * padded;
  float* inv = acc + nq * d;
  touch_blocks(key_cache, value_cache, table, seq_len, bs, row_len);
  for (int64_t t0 = 0; t0 < seq_len; t0 += bs) {
    const float* base = key_cache + static_cast<int64_t>(table[t0 / bs]) * bs * row_len;
    const int64_t nt = std::min(bs, seq_len - t0);
    for (int64_t j = 0; j < nq; ++j) {
      const float* q = query + (q0 + j) * d;
      const float* k = base + (h0 + j / group) * d;
      for (int64_t i = 0; i < nt; i += 8)
        score_rows(q, k + i * row_len, row_len, std::min<int64_t>(8, nt - i), d, scale, scores + j * padded + t0 + i);
    }
  }
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < nq; ++j) {
    float* sc = scores + j * padded;
    for (int64_t t = seq_len; t < padded; ++t) sc[t] = -std::numeric_limits<float>::infinity();
    __m256 mx = neg_inf;
    for (int64_t t = 0; t < padded; t += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sc + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const __m256 m = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1))));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t t = 0; t < padded; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sc + t), m));
      _mm256_storeu_ps(sc + t, e);
      sum = _mm256_add_ps(sum, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sum);
    float total = 0.f;
    for (float l : lanes) total += l;
    inv[j] = 1.f / total;
  }
  for (int64_t h = h0; h < h1; ++h) {
    const float* p = scores + (h - h0) * group * padded;
    float* a = acc + (h - h0) * group * d;
    int64_t c = 0;
    for (; c + 32 <= d; c += 32)
      weighted_values_heads<4>(group, p, padded, value_cache, table, seq_len, bs, row_len, h * d + c, a + c, d);
    for (; c < d; c += 8)
      weighted_values_heads<1>(group, p, padded, value_cache, table, seq_len, bs, row_len, h * d + c, a + c, d);
  }
  for (int64_t j = 0; j < nq; ++j) {
    const __m256 r = _mm256_set1_ps(inv[j]);
    for (int64_t i = 0; i < d; i += 8)
      _mm256_storeu_ps(out + (q0 + j) * d + i, _mm256_mul_ps(_mm256_loadu_ps(acc + j * d + i), r));
  }
}

}  // namespace twinserve_attention
