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

#include <vector>

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

// ---- one token: each row streamed once, in memory order ------------------------------------
// A batch-1 product is a pass over the weight: rows are read one after another (adjacent in
// memory, so the hardware prefetcher sees one stream; reading 4 rows side by side, as the fp32
// path does, ran at a third of the bandwidth on the 49152-row LM head here) with a software
// prefetch kPrefetch bytes ahead (single thread, weights out of cache: 512 B ahead 7.0 GB/s on
// the Q8_0 LM head, 4 KiB ahead 10.4; Q4_1 5.9-6.3 against 6.7-7.5), and two accumulator chains
// over alternate blocks (one chain is FMA-latency bound).
constexpr int64_t kPrefetch = 4096;

template <typename F>
inline void block_dot_q8(const uint8_t* b, const XBlock& xb, __m256& acc, float& accm) {
  const WBlock w = load_block<F>(b);
  const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
  const __m256i q = std::is_same_v<F, Q8_0> ? _mm256_sign_epi8(qx, w.sign) : qx;
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w.w, q), _mm256_set1_epi16(1));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(w.dw * xb.d), acc);
  if constexpr (!std::is_same_v<F, Q8_0>) accm += w.c * xb.s;
}

template <typename F>
void rows_one_token_q8(const XBlock* x, int64_t blocks, const uint8_t* wq, int64_t row_bytes, float* out,
                       int64_t row_begin, int64_t row_end) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = wq + r * row_bytes;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float m0 = 0.f, m1 = 0.f;
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(row + b * F::kBytes + kPrefetch), _MM_HINT_T0);
      block_dot_q8<F>(row + b * F::kBytes, x[b], a0, m0);
      block_dot_q8<F>(row + (b + 1) * F::kBytes, x[b + 1], a1, m1);
    }
    if (b < blocks) block_dot_q8<F>(row + b * F::kBytes, x[b], a0, m0);
    out[r] = lanes_sum(_mm256_add_ps(a0, a1)) + (m0 + m1);
  }
}

// ---- several tokens: a tiled int8 GEMM -------------------------------------------------------
// A chunk of kRowChunk rows is unpacked once into a panel (each block's 32 weight bytes as
// maddubs takes them, its dw, its c), then every tile of kTileRows rows x kTileTokens tokens runs
// over the panel with its kTileRows * kTileTokens accumulators in registers: a weight vector is
// loaded once per tile for kTileTokens tokens, an activation block once for kTileRows rows.
// The per-block terms c * s are a small fp32 product done after (8 rows a vector).
constexpr int64_t kRowChunk = 16;
constexpr int kTileRows = 2, kTileTokens = 4;

struct Panel {
  std::vector<uint8_t> w, sign;  // 32 bytes a block, [row][block]; sign: Q8_0's signed bytes
  std::vector<float> dw, c;      // dw [row][block]; c [block][row] (rows contiguous)
};

template <typename F>
void unpack_panel(const uint8_t* wq, int64_t row_bytes, int64_t blocks, int64_t r0, int64_t rows, Panel& p) {
  p.w.resize(32 * rows * blocks);
  p.dw.resize(rows * blocks);
  p.c.resize(rows * blocks);
  if constexpr (std::is_same_v<F, Q8_0>) p.sign.resize(32 * rows * blocks);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const WBlock k = load_block<F>(wq + (r0 + r) * row_bytes + b * F::kBytes);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&p.w[32 * (r * blocks + b)]), k.w);
      if constexpr (std::is_same_v<F, Q8_0>)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&p.sign[32 * (r * blocks + b)]), k.sign);
      p.dw[r * blocks + b] = k.dw;
      p.c[b * rows + r] = k.c;
    }
}

// out[t * n + r0 + i] = sum over blocks of dw * dx * (integer dot), for R panel rows from `r` and
// NT tokens of x (the tile's first token's blocks at x, a token's blocks contiguous).
template <typename F, int R, int NT>
inline void panel_tile_q8(const Panel& p, int64_t r, int64_t blocks, const XBlock* x, float* out, int64_t n,
                          int64_t r0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][NT];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i w[R];
    float dw[R];
    for (int i = 0; i < R; ++i) {
      w[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&p.w[32 * ((r + i) * blocks + b)]));
      dw[i] = p.dw[(r + i) * blocks + b];
    }
    for (int t = 0; t < NT; ++t) {
      const XBlock& xb = x[t * blocks + b];
      const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q));
      for (int i = 0; i < R; ++i) {
        const __m256i q =
            std::is_same_v<F, Q8_0>
                ? _mm256_sign_epi8(qx, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                           &p.sign[32 * ((r + i) * blocks + b)])))
                : qx;
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], q), ones);
        acc[i][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(dw[i] * xb.d), acc[i][t]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    for (int t = 0; t < NT; ++t) out[t * n + r0 + r + i] = lanes_sum(acc[i][t]);
}

template <typename F, int NT>
void panel_rows_q8(const Panel& p, int64_t rows, int64_t blocks, const XBlock* x, float* out, int64_t n,
                   int64_t r0) {
  int64_t r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) panel_tile_q8<F, kTileRows, NT>(p, r, blocks, x, out, n, r0);
  for (; r < rows; ++r) panel_tile_q8<F, 1, NT>(p, r, blocks, x, out, n, r0);
}

// out[t, r] += sum_b c[r, b] * s[t, b] for the panel's rows (8 rows a vector, the rest one by one).
inline void panel_block_terms(const Panel& p, int64_t rows, int64_t blocks, const XBlock* x, int64_t num_tokens,
                              float* out, int64_t n, int64_t r0) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    const XBlock* xt = x + t * blocks;
    float* o = out + t * n + r0;
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
      __m256 a = _mm256_loadu_ps(o + r);
      for (int64_t b = 0; b < blocks; ++b)
        a = _mm256_fmadd_ps(_mm256_set1_ps(xt[b].s), _mm256_loadu_ps(&p.c[b * rows + r]), a);
      _mm256_storeu_ps(o + r, a);
    }
    for (; r < rows; ++r) {
      float a = 0.f;
      for (int64_t b = 0; b < blocks; ++b) a += xt[b].s * p.c[b * rows + r];
      o[r] += a;
    }
  }
}

// out[T, n] for rows [row_begin, row_end) from the quantized activations x[T, blocks]: blocks of
// kTokenBlock tokens (their activations stay in L2 while every row chunk passes over them).
constexpr int64_t kTokenBlock = 64;

template <typename F>
void matmul_rows_q8(const XBlock* x, int64_t num_tokens, int64_t blocks, const uint8_t* wq,
                    int64_t row_bytes, float* out, int64_t n, int64_t row_begin, int64_t row_end) {
  if (num_tokens == 1) return rows_one_token_q8<F>(x, blocks, wq, row_bytes, out, row_begin, row_end);
  Panel p;
  for (int64_t tb = 0; tb < num_tokens; tb += kTokenBlock) {
    const int64_t tokens = std::min(kTokenBlock, num_tokens - tb);
    const XBlock* xb = x + tb * blocks;
    float* ob = out + tb * n;
    for (int64_t c0 = row_begin; c0 < row_end; c0 += kRowChunk) {
      const int64_t rows = std::min(kRowChunk, row_end - c0);
      unpack_panel<F>(wq, row_bytes, blocks, c0, rows, p);
      for (int64_t t0 = 0; t0 < tokens; t0 += kTileTokens) {
        const XBlock* xt = xb + t0 * blocks;
        float* ot = ob + t0 * n;
        switch (std::min<int64_t>(kTileTokens, tokens - t0)) {
          case 1: panel_rows_q8<F, 1>(p, rows, blocks, xt, ot, n, c0); break;
          case 2: panel_rows_q8<F, 2>(p, rows, blocks, xt, ot, n, c0); break;
          case 3: panel_rows_q8<F, 3>(p, rows, blocks, xt, ot, n, c0); break;
          default: panel_rows_q8<F, kTileTokens>(p, rows, blocks, xt, ot, n, c0); break;
        }
      }
      if constexpr (!std::is_same_v<F, Q8_0>) panel_block_terms(p, rows, blocks, xb, tokens, ob, n, c0);
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
