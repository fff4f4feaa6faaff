// Paged decode attention for the CPU backend: one query token per sequence, attending to its whole
// context straight from the paged KV cache. Each (sequence, KV head) pair reads its keys and values
// once, in place: no gathered copy, no padding to the batch's longest context.
//
// Layout (gpu/worker/kv_cache.py): key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim];
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

#include "parallel_threads.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "paged_attention.h"

namespace {

using namespace twinserve_attention;

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

int64_t cpu_parallel_threads(int64_t n) { return parallel_threads_seen(n); }

}  // namespace

TORCH_LIBRARY(twinserve_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, float scale, int window=0, "
        "float softcap=0.0) -> Tensor");
  m.def("cpu_parallel_threads(int n) -> int");
}

TORCH_LIBRARY_IMPL(twinserve_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}

TORCH_LIBRARY_IMPL(twinserve_cpu, CatchAll, m) {
  m.impl("cpu_parallel_threads", &cpu_parallel_threads);
}
