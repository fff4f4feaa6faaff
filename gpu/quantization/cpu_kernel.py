"""Build (once per machine, into torch's extension cache) and load the CPU quantized-product
kernel ``gpu/csrc/quant_matmul.cpp``; ``scripts/setup.sh`` builds it ahead, as the decode-attention
kernel. ``-march=native``: it runs where it is built."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "quant_matmul.cpp"

# (x[T, K] fp32, qweight[N, row_bytes] bytes, row_scale[N] or [0] fp32, fmt, group) -> [T, N]
QuantMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


@functools.cache
def build_quant_kernel() -> None:
    """Compile (or load the cached build of) the kernel; raises when it cannot be built."""
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed
    load(name="twinserve_quant_matmul", sources=[str(SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-ffp-contract=fast"])


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, row_scale: torch.Tensor, fmt: int,
                 group: int) -> torch.Tensor:
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_matmul(x, qweight, row_scale, fmt, group)


def quant_dequantize(qweight: torch.Tensor, row_scale: torch.Tensor, rows: torch.Tensor,
                     fmt: int, group: int, in_features: int) -> torch.Tensor:
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_dequantize(qweight, row_scale, rows, fmt, group,
                                                      in_features)


@functools.cache
def kernel_available() -> bool:
    """Whether the kernel builds here (g++ present); without it the products use the reference
    path (dequantize, then torch), correct but several times slower."""
    try:
        build_quant_kernel()
    except (OSError, RuntimeError, ImportError):
        return False
    return True
