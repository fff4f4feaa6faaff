// How many of ATen's threads an at::parallel_for over `n` items runs on, in the extension that
// includes this (1 where it is built without OpenMP: at::parallel_for then calls its body on the
// calling thread).
#pragma once

#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

inline int64_t parallel_threads_seen(int64_t n) {
  std::atomic<int64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) {
    const int64_t bit = int64_t{1} << std::min(at::get_thread_num(), 62);
    seen.fetch_or(bit, std::memory_order_relaxed);
  });
  return __builtin_popcountll(static_cast<unsigned long long>(seen.load()));
}
