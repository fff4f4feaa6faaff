// Q4_0 and Q4_1 weights repacked once (at load) into 8-row groups, the layout the integer
// products (quant_q8.h) stream best; the file's row layout stays the plain reference (the
// repack round-trips exactly, and the products equal those on the file's rows: the tests check both).
//
// Rows are grouped 8 at a time (the last group padded with zero blocks); group g's blocks lie one
// after another, each block of the group (kGroupBytes: 8 blocks' bytes) as
//
//   Q4_1: fp16 dw[8] | fp16 m[8] | P0 P1 P2 P3      (16 + 16 + 128 = 160 bytes = 8 x 20)
//   Q4_0: fp16 dw[8] |             P0 P1 P2 P3      (16 + 128 = 144 bytes = 8 x 18)
//
// where vector Pj (32 bytes) holds in int32 lane i bytes qs[4j..4j+3] of row i. Its low nibbles
// are values 4j..4j+3 and its high ones values 16+4j..16+4j+3 (a byte holds value j and j + 16),
// so an AND and a shift give the 8 vectors of quant_q8.h's panel (vector j: values 4j..4j+3 of
// the 8 rows, one int32 lane a row) straight from memory, without unpack_panel's pass; the
// scales of 8 rows convert with one vcvtph2ps. One token then costs per 8 row-blocks 4 loads,
// 4 shifts, 8 ANDs, 8 maddubs, 7 int16 adds, one madd and 2-3 vector FMAs, where streaming one row
// at a time (quant_q8.h) costs ~12 instructions a row-block, two of them scalar fp16 conversions.
#pragma once

#include "quant_q8.h"

namespace twinserve_quant {

template <typename F>
constexpr bool kPackable = std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1>;

inline bool packable(int64_t fmt) { return fmt == 1 || fmt == 2; }

template <typename F>
constexpr int64_t kGroupBytes = kGroupRows * F::kBytes;

template <typename F>
constexpr int64_t kScaleBytes = std::is_same_v<F, Q4_1> ? 32 : 16;  // the group block's head

inline int64_t packed_groups(int64_t rows) { return (rows + kGroupRows - 1) / kGroupRows; }

// The file's rows [rows, blocks * kBytes] into groups [groups, blocks * kGroupBytes].
template <typename F>
void pack_rows(const uint8_t* wq, int64_t rows, int64_t blocks, uint8_t* out) {
  const int64_t rb = blocks * F::kBytes;
  at::parallel_for(0, packed_groups(rows), 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* o = out + (g * blocks + b) * kGroupBytes<F>;
        std::memset(o, 0, kGroupBytes<F>);
        for (int64_t i = 0; i < kGroupRows && g * kGroupRows + i < rows; ++i) {
          const uint8_t* src = wq + (g * kGroupRows + i) * rb + b * F::kBytes;
          std::memcpy(o + 2 * i, src, 2);                                            // dw
          if constexpr (std::is_same_v<F, Q4_1>) std::memcpy(o + 16 + 2 * i, src + 2, 2);  // m
          const uint8_t* qs = src + F::kBytes - 16;
          for (int j = 0; j < 4; ++j) std::memcpy(o + kScaleBytes<F> + 32 * j + 4 * i, qs + 4 * j, 4);
        }
      }
  });
}

// The inverse of pack_rows (the round-trip test).
template <typename F>
void unpack_rows(const uint8_t* packed, int64_t rows, int64_t blocks, uint8_t* wq) {
  const int64_t rb = blocks * F::kBytes;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t g = r / kGroupRows, i = r % kGroupRows;
      const uint8_t* o = packed + (g * blocks + b) * kGroupBytes<F>;
      uint8_t* dst = wq + r * rb + b * F::kBytes;
      std::memcpy(dst, o + 2 * i, 2);
      if constexpr (std::is_same_v<F, Q4_1>) std::memcpy(dst + 2, o + 16 + 2 * i, 2);
      uint8_t* qs = dst + F::kBytes - 16;
      for (int j = 0; j < 4; ++j) std::memcpy(qs + 4 * j, o + kScaleBytes<F> + 32 * j + 4 * i, 4);
    }
}

// The 8 panel vectors of one group block (vector j: values 4j..4j+3 of the 8 rows).
template <typename F>
inline void packed_vectors(const uint8_t* blk, __m256i* w) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kScaleBytes<F> + 32 * j));
    w[j] = _mm256_and_si256(p, m4);
    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
  }
}

inline __m256 halves8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// acc (8 rows) += one group block's dot with one token's activation block.
template <typename F>
inline void packed_block_one(const uint8_t* blk, const XBlock& xb, __m256& acc) {
  __m256i w[8];
  packed_vectors<F>(blk, w);
  __m256i s = _mm256_maddubs_epi16(w[0], x_bytes(xb, 0));
  for (int j = 1; j < 8; ++j) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], x_bytes(xb, j)));
  const __m256 sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, _mm256_set1_epi16(1)));
  const __m256 dw = halves8(blk);
  if constexpr (std::is_same_v<F, Q4_1>) {
    acc = _mm256_fmadd_ps(dw, _mm256_mul_ps(sums, _mm256_set1_ps(xb.d)), acc);
    acc = _mm256_fmadd_ps(halves8(blk + 16), _mm256_set1_ps(xb.s), acc);
  } else {  // w = dw * (n - 8): dw * (d * sum(n q) - 8 s)
    acc = _mm256_fmadd_ps(dw, _mm256_fmadd_ps(sums, _mm256_set1_ps(xb.d), _mm256_set1_ps(-8.f * xb.s)), acc);
  }
}

inline void store_rows(float* o, __m256 v, int64_t valid) {
  if (valid == kGroupRows) return _mm256_storeu_ps(o, v);
  alignas(32) float lanes[kGroupRows];
  _mm256_store_ps(lanes, v);
  for (int64_t i = 0; i < valid; ++i) o[i] = lanes[i];
}

// One token, groups [g0, g1): each group's blocks streamed once in memory order, prefetched ahead.
template <typename F>
void packed_one_token(const XBlock* x, int64_t blocks, const uint8_t* packed, int64_t rows, float* out,
                      int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* p = packed + g * blocks * kGroupBytes<F>;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= blocks; b += 2) {
      const uint8_t* blk = p + b * kGroupBytes<F>;
      for (int64_t off = 0; off < 2 * kGroupBytes<F>; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + off), _MM_HINT_T0);
      packed_block_one<F>(blk, x[b], a0);
      packed_block_one<F>(blk + kGroupBytes<F>, x[b + 1], a1);
    }
    if (b < blocks) packed_block_one<F>(p + b * kGroupBytes<F>, x[b], a0);
    store_rows(out + g * kGroupRows, _mm256_add_ps(a0, a1), std::min<int64_t>(kGroupRows, rows - g * kGroupRows));
  }
}

#ifndef TWINSERVE_PACKED_TILE
#define TWINSERVE_PACKED_TILE 4
#endif
constexpr int kPackedTileTokens = TWINSERVE_PACKED_TILE;

// group_tile_q8 for nt <= NT tokens (NT a compile-time tile, nt the tokens left).
template <typename F, int NT>
inline void panel_tile(int64_t nt, const Panel& panel, int64_t valid, int64_t blocks, const XBlock* x, float* out,
                       int64_t n, int64_t r0) {
  if constexpr (NT > 1)
    if (nt < NT) return panel_tile<F, NT - 1>(nt, panel, valid, blocks, x, out, n, r0);
  group_tile_q8<F, NT>(panel, 0, valid, blocks, x, out, n, r0);
}

// Several tokens, groups [g0, g1): blocks of kTokenBlock tokens (L2); each group's blocks are
// decoded once per token block into a one-group Panel (L1: the AND/shift and the fp16 scales
// leave the inner loop, which is quant_q8.h's group_tile_q8) and met by kTileTokens tokens at a time.
template <typename F>
void packed_tokens(const XBlock* x, int64_t num_tokens, int64_t blocks, const uint8_t* packed, int64_t n,
                   float* out, int64_t g0, int64_t g1) {
  Panel panel;
  panel.w.resize(blocks * 8);
  panel.dw.resize(blocks);
  panel.c.resize(blocks);
  for (int64_t tb = 0; tb < num_tokens; tb += kTokenBlock) {
    const int64_t tokens = std::min(kTokenBlock, num_tokens - tb);
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* p = packed + g * blocks * kGroupBytes<F>;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* blk = p + b * kGroupBytes<F>;
        packed_vectors<F>(blk, &panel.w[8 * b]);
        panel.dw[b] = halves8(blk);
        panel.c[b] = std::is_same_v<F, Q4_1> ? halves8(blk + 16) : _mm256_mul_ps(panel.dw[b], _mm256_set1_ps(-8.f));
      }
      const int64_t valid = std::min<int64_t>(kGroupRows, n - g * kGroupRows), r0 = g * kGroupRows;
      for (int64_t t0 = 0; t0 < tokens; t0 += kPackedTileTokens)
        panel_tile<F, kPackedTileTokens>(tokens - t0, panel, valid, blocks, x + (tb + t0) * blocks,
                                         out + (tb + t0) * n, n, r0);
    }
  }
}

template <typename Fn>
void dispatch_packed(int64_t fmt, Fn&& fn) {
  switch (fmt) {
    case 1: return fn(Q4_0{});
    case 2: return fn(Q4_1{});
    default: TORCH_CHECK(false, "the 8-row packed layout covers Q4_0 and Q4_1, not format id ", fmt);
  }
}

// out[T, n] = x[T, k] @ W^T on the packed layout (n the real rows), group chunks shared out to the threads.
inline void matmul_q8_packed(const XBlock* xq, int64_t num_tokens, int64_t k, const uint8_t* packed, int64_t n,
                             float* out, int64_t fmt) {
  dispatch_packed(fmt, [&](auto f) {
    using F = decltype(f);
    const int64_t blocks = k / F::kValues;
    parallel_rows(num_tokens, packed_groups(n), blocks * kGroupBytes<F>, 1, [&](int64_t g0, int64_t g1) {
      if (num_tokens == 1) packed_one_token<F>(xq, blocks, packed, n, out, g0, g1);
      else packed_tokens<F>(xq, num_tokens, blocks, packed, n, out, g0, g1);
    });
  });
}

}  // namespace twinserve_quant
