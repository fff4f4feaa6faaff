"""Quantized matrix-vector / small-batch products on CUDA: a Triton kernel over the same byte
layouts as the CPU kernel (``formats.py``): Q8_0, Q4_0, Q4_1 (GGUF), int8 and fp8 e4m3 with row
scales, and the GPTQ/AWQ U4 groups. Q4_K and Q6_K are not implemented here (the CPU kernel runs
them); ``quant_matmul_triton`` refuses them by name.

One program computes ``BLOCK_N`` output rows for one token: for each 32-value block it loads the
rows' scale bytes and packed values, decodes them in registers (fp16 scales rebuilt from their
bytes, nibbles split, e4m3 widened through fp16 bits) and accumulates ``w * x`` in fp32.
Tested in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors; ``benchmarks/cuda_check.sh``
runs the same checks on a GPU.
"""

from __future__ import annotations

import torch

from twinserve.gpu.kernels.triton_support import (
    HAS_TRITON,
    check_launchable,
    kernel_is_interpreted,
    tl,
    triton,
)
from twinserve.gpu.quantization.formats import QuantFormat

SUPPORTED = ("Q8_0", "Q4_0", "Q4_1", "int8", "fp8_e4m3", "u4g32", "u4g64", "u4g128")
BLOCK_N = 32

if HAS_TRITON:
    @triton.jit
    def _half_at(ptr, offs, mask):
        lo = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _f32_at(ptr, offs, mask):
        b0 = tl.load(ptr + offs, mask=mask, other=0).to(tl.uint32)
        b1 = tl.load(ptr + offs + 1, mask=mask, other=0).to(tl.uint32)
        b2 = tl.load(ptr + offs + 2, mask=mask, other=0).to(tl.uint32)
        b3 = tl.load(ptr + offs + 3, mask=mask, other=0).to(tl.uint32)
        return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def _quant_matvec_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, N, K, row_bytes,
                             FMT: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr):
        pid_n = tl.program_id(0)
        t = tl.program_id(1)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        j = tl.arange(0, 32)  # values of one block
        byte_j = j % 16  # Q4 layout: byte j holds value j (low) and j + 16 (high)
        high = j >= 16
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        row_base = rows.to(tl.int64) * row_bytes
        mask2 = row_ok[:, None]
        for b in range(0, K // 32):
            if FMT == 0:  # Q8_0: fp16 d, int8 q[32]
                base = row_base + b * 34
                d = _half_at(w_ptr, base, row_ok)
                q = tl.load(w_ptr + base[:, None] + 2 + j[None, :], mask=mask2, other=0)
                w = q.to(tl.int8, bitcast=True).to(tl.float32) * d[:, None]
            elif FMT == 1 or FMT == 2:  # Q4_0: d, qs[16]; Q4_1: d, m, qs[16]
                base = row_base + b * (18 if FMT == 1 else 20)
                d = _half_at(w_ptr, base, row_ok)
                if FMT == 1:
                    m = -8.0 * d
                    qs_off = 2
                else:
                    m = _half_at(w_ptr, base + 2, row_ok)
                    qs_off = 4
                raw = tl.load(w_ptr + base[:, None] + qs_off + byte_j[None, :], mask=mask2,
                              other=0).to(tl.int32)
                nib = tl.where(high[None, :], raw >> 4, raw & 0xF)
                w = nib.to(tl.float32) * d[:, None] + m[:, None]
            elif FMT == 5:  # int8 per row
                q = tl.load(w_ptr + row_base[:, None] + b * 32 + j[None, :], mask=mask2, other=0)
                w = q.to(tl.int8, bitcast=True).to(tl.float32)
            elif FMT == 6:  # e4m3fn: magnitude bits into an fp16's, x 2^8 after (row scale)
                q = tl.load(w_ptr + row_base[:, None] + b * 32 + j[None, :], mask=mask2,
                            other=0).to(tl.uint16)
                bits = ((q & 0x7F) << 7) | ((q & 0x80) << 8)
                w = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            else:  # U4 groups of GROUP: fp32 d, fp32 m, GROUP / 2 nibble bytes
                g = (b * 32) // GROUP
                base = row_base + g * (8 + GROUP // 2)
                d = _f32_at(w_ptr, base, row_ok)
                m = _f32_at(w_ptr, base + 4, row_ok)
                sub = ((b * 32) % GROUP) // 2
                raw = tl.load(w_ptr + base[:, None] + 8 + sub + byte_j[None, :], mask=mask2,
                              other=0).to(tl.int32)
                nib = tl.where(high[None, :], raw >> 4, raw & 0xF)
                w = nib.to(tl.float32) * d[:, None] + m[:, None]
            x = tl.load(x_ptr + t * K + b * 32 + j).to(tl.float32)
            acc += tl.sum(w * x[None, :], axis=1)
        if FMT == 5 or FMT == 6:
            acc = acc * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        tl.store(out_ptr + t * N + rows, acc, mask=row_ok)


def is_interpreted() -> bool:
    return HAS_TRITON and kernel_is_interpreted(_quant_matvec_kernel)


def quant_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, row_scale: torch.Tensor,
                        fmt: QuantFormat) -> torch.Tensor:
    """``x[T, K] @ dequant(W).T`` in fp32 ``[T, N]`` (``W``: ``[N, row_bytes]`` uint8)."""
    check_launchable(qweight, "quantization.triton_quant", HAS_TRITON, is_interpreted())
    if fmt.name not in SUPPORTED:
        raise ValueError(f"the Triton quantized kernel does not implement {fmt.name}; "
                         f"supported: {', '.join(SUPPORTED)}.")
    x = x.float().contiguous()
    num_tokens, k = x.shape
    if qweight.dtype != torch.uint8 or qweight.shape[1] != fmt.row_bytes(k):
        raise ValueError(f"qweight must be uint8 [N, {fmt.row_bytes(k)}] for {k} inputs, got "
                         f"{qweight.dtype} {tuple(qweight.shape)}.")
    n = qweight.shape[0]
    out = torch.empty(num_tokens, n, dtype=torch.float32, device=x.device)
    scale = row_scale if fmt.row_scaled else out  # unread unless row-scaled
    grid = (triton.cdiv(n, BLOCK_N), num_tokens)
    _quant_matvec_kernel[grid](x, qweight, scale, out, n, k, qweight.shape[1], FMT=fmt.fmt_id,
                               GROUP=fmt.values if fmt.fmt_id == 7 else 32, BLOCK_N=BLOCK_N)
    return out
