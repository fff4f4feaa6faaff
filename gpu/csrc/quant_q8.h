// Integer products for the 32-value GGUF formats (Q8_0, Q4_0, Q4_1), as llama.cpp computes them:
// the activations are quantized per 32-value block to int8 (llama.cpp's Q8_1: d = max|x| / 127,
// q = round-half-even(x / d), s = d * sum(q)), and each weight block meets each token's block in
// one AVX2 integer dot product (_mm256_maddubs_epi16: u8 x i8 pairs into int16, then
// _mm256_madd_epi16 into int32), so a block costs a handful of instructions per token where the
// fp32 path (quant_blocks.h) widens 32 values to floats and does four FMAs.
//
//   Q8_0: w = dw * qw                 dot = dw * dx * sum(qw * qx)
//   Q4_0: w = dw * (n - 8)            dot = dw * dx * sum(n * qx) - 8 * dw * s
//   Q4_1: w = dw * n + mw             dot = dw * dx * sum(n * qx) + mw * s
//
// The integer sums are exact (|n * qx| <= 15 * 127, |qw * qx| <= 128 * 127, pairs fit int16), so
// the result equals the fp32 product of the dequantized weight with the dequantized activations,
// up to the order of fp32 additions: that is what the tests check against.
#pragma once

#include "quant_blocks.h"

namespace twinserve_quant {

struct XBlock {  // one 32-value block of quantized activations
  float d, s;
  int8_t q[32];
};
static_assert(sizeof(XBlock) == 40, "XBlock must be packed as 2 floats + 32 bytes");

template <typename F>
constexpr bool kHasQ8Dot = std::is_same_v<F, Q8_0> || std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1>;

inline bool has_q8_dot(int64_t fmt) { return fmt >= 0 && fmt <= 2; }

inline float lanes_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline int32_t lanes_sum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// x[k] (k a multiple of 32) into k / 32 blocks; the sequence of packs is llama.cpp's
// quantize_row_q8_1 (packs interleave 128-bit lanes, the permute puts the bytes back in order).
inline void quantize_row_q8(const float* x, int64_t k, XBlock* out) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < k / 32; ++b) {
    const float* v = x + 32 * b;
    __m256 f[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      f[i] = _mm256_loadu_ps(v + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[i]));
    }
    const float d = lanes_max(amax) / 127.f;
    const __m256 id = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i)
      q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[i], id),
                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const int32_t sum = lanes_sum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                                       _mm256_add_epi32(q[2], q[3])));
    __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    out[b].d = d;
    out[b].s = d * static_cast<float>(sum);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[b].q), packed);
  }
}

// The 32 nibbles of a Q4 block as bytes in value order (low nibbles = values 0..15).
inline __m256i q4_bytes(const uint8_t* qs) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// One weight block, ready for the integer dot: the bytes maddubs takes unsigned (|qw| for Q8_0,
// with qw's signs moved onto the activations), dw, and the per-block term's factor c (c * s).
struct WBlock {
  __m256i w, sign;
  float dw, c;
};

template <typename F>
inline WBlock load_block(const uint8_t* b) {
  WBlock k;
  k.dw = half_at(b);
  if constexpr (std::is_same_v<F, Q8_0>) {
    k.sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    k.w = _mm256_sign_epi8(k.sign, k.sign);
    k.c = 0.f;
  } else if constexpr (std::is_same_v<F, Q4_0>) {
    k.w = q4_bytes(b + 2);
    k.c = -8.f * k.dw;
  } else {
    k.w = q4_bytes(b + 4);
    k.c = half_at(b + 2);
  }
  return k;
}

// RT rows x NT tokens at a time: RT * NT independent accumulator chains (one chain is FMA-latency
// bound at batch 1) and each activation block loaded once for RT rows. acc[r][t] (8 int32 lanes
// as floats, scaled by dw * dx) and accm[r][t] (the c * s terms) sum over the row's blocks.
template <typename F, int NT, int RT>
void rows_tile_q8(const XBlock* x, int64_t blocks, const uint8_t* wq, int64_t row_bytes, float* out,
                  int64_t n, int64_t r0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[RT][NT];
  float accm[RT][NT] = {};
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  const uint8_t* rows = wq + r0 * row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    WBlock w[RT];
    for (int r = 0; r < RT; ++r) w[r] = load_block<F>(rows + r * row_bytes + b * F::kBytes);
    for (int t = 0; t < NT; ++t) {
      const XBlock& xb = x[t * blocks + b];
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
      const __m256 dx = _mm256_broadcast_ss(&xb.d);
      for (int r = 0; r < RT; ++r) {
        const __m256i q = std::is_same_v<F, Q8_0> ? _mm256_sign_epi8(qx, w[r].sign) : qx;
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w[r].w, q), ones);
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(sums), dx);
        acc[r][t] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(w[r].dw), acc[r][t]);
        if constexpr (!std::is_same_v<F, Q8_0>) accm[r][t] += w[r].c * xb.s;
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int t = 0; t < NT; ++t) out[t * n + r0 + r] = lanes_sum(acc[r][t]) + accm[r][t];
}

// Rows [row_begin, row_end) for NT tokens: RT rows at a time, the remainder one by one.
template <typename F, int NT, int RT>
void rows_q8(const XBlock* x, int64_t blocks, const uint8_t* wq, int64_t row_bytes, float* out, int64_t n,
             int64_t row_begin, int64_t row_end) {
  int64_t r = row_begin;
  for (; r + RT <= row_end; r += RT) rows_tile_q8<F, NT, RT>(x, blocks, wq, row_bytes, out, n, r);
  for (; r < row_end; ++r) rows_tile_q8<F, NT, 1>(x, blocks, wq, row_bytes, out, n, r);
}

constexpr int kTileQ8 = 4;         // tokens per pass over a chunk of rows
constexpr int64_t kRowChunk = 16;  // rows kept in L1 while every token tile passes over them

// out[T, n] for rows [row_begin, row_end) from the quantized activations x[T, blocks].
template <typename F>
void matmul_rows_q8(const XBlock* x, int64_t num_tokens, int64_t blocks, const uint8_t* wq,
                    int64_t row_bytes, float* out, int64_t n, int64_t row_begin, int64_t row_end) {
  for (int64_t c0 = row_begin; c0 < row_end; c0 += kRowChunk) {
    const int64_t c1 = std::min(c0 + kRowChunk, row_end);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += kTileQ8) {
      const XBlock* xt = x + t0 * blocks;
      float* ot = out + t0 * n;
      switch (std::min<int64_t>(kTileQ8, num_tokens - t0)) {
        case 1: rows_q8<F, 1, 4>(xt, blocks, wq, row_bytes, ot, n, c0, c1); break;
        case 2: rows_q8<F, 2, 4>(xt, blocks, wq, row_bytes, ot, n, c0, c1); break;
        case 3: rows_q8<F, 3, 3>(xt, blocks, wq, row_bytes, ot, n, c0, c1); break;
        default: rows_q8<F, 4, 2>(xt, blocks, wq, row_bytes, ot, n, c0, c1); break;
      }
    }
  }
}

template <typename Fn>
void dispatch_q8(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case 0: return fn(Q8_0{});
    case 1: return fn(Q4_0{});
    case 2: return fn(Q4_1{});
    default: TORCH_CHECK(false, "the int8-activation product covers Q8_0, Q4_0 and Q4_1, not format id ", fmt);
  }
}

// out[T, n] = x[T, k] @ W^T by the integer path, rows split across threads; xq holds x quantized.
inline void matmul_q8(const XBlock* xq, int64_t num_tokens, int64_t k, const uint8_t* wq, int64_t n,
                      float* out, int64_t fmt) {
  dispatch_q8(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t blocks = k / F::kValues, rb = blocks * F::kBytes;
    at::parallel_for(0, n, kRowChunk, [&](int64_t begin, int64_t end) {
      matmul_rows_q8<F>(xq, num_tokens, blocks, wq, rb, out, n, begin, end);
    });
  });
}

}  // namespace twinserve_quant
