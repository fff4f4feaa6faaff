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

#include <atomic>
#include <cstring>
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
// path does, ran at a third of the bandwidth on the LM head) with a software prefetch kPrefetch
// bytes ahead (4 KiB beat 512 B; docs/quantization.md, "The fused step's kernels"), and two
// accumulator chains over alternate blocks (one chain is FMA-latency bound).
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

// ---- several tokens: a tiled int8 GEMM on row-interleaved panels ----------------------------
// A chunk of kRowChunk rows is repacked once into a panel of 8-row groups, laid out as llama.cpp's
// repacked x86 kernels lay theirs: per block, 8 vectors, vector j holding values 4j..4j+3 of each of
// the group's 8 rows (one int32 lane a row). One maddubs of vector j with token t's 4 activation
// bytes broadcast to every lane then adds 32 multiply-adds into 8 rows' sums at once, and the
// block's scales are vectors (8 rows' dw times token t's broadcast d, 8 rows' c times its s): no
// horizontal sums and no per-(row, token) scalar scale, where the former 2 rows x 4 tokens tile
// (one row's block a vector) paid a scalar multiply and broadcast per pair.
// Q4_0/Q4_1 bytes are nibbles (0..15): a maddubs lane is at most 2 * 15 * 127 = 3810, so the 8
// vectors of a block sum in int16 (<= 30480) before one madd widens them; Q8_0's |w| reaches 128
// (2 * 128 * 127 = 32512 a lane), so each of its maddubs is widened at once, signs moved onto the
// activations as in the one-token path.
constexpr int64_t kRowChunk = 16;
constexpr int kGroupRows = 8;

struct Panel {
  std::vector<__m256i> w, sign;  // [group][block][j]; sign: Q8_0's signed bytes
  std::vector<__m256> dw, c;     // [group][block]: 8 rows' dw and block-term factor c
};

// r[i] lane j -> r[j] lane i (8 x 8 int32).
inline void transpose8x8(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
    r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
  }
}

template <typename F>
void unpack_panel(const uint8_t* wq, int64_t row_bytes, int64_t blocks, int64_t r0, int64_t rows, Panel& p) {
  constexpr bool kQ8 = std::is_same_v<F, Q8_0>;
  const int64_t groups = (rows + kGroupRows - 1) / kGroupRows;
  p.w.resize(groups * blocks * 8);
  p.dw.resize(groups * blocks);
  p.c.resize(groups * blocks);
  if constexpr (kQ8) p.sign.resize(groups * blocks * 8);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t valid = std::min<int64_t>(kGroupRows, rows - g * kGroupRows);
    for (int64_t b = 0; b < blocks; ++b) {
      __m256i w[8], sign[8];
      alignas(32) float dw[kGroupRows] = {}, c[kGroupRows] = {};
      for (int64_t i = 0; i < kGroupRows; ++i) {
        if (i >= valid) {
          w[i] = sign[i] = _mm256_setzero_si256();
          continue;
        }
        const WBlock k = load_block<F>(wq + (r0 + g * kGroupRows + i) * row_bytes + b * F::kBytes);
        w[i] = k.w;
        if constexpr (kQ8) sign[i] = k.sign;
        dw[i] = k.dw;
        c[i] = k.c;
      }
      transpose8x8(w);
      if constexpr (kQ8) transpose8x8(sign);
      const int64_t at = g * blocks + b;
      for (int j = 0; j < 8; ++j) {
        p.w[8 * at + j] = w[j];
        if constexpr (kQ8) p.sign[8 * at + j] = sign[j];
      }
      p.dw[at] = _mm256_load_ps(dw);
      p.c[at] = _mm256_load_ps(c);
    }
  }
}

inline __m256i x_bytes(const XBlock& xb, int j) {  // activations 4j..4j+3, broadcast to 8 lanes
  int32_t v;
  std::memcpy(&v, xb.q + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

// One block of panel group `at` (its 8 vectors from w) for NT tokens: the integer sums, 8 rows a vector.
template <typename F, int NT>
inline void group_block_sums(const __m256i* w, const __m256i* sign, const XBlock* const* xb, __m256i* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int t = 0; t < NT; ++t) sums[t] = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    for (int t = 0; t < NT; ++t) {
      if constexpr (std::is_same_v<F, Q8_0>) {
        const __m256i q = _mm256_sign_epi8(x_bytes(*xb[t], j), sign[j]);
        sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], q), ones));
      } else {
        sums[t] = _mm256_add_epi16(sums[t], _mm256_maddubs_epi16(w[j], x_bytes(*xb[t], j)));
      }
    }
  }
  if constexpr (!std::is_same_v<F, Q8_0>)
    for (int t = 0; t < NT; ++t) sums[t] = _mm256_madd_epi16(sums[t], ones);
}

// out[t * n + r0 + 8 g + i] for panel group g (8 rows, `valid` of them real) and NT tokens of x (the
// tile's first token's blocks at x, a token's blocks contiguous).
template <typename F, int NT>
inline void group_tile_q8(const Panel& p, int64_t g, int64_t valid, int64_t blocks, const XBlock* x, float* out,
                          int64_t n, int64_t r0) {
  __m256 acc[NT];
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = g * blocks + b;
    const XBlock* xb[NT];
    for (int t = 0; t < NT; ++t) xb[t] = x + t * blocks + b;
    __m256i sums[NT];
    group_block_sums<F, NT>(&p.w[8 * at], std::is_same_v<F, Q8_0> ? &p.sign[8 * at] : nullptr, xb, sums);
    for (int t = 0; t < NT; ++t) {
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[t]), _mm256_mul_ps(p.dw[at], _mm256_set1_ps(xb[t]->d)),
                               acc[t]);
      if constexpr (!std::is_same_v<F, Q8_0>) acc[t] = _mm256_fmadd_ps(p.c[at], _mm256_set1_ps(xb[t]->s), acc[t]);
    }
  }
  float* o = out + r0 + g * kGroupRows;
  for (int t = 0; t < NT; ++t) {
    if (valid == kGroupRows) {
      _mm256_storeu_ps(o + t * n, acc[t]);
    } else {
      alignas(32) float lanes[kGroupRows];
      _mm256_store_ps(lanes, acc[t]);
      for (int64_t i = 0; i < valid; ++i) o[t * n + i] = lanes[i];
    }
  }
}

// out[T, n] for rows [row_begin, row_end) from the quantized activations x[T, blocks]: blocks of
// kTokenBlock tokens (their activations stay in L2 while every row chunk passes over them), each
// chunk's panel (L1) met by kTileTokens tokens at a time.
constexpr int64_t kTokenBlock = 64;
constexpr int kTileTokens = 4;

template <typename F, int NT>
void group_tiles_q8(const Panel& p, int64_t rows, int64_t blocks, const XBlock* x, float* out, int64_t n,
                    int64_t r0) {
  for (int64_t g = 0; g * kGroupRows < rows; ++g)
    group_tile_q8<F, NT>(p, g, std::min<int64_t>(kGroupRows, rows - g * kGroupRows), blocks, x, out, n, r0);
}

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
          case 1: group_tiles_q8<F, 1>(p, rows, blocks, xt, ot, n, c0); break;
          case 2: group_tiles_q8<F, 2>(p, rows, blocks, xt, ot, n, c0); break;
          case 3: group_tiles_q8<F, 3>(p, rows, blocks, xt, ot, n, c0); break;
          default: group_tiles_q8<F, kTileTokens>(p, rows, blocks, xt, ot, n, c0); break;
        }
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

// fn(begin, end) over [0, n) in chunks of `chunk`, handed out to the threads one at a time (an
// atomic counter) rather than split in equal shares up front: on this shared 2-core host a thread
// that is descheduled or slowed leaves its remaining chunks to the other, where a static split made
// the step wait at the barrier for its share.
template <typename Fn>
void parallel_chunks(int64_t n, int64_t chunk, Fn&& fn) {
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) return fn(0, n);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

// Rows per chunk for rows of `row_bytes`: about kChunkBytes of weight (long enough streams for the
// prefetchers, enough chunks to even out two threads), a multiple of `multiple`.
constexpr int64_t kChunkBytes = 64 << 10;

inline int64_t chunk_rows(int64_t row_bytes, int64_t multiple) {
  return std::max<int64_t>(1, kChunkBytes / (row_bytes * multiple)) * multiple;
}

// Rows [0, n) for a product of num_tokens tokens: one token (a memory-bound stream) in shared-out
// chunks, several (compute-bound) in equal shares of `multiple`-row units. (Chosen while the
// extension was built without -fopenmp; with the threads really sharing, the three ways of
// splitting a one-token stream read alike: docs/quantization.md.)
template <typename Fn>
void parallel_rows(int64_t num_tokens, int64_t n, int64_t row_bytes, int64_t multiple, Fn&& fn) {
  if (num_tokens == 1) return parallel_chunks(n, chunk_rows(row_bytes, multiple), fn);
  at::parallel_for(0, n, multiple, fn);
}

// out[T, n] = x[T, k] @ W^T by the integer path, rows split across threads; xq holds x quantized.
inline void matmul_q8(const XBlock* xq, int64_t num_tokens, int64_t k, const uint8_t* wq, int64_t n,
                      float* out, int64_t fmt) {
  dispatch_q8(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t blocks = k / F::kValues, rb = blocks * F::kBytes;
    parallel_rows(num_tokens, n, rb, kRowChunk, [&](int64_t begin, int64_t end) {
      matmul_rows_q8<F>(xq, num_tokens, blocks, wq, rb, out, n, begin, end);
    });
  });
}

}  // namespace twinserve_quant
