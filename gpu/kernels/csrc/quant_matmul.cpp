// The quantized-product ops (formats and kernels: quant_blocks.h, quant_q8.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "parallel_threads.h"

#include "quant_blocks.h"
#include "quant_packed.h"
#include "quant_q8.h"

namespace {

using namespace twinserve_quant;

void check_weight(const at::Tensor& x_or_none, const at::Tensor& wq, const at::Tensor& scale,
                  int64_t k, int64_t row_bytes) {
  TORCH_CHECK(wq.is_contiguous() && wq.dim() == 2 && wq.element_size() == 1,
              "qweight must be a contiguous 2-d byte tensor");
  TORCH_CHECK(wq.size(1) == row_bytes, "qweight rows hold ", wq.size(1), " bytes, the format needs ",
              row_bytes, " for ", k, " inputs");
  if (scale.defined() && scale.numel() > 0)
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                    scale.numel() == wq.size(0), "row_scale must be fp32 [rows]");
  if (x_or_none.defined())
    TORCH_CHECK(x_or_none.scalar_type() == at::kFloat && x_or_none.is_contiguous() &&
                    x_or_none.dim() == 2 && x_or_none.size(1) == k,
                "x must be contiguous fp32 [T, ", k, "]");
}

at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& row_scale,
                        int64_t fmt, int64_t group) {
  const int64_t k = x.size(1), n = qweight.size(0), num_tokens = x.size(0);
  at::Tensor out = at::empty({num_tokens, n}, x.options());
  dispatch(fmt, group, [&](auto f) {
    check_weight(x, qweight, row_scale, k, row_bytes_of<decltype(f)>(k));
  });
  const float* scale = row_scale.numel() > 0 ? row_scale.data_ptr<float>() : nullptr;
  matmul_f32(x.data_ptr<float>(), num_tokens, k, static_cast<const uint8_t*>(qweight.data_ptr()),
             scale, n, out.data_ptr<float>(), fmt, group);
  return out;
}

// x[T, K] fp32 as XBlocks, viewed as bytes [T, K / 32 * 40] (the tests read them).
at::Tensor quantize_q8(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) % 32 == 0,
              "x must be contiguous fp32 [T, K] with K a multiple of 32");
  const int64_t num_tokens = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({num_tokens, k / 32 * static_cast<int64_t>(sizeof(XBlock))},
                             x.options().dtype(at::kByte));
  auto* blocks = reinterpret_cast<XBlock*>(out.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t)
    quantize_row_q8(x.data_ptr<float>() + t * k, k, blocks + t * (k / 32));
  return out;
}

at::Tensor quant_matmul_q8(const at::Tensor& x, const at::Tensor& qweight, int64_t fmt) {
  const int64_t k = x.size(1), n = qweight.size(0), num_tokens = x.size(0);
  dispatch_q8(fmt, [&](auto f) { check_weight(x, qweight, at::Tensor(), k, row_bytes_of<decltype(f)>(k)); });
  const at::Tensor xq = quantize_q8(x);
  at::Tensor out = at::empty({num_tokens, n}, x.options());
  matmul_q8(reinterpret_cast<const XBlock*>(xq.data_ptr()), num_tokens, k,
            static_cast<const uint8_t*>(qweight.data_ptr()), n, out.data_ptr<float>(), fmt);
  return out;
}

at::Tensor quant_dequantize(const at::Tensor& qweight, const at::Tensor& row_scale,
                            const at::Tensor& rows, int64_t fmt, int64_t group, int64_t k) {
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.dim() == 1,
              "rows must be a contiguous int64 vector");
  at::Tensor out = at::empty({rows.size(0), k}, qweight.options().dtype(at::kFloat));
  dispatch(fmt, group, [&](auto f) {
    using F = decltype(f);
    const int64_t rb = row_bytes_of<F>(k);
    check_weight(at::Tensor(), qweight, row_scale, k, rb);
    const int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows.size(0); ++i)
      TORCH_CHECK(rp[i] >= 0 && rp[i] < qweight.size(0), "row ", rp[i], " out of range");
    const float* scale = row_scale.numel() > 0 ? row_scale.data_ptr<float>() : nullptr;
    dequant_rows<F>(static_cast<const uint8_t*>(qweight.data_ptr()), rb, scale, k, rp,
                    rows.size(0), out.data_ptr<float>());
  });
  return out;
}

// The file's rows [n, row_bytes] in the 8-row packed layout (quant_packed.h): [groups, blocks * 8 * kBytes].
at::Tensor quant_pack(const at::Tensor& qweight, int64_t fmt, int64_t k) {
  at::Tensor out;
  dispatch_packed(fmt, [&](auto f) {
    using F = decltype(f);
    check_weight(at::Tensor(), qweight, at::Tensor(), k, row_bytes_of<F>(k));
    const int64_t blocks = k / F::kValues;
    out = at::empty({packed_groups(qweight.size(0)), blocks * kGroupBytes<F>}, qweight.options().dtype(at::kByte));
    pack_rows<F>(static_cast<const uint8_t*>(qweight.data_ptr()), qweight.size(0), blocks,
                 static_cast<uint8_t*>(out.data_ptr()));
  });
  return out;
}

void check_packed(const at::Tensor& packed, int64_t fmt, int64_t rows, int64_t k) {
  dispatch_packed(fmt, [&](auto f) {
    using F = decltype(f);
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 2 && packed.element_size() == 1 &&
                    packed.size(0) == packed_groups(rows) && packed.size(1) == row_bytes_of<F>(k) * kGroupRows,
                "packed weight must be contiguous bytes [", packed_groups(rows), ", ",
                row_bytes_of<F>(k) * kGroupRows, "] for ", rows, " rows of ", k, " inputs");
  });
}

at::Tensor quant_unpack(const at::Tensor& packed, int64_t fmt, int64_t rows, int64_t k) {
  check_packed(packed, fmt, rows, k);
  at::Tensor out;
  dispatch_packed(fmt, [&](auto f) {
    using F = decltype(f);
    out = at::empty({rows, row_bytes_of<F>(k)}, packed.options());
    unpack_rows<F>(static_cast<const uint8_t*>(packed.data_ptr()), rows, k / F::kValues,
                   static_cast<uint8_t*>(out.data_ptr()));
  });
  return out;
}

at::Tensor quant_matmul_q8_packed(const at::Tensor& x, const at::Tensor& packed, int64_t fmt, int64_t rows) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2, "x must be contiguous fp32 [T, K]");
  const int64_t k = x.size(1), num_tokens = x.size(0);
  check_packed(packed, fmt, rows, k);
  const at::Tensor xq = quantize_q8(x);
  at::Tensor out = at::empty({num_tokens, rows}, x.options());
  matmul_q8_packed(reinterpret_cast<const XBlock*>(xq.data_ptr()), num_tokens, k,
                   static_cast<const uint8_t*>(packed.data_ptr()), rows, out.data_ptr<float>(), fmt);
  return out;
}

int64_t quant_parallel_threads(int64_t n) { return parallel_threads_seen(n); }

}  // namespace

TORCH_LIBRARY(twinserve_quant, m) {
  m.def("quant_matmul(Tensor x, Tensor qweight, Tensor row_scale, int fmt, int group) -> Tensor");
  m.def("quantize_q8(Tensor x) -> Tensor");
  m.def("quant_matmul_q8(Tensor x, Tensor qweight, int fmt) -> Tensor");
  m.def("quant_dequantize(Tensor qweight, Tensor row_scale, Tensor rows, int fmt, int group, "
        "int k) -> Tensor");
  m.def("quant_pack(Tensor qweight, int fmt, int k) -> Tensor");
  m.def("quant_unpack(Tensor packed, int fmt, int rows, int k) -> Tensor");
  m.def("quant_matmul_q8_packed(Tensor x, Tensor packed, int fmt, int rows) -> Tensor");
  m.def("quant_parallel_threads(int n) -> int");
}

TORCH_LIBRARY_IMPL(twinserve_quant, CPU, m) {
  m.impl("quant_matmul", &quant_matmul);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quantize_q8", &quantize_q8);
  m.impl("quant_matmul_q8", &quant_matmul_q8);
  m.impl("quant_pack", &quant_pack);
  m.impl("quant_unpack", &quant_unpack);
  m.impl("quant_matmul_q8_packed", &quant_matmul_q8_packed);
}

TORCH_LIBRARY_IMPL(twinserve_quant, CatchAll, m) {
  m.impl("quant_parallel_threads", &quant_parallel_threads);
}
