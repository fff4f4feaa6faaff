// The quantized block formats and their fp32-activation products, shared by quant_matmul.cpp
// (the per-product ops) and fused_decode.cpp (a whole decode step in one call).
//
// Quantized weight products for the CPU backend: y[T, N] = x[T, K] @ dequant(W)[N, K]^T, with the
// weight kept in its quantized blocks. Each block is dequantized into a small float buffer (L1)
// and multiplied with every token's slice of x at once, accumulating in fp32, so a block is read
// and decoded once per call whatever the token count. Rows are split across threads.
//
// Formats (gpu/quantization/formats.py keeps the same ids):
//   0 Q8_0  32 values, 34 bytes: fp16 d, int8 q[32]            y = d * q
//   1 Q4_0  32 values, 18 bytes: fp16 d, u8 qs[16]              y = d * (nibble - 8)
//   2 Q4_1  32 values, 20 bytes: fp16 d, fp16 m, u8 qs[16]      y = d * nibble + m
//   3 Q4_K  256 values, 144 bytes: fp16 d, fp16 dmin, u8 scales[12], u8 qs[128]
//   4 Q6_K  256 values, 210 bytes: u8 ql[128], u8 qh[64], int8 scales[16], fp16 d
//   5 I8    int8 per value, one fp32 scale per row (row_scale)
//   6 F8    float8 e4m3fn per value, one fp32 scale per row (row_scale)
//   7 U4    GPTQ/AWQ repacked, groups of `group` values: fp32 d, fp32 m, u8 qs[group / 2],
//           each 32 values as Q4_1's nibbles (byte j: value j low, value j + 16 high)
// Q4 nibbles as llama.cpp (ggml-quants.c): byte j of a 32-block holds value j (low) and j + 16.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace twinserve_quant {

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline float f32_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void nibbles32(const uint8_t* qs, float d, float m, float* w) {
  for (int j = 0; j < 16; ++j) {
    w[j] = d * static_cast<float>(qs[j] & 0xF) + m;
    w[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

struct Q8_0 {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 32, kBytes = 34;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(q[j]);
  }
};

struct Q4_0 {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 32, kBytes = 18;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const float d = half_at(b);
    nibbles32(b + 2, d, -8.f * d, w);
  }
};

struct Q4_1 {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 32, kBytes = 20;
  static void decode(const uint8_t* b, float* w, int64_t) { nibbles32(b + 4, half_at(b), half_at(b + 2), w); }
};

inline void scale_min_k4(int j, const uint8_t* q, int& d, int& m) {
  if (j < 4) {
    d = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Q4_K {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 256, kBytes = 144;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
      int sc, m;
      scale_min_k4(is, scales, sc, m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(is + 1, scales, sc, m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) w[j + l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) w[j + 32 + l] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
};

struct Q6_K {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 256, kBytes = 210;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        w[n + l] = d * static_cast<float>(sc[is] * q1);
        w[n + l + 32] = d * static_cast<float>(sc[is + 2] * q2);
        w[n + l + 64] = d * static_cast<float>(sc[is + 4] * q3);
        w[n + l + 96] = d * static_cast<float>(sc[is + 6] * q4);
      }
    }
  }
};

// Row-scaled formats decode unscaled values; the row's scale multiplies the finished sums.
struct I8 {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 32, kBytes = 32;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b);
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(q[j]);
  }
};

struct F8Table {
  std::array<float, 256> v;
  F8Table() {
    for (int i = 0; i < 256; ++i) {
      const int sign = i >> 7, exp = (i >> 3) & 0xF, man = i & 7;
      float x = exp == 0 ? std::ldexp(man / 8.f, -6) : std::ldexp(1.f + man / 8.f, exp - 7);
      if (exp == 15 && man == 7) x = NAN;  // e4m3fn: no infinities, one NaN pattern
      v[i] = sign ? -x : x;
    }
  }
};

inline const F8Table& f8_table() {
  static const F8Table table;  // immutable after construction
  return table;
}

struct F8 {
  static constexpr bool kIsU4 = false;
  static constexpr int64_t kValues = 32, kBytes = 32;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const float* t = f8_table().v.data();
    for (int j = 0; j < 32; ++j) w[j] = t[b[j]];
  }
};

template <int64_t G>
struct U4 {
  static constexpr bool kIsU4 = true;
  static constexpr int64_t kValues = G, kBytes = 8 + G / 2;
  static void decode(const uint8_t* b, float* w, int64_t) {
    const float d = f32_at(b), m = f32_at(b + 4);
    for (int64_t s = 0; s < G; s += 32) nibbles32(b + 8 + s / 2, d, m, w + s);
  }
};

// ---- products: acc[t] (8 fp32 lanes) += w . x[t, block] for NT tokens --------------------------
// The Q4/Q8/I8/F8/U4 blocks are decoded straight into registers (AVX2 + F16C + FMA); Q4_K and
// Q6_K decode into a stack buffer first (their sub-block scales make a register decode long).
template <int NT>
inline void fma_tokens(const __m256* w, int nvec, const float* x, int64_t xs, __m256* acc) {
  for (int t = 0; t < NT; ++t)
    for (int v = 0; v < nvec; ++v)
      acc[t] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(x + t * xs + 8 * v), acc[t]);
}

// 32 values of Q4 nibbles (byte j: value j low, j + 16 high) as d * q + m.
inline void q4_vectors(const uint8_t* qs, __m256 d, __m256 m, __m256* w) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
}

// 32 int8 values as floats.
inline void i8_vectors(const uint8_t* q, __m256* w) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
}

// 32 e4m3fn values as 2^-8 times their value: the byte's exponent and mantissa shifted into an
// fp16's (bias 15 against 7, subnormals included) and widened by F16C; the row scale carries
// the 2^8.
inline void f8_vectors(const uint8_t* q, __m256* w) {
  for (int h = 0; h < 2; ++h) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
    const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8);
    const __m256i bits = _mm256_or_si256(mag, sign);
    w[2 * h] = _mm256_cvtph_ps(_mm256_castsi256_si128(bits));
    w[2 * h + 1] = _mm256_cvtph_ps(_mm256_extracti128_si256(bits, 1));
  }
}
constexpr float kF8RowScale = 256.f;

template <typename F, int NT>
inline void buffered_dots(const uint8_t* b, const float* x, int64_t xs, __m256* acc) {
  alignas(32) float w[F::kValues];
  F::decode(b, w, 0);
  for (int64_t i = 0; i < F::kValues; i += 32) {
    __m256 v[4] = {_mm256_load_ps(w + i), _mm256_load_ps(w + i + 8), _mm256_load_ps(w + i + 16),
                   _mm256_load_ps(w + i + 24)};
    fma_tokens<NT>(v, 4, x + i, xs, acc);
  }
}

template <typename F, int NT>
inline void block_dots(const uint8_t* b, const float* x, int64_t xs, __m256* acc) {
  __m256 w[4];
  if constexpr (std::is_same_v<F, Q8_0>) {
    i8_vectors(b + 2, w);
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (auto& v : w) v = _mm256_mul_ps(v, d);
    fma_tokens<NT>(w, 4, x, xs, acc);
  } else if constexpr (std::is_same_v<F, Q4_0>) {
    const float d = half_at(b);
    q4_vectors(b + 2, _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d), w);
    fma_tokens<NT>(w, 4, x, xs, acc);
  } else if constexpr (std::is_same_v<F, Q4_1>) {
    q4_vectors(b + 4, _mm256_set1_ps(half_at(b)), _mm256_set1_ps(half_at(b + 2)), w);
    fma_tokens<NT>(w, 4, x, xs, acc);
  } else if constexpr (std::is_same_v<F, I8>) {
    i8_vectors(b, w);
    fma_tokens<NT>(w, 4, x, xs, acc);
  } else if constexpr (std::is_same_v<F, F8>) {
    f8_vectors(b, w);
    fma_tokens<NT>(w, 4, x, xs, acc);
  } else if constexpr (F::kIsU4) {
    const __m256 d = _mm256_set1_ps(f32_at(b)), m = _mm256_set1_ps(f32_at(b + 4));
    for (int64_t s = 0; s < F::kValues; s += 32) {
      q4_vectors(b + 8 + s / 2, d, m, w);
      fma_tokens<NT>(w, 4, x + s, xs, acc);
    }
  } else {
    buffered_dots<F, NT>(b, x, xs, acc);
  }
}

inline float lanes_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

// RT rows x NT tokens: RT * NT independent accumulator chains (at one token a single chain is
// FMA-latency bound: four rows at once ran ~2x faster here).
template <typename F, int NT, int RT>
void rows_block(const float* x, int64_t k, const uint8_t* wq, int64_t row_bytes, const float* row_scale,
                float* out, int64_t n, int64_t r0) {
  const int64_t blocks = k / F::kValues;
  const float fixed = std::is_same_v<F, F8> ? kF8RowScale : 1.f;
  __m256 acc[RT][NT];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  const uint8_t* rows = wq + r0 * row_bytes;
  for (int64_t b = 0; b < blocks; ++b)
    for (int r = 0; r < RT; ++r)
      block_dots<F, NT>(rows + r * row_bytes + b * F::kBytes, x + b * F::kValues, k, acc[r]);
  for (int r = 0; r < RT; ++r) {
    const float s = (row_scale ? row_scale[r0 + r] : 1.f) * fixed;
    for (int t = 0; t < NT; ++t) out[t * n + r0 + r] = lanes_sum(acc[r][t]) * s;
  }
}

template <typename F, int NT>
void rows_tile(const float* x, int64_t k, const uint8_t* wq, int64_t row_bytes,
               const float* row_scale, float* out, int64_t n, int64_t row_begin, int64_t row_end) {
  constexpr int RT = NT == 1 ? 4 : (NT == 2 ? 2 : 1);
  int64_t r = row_begin;
  for (; r + RT <= row_end; r += RT) rows_block<F, NT, RT>(x, k, wq, row_bytes, row_scale, out, n, r);
  for (; r < row_end; ++r) rows_block<F, NT, 1>(x, k, wq, row_bytes, row_scale, out, n, r);
}

constexpr int kTile = 4;  // tokens per pass over the weights (accumulators held in registers)

template <typename F>
void matmul_rows(const float* x, int64_t num_tokens, int64_t k, const uint8_t* wq,
                 int64_t row_bytes, const float* row_scale, float* out, int64_t n,
                 int64_t row_begin, int64_t row_end) {
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kTile) {
    const float* xt = x + t0 * k;
    float* ot = out + t0 * n;
    switch (std::min<int64_t>(kTile, num_tokens - t0)) {
      case 1: rows_tile<F, 1>(xt, k, wq, row_bytes, row_scale, ot, n, row_begin, row_end); break;
      case 2: rows_tile<F, 2>(xt, k, wq, row_bytes, row_scale, ot, n, row_begin, row_end); break;
      case 3: rows_tile<F, 3>(xt, k, wq, row_bytes, row_scale, ot, n, row_begin, row_end); break;
      default: rows_tile<F, 4>(xt, k, wq, row_bytes, row_scale, ot, n, row_begin, row_end); break;
    }
  }
}

// One block's values into w[kValues] (fp32), by the register decoders where there is one; F8's
// come out 2^-8 times too small, as in the products (the caller applies kF8RowScale).
template <typename F>
inline void block_store(const uint8_t* b, float* o) {
  __m256 w[4];
  if constexpr (std::is_same_v<F, Q8_0>) {
    i8_vectors(b + 2, w);
    const __m256 d = _mm256_set1_ps(half_at(b));
    for (auto& v : w) v = _mm256_mul_ps(v, d);
  } else if constexpr (std::is_same_v<F, Q4_0>) {
    const float d = half_at(b);
    q4_vectors(b + 2, _mm256_set1_ps(d), _mm256_set1_ps(-8.f * d), w);
  } else if constexpr (std::is_same_v<F, Q4_1>) {
    q4_vectors(b + 4, _mm256_set1_ps(half_at(b)), _mm256_set1_ps(half_at(b + 2)), w);
  } else if constexpr (std::is_same_v<F, I8>) {
    i8_vectors(b, w);
  } else if constexpr (std::is_same_v<F, F8>) {
    f8_vectors(b, w);
  } else if constexpr (F::kIsU4) {
    const __m256 d = _mm256_set1_ps(f32_at(b)), m = _mm256_set1_ps(f32_at(b + 4));
    for (int64_t s = 0; s < F::kValues; s += 32) {
      q4_vectors(b + 8 + s / 2, d, m, w);
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(o + s + 8 * v, w[v]);
    }
    return;
  } else {
    F::decode(b, o, 0);
    return;
  }
  for (int v = 0; v < 4; ++v) _mm256_storeu_ps(o + 8 * v, w[v]);
}

template <typename F>
void dequant_rows(const uint8_t* wq, int64_t row_bytes, const float* row_scale, int64_t k,
                  const int64_t* rows, int64_t num_rows, float* out) {
  const float fixed = std::is_same_v<F, F8> ? kF8RowScale : 1.f;
  at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = rows[i];
      const uint8_t* row = wq + r * row_bytes;
      float* o = out + i * k;
      for (int64_t b = 0; b < k / F::kValues; ++b) block_store<F>(row + b * F::kBytes, o + b * F::kValues);
      const float s = (row_scale ? row_scale[r] : 1.f) * fixed;
      if (s != 1.f)
        for (int64_t j = 0; j < k; ++j) o[j] *= s;
    }
  });
}

template <typename Fn>
void dispatch(int64_t fmt, int64_t group, Fn&& fn) {
  switch (fmt) {
    case 0: return fn(Q8_0{});
    case 1: return fn(Q4_0{});
    case 2: return fn(Q4_1{});
    case 3: return fn(Q4_K{});
    case 4: return fn(Q6_K{});
    case 5: return fn(I8{});
    case 6: return fn(F8{});
    case 7:
      if (group == 32) return fn(U4<32>{});
      if (group == 64) return fn(U4<64>{});
      if (group == 128) return fn(U4<128>{});
      TORCH_CHECK(false, "U4 group size must be 32, 64 or 128, got ", group);
    default: TORCH_CHECK(false, "unknown quantized format id ", fmt);
  }
}

template <typename F>
int64_t row_bytes_of(int64_t k) {
  TORCH_CHECK(k % F::kValues == 0, "input size ", k, " is not a multiple of the block size ",
              F::kValues);
  return k / F::kValues * F::kBytes;
}

// out[T, n] = x[T, k] @ dequant(W)^T with fp32 activations, rows split across threads.
inline void matmul_f32(const float* x, int64_t num_tokens, int64_t k, const uint8_t* wq,
                       const float* row_scale, int64_t n, float* out, int64_t fmt, int64_t group) {
  dispatch(fmt, group, [&](auto f) {
    using F = decltype(f);
    const int64_t rb = row_bytes_of<F>(k);
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      matmul_rows<F>(x, num_tokens, k, wq, rb, row_scale, out, n, begin, end);
    });
  });
}

}  // namespace twinserve_quant
