"""Build (once per machine, into torch's extension cache) and load the CPU quantized-product
kernels: ``gpu/kernels/csrc/quant_matmul.cpp`` (the products, fp32 and int8 activations) and
``gpu/kernels/csrc/fused_decode.cpp`` (a whole decode step in one call), one extension;
``scripts/setup.sh`` builds it ahead, as the decode-attention kernel. ``-march=native``: it runs
where it is built. ``-fopenmp``: ATen's ``at::parallel_for`` shares work out only where the
including file is compiled with OpenMP (``_OPENMP`` defines ``INTRA_OP_PARALLEL``); with
``-fopenmp-simd`` alone every product, attention and per-token loop ran on the calling thread.
The library it links, ``libgomp.so.1``, is the one torch has already loaded (same soname), so
the process keeps one OpenMP thread pool."""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
CSRC = Path(__file__).resolve().parent.parent / "kernels" / "csrc"
SOURCES = (CSRC / "quant_matmul.cpp", CSRC / "fused_decode.cpp")
HEADERS = (CSRC / "quant_blocks.h", CSRC / "quant_q8.h", CSRC / "quant_packed.h",
           CSRC / "paged_attention.h", CSRC / "fused_attention.h")

# (x[T, K] fp32, qweight[N, row_bytes] bytes, row_scale[N] or [0] fp32, fmt, group) -> [T, N]
QuantMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, int], torch.Tensor]


@functools.cache
def build_quant_kernel() -> None:
    """Compile (or load the cached build of) the kernel; raises when it cannot be built."""
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed
    # torch rebuilds when the sources or the flags change, not the headers: their hash is a flag
    headers = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    load(name="twinserve_quant_matmul", sources=[str(s) for s in SOURCES], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-ffp-contract=fast", "-fopenmp",
                       f"-DTWINSERVE_HEADERS_{headers}"],
         extra_ldflags=["-fopenmp"])


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, row_scale: torch.Tensor, fmt: int,
                 group: int) -> torch.Tensor:
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_matmul(x, qweight, row_scale, fmt, group)


def quant_matmul_q8(x: torch.Tensor, qweight: torch.Tensor, fmt: int) -> torch.Tensor:
    """The integer product (``x`` quantized per 32 values to int8, as llama.cpp): Q8_0, Q4_0,
    Q4_1 only."""
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_matmul_q8(x, qweight, fmt)


def quantize_q8(x: torch.Tensor) -> torch.Tensor:
    """``x[T, K]`` fp32 as the kernel's activation blocks: bytes ``[T, K / 32 * 40]``, each
    block fp32 ``d``, fp32 ``s = d * sum(q)``, int8 ``q[32]``."""
    build_quant_kernel()
    return torch.ops.twinserve_quant.quantize_q8(x)


PACKED_IDS = (1, 2)  # Q4_0, Q4_1: the 8-row packed layout (csrc/quant_packed.h)


def quant_pack(qweight: torch.Tensor, fmt: int, in_features: int) -> torch.Tensor:
    """The file's rows in the 8-row packed layout: bytes ``[ceil(rows / 8), blocks * 8 *
    block_bytes]`` (``csrc/quant_packed.h``); Q4_0 and Q4_1."""
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_pack(qweight, fmt, in_features)


def quant_unpack(packed: torch.Tensor, fmt: int, rows: int, in_features: int) -> torch.Tensor:
    """The inverse of ``quant_pack``: the file's rows again, byte for byte."""
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_unpack(packed, fmt, rows, in_features)


def quant_matmul_q8_packed(x: torch.Tensor, packed: torch.Tensor, fmt: int,
                           rows: int) -> torch.Tensor:
    """``quant_matmul_q8`` on the packed layout (``rows``: the weight's real rows)."""
    build_quant_kernel()
    return torch.ops.twinserve_quant.quant_matmul_q8_packed(x, packed, fmt, rows)


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
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU quantized-product kernel unavailable (%s); quantized weights use the "
                       "reference path (dequantize, then torch) and no fused decode step, "
                       "correct but several times slower. scripts/setup.sh builds it.", exc)
        return False
    return True
