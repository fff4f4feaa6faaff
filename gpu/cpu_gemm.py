"""The model's weight products, shaped for where torch's default CPU path is slow.

Measured on this machine's 2-core AVX2 EPYC with torch's CPU kernels, per weight product:

- fp32, 8+ tokens: one GEMM with a wide output ran well below the FLOP rate of narrow slabs
  (64 x 576 x 49152: 80 ms vs 40 ms), so the product is computed in slabs of ``CPU_GEMM_SLAB``
  weight rows, feature-major (``[out_features, T]``).
- bf16/fp16 where the CPU has no native half matmuls (no avx512_bf16 / AMX): torch emulates the
  GEMM, 2.8x slower than fp32 at 64 tokens and 4.8x at 256. With 8+ tokens each slab of weights is
  widened to fp32 while it sits in cache, multiplied in fp32 and the output rounded back: what a
  native bf16 GEMM computes (half inputs, fp32 accumulation), 1.1x the fp32 time.
- Below 8 tokens the product is a GEMV bound by memory bandwidth, and torch's own half GEMV reads
  half the bytes: 2.5x faster than fp32 at 1 token. One plain call does as well as slabs there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

CPU_GEMM_SLAB = 1024
MIN_SLAB_TOKENS = 8
HALF_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class Gemm:
    """How one model's weight products run: ``slabs`` on CPU; ``widen_half`` where its half
    weights live on a CPU without native half matmuls."""
    slabs: bool
    widen_half: bool

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> Gemm:
        on_cpu = device.type == "cpu"
        return cls(slabs=on_cpu,
                   widen_half=on_cpu and dtype in HALF_DTYPES and not cpu_has_native_bf16())

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: ``[T, out_features]``; ``x`` may be a transposed view."""
        if not (self.widen_half and x.shape[0] >= MIN_SLAB_TOKENS):
            return F.linear(x, weight, bias)
        x32 = x.float()
        out = x.new_empty(x.shape[0], weight.shape[0])
        for start in range(0, weight.shape[0], CPU_GEMM_SLAB):
            stop = start + CPU_GEMM_SLAB
            out[:, start:stop] = F.linear(x32, weight[start:stop].float(),
                                          None if bias is None else bias[start:stop].float())
        return out

    def feature_major(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight).t()``, contiguous ``[out_features, T]``."""
        if not (self.slabs and x.shape[0] >= MIN_SLAB_TOKENS):
            return F.linear(x, weight).t().contiguous()
        out = x.new_empty(weight.shape[0], x.shape[0])
        if not self.widen_half:
            for start in range(0, weight.shape[0], CPU_GEMM_SLAB):
                rows = weight[start:start + CPU_GEMM_SLAB]
                torch.mm(rows, x.t(), out=out[start:start + rows.shape[0]])
            return out
        x32_t = x.float().t()
        for start in range(0, weight.shape[0], CPU_GEMM_SLAB):
            stop = start + CPU_GEMM_SLAB
            out[start:stop] = torch.mm(weight[start:stop].float(), x32_t)
        return out


def cpu_has_native_bf16() -> bool:
    """Whether /proc/cpuinfo lists avx512_bf16 or amx_bf16 (False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False
