"""One quantized weight matrix ``[rows, in_features]`` and its products.

``matmul`` picks the fast path. With fp32 activations: the C++ kernel's direct product for up to
``DIRECT_MAX_TOKENS`` tokens (each block decoded in registers once per call), above it the weight
dequantized ``TILE_ROWS`` rows at a time into fp32 and multiplied by torch's GEMM (the decode is
then paid once per tile, and the GEMM runs at its own rate; the two meet near 64 tokens, figures
in docs/quantization.md). ``reference_matmul`` is the plain version beside it: the whole
weight dequantized by ``reference_dequantize`` (the ``gguf`` package for GGUF blocks, torch for
the others), then ``x @ W.T`` in fp32; the tests compare the two.

Activations (the engine argument ``quant_activations``, passed to ``matmul`` as
``int8_activations``): ``int8`` (the default) quantizes them per 32
values to int8 for the products of Q8_0, Q4_0 and Q4_1, as llama.cpp does, and multiplies with
integer dot products (``csrc/quant_q8.h``), up to ``DIRECT_MAX_TOKENS`` rows and, inside
``per_sequence_rows`` (decode steps, the LM head), at any row count: one row streams each weight
row once; two and more run a tiled int8 GEMM (weight blocks repacked once per 16-row panel into
8-row groups, each maddubs 32 multiply-adds into 8 rows' sums, 4 tokens at a time), faster than
the tiled dequantize + torch GEMM (``benchmarks/quant_matmul_paths.py``; docs/quantization.md).
``fp32`` keeps them in fp32 (the exact reference: the same values as the fp32 model within
accumulation order). The other formats always use fp32 activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch

from twinserve.gpu.quantization import cpu_kernel
from twinserve.gpu.quantization.formats import GGUF_FORMATS, QuantFormat

DIRECT_MAX_TOKENS = 32
TILE_ROWS = 1024
_EMPTY = torch.empty(0)
Q8_DOT_IDS = frozenset({0, 1, 2})  # Q8_0, Q4_0, Q4_1: the formats with an integer product


# True inside ``per_sequence_rows()``: the products in progress have one row per sequence.
_PER_SEQUENCE: ContextVar[bool] = ContextVar("twinserve_quant_per_sequence", default=False)


@contextmanager
def per_sequence_rows() -> Iterator[None]:
    """Marks the products inside as one row per sequence (a decode step, the LM head): with int8
    activations they take the integer GEMM at any row count, as llama.cpp does. Prompt
    processing above ``DIRECT_MAX_TOKENS`` rows keeps fp32 activations (dequantize + torch's
    GEMM, as fast there): int8 prompts moved the bundled model's greedy tokens off the fp32
    run's about twice as much (test_fused_decode.py). Reset on exit; nothing outlives the call."""
    token = _PER_SEQUENCE.set(True)
    try:
        yield
    finally:
        _PER_SEQUENCE.reset(token)


@dataclass(slots=True)
class QuantTensor:
    """``data``: ``[rows, fmt.row_bytes(in_features)]`` uint8 blocks (``fmt`` None: a dense fp32
    ``[rows, in_features]`` weight, for tensors a GGUF file leaves unquantized); ``row_scale``:
    fp32 ``[rows]`` for row-scaled formats, else empty."""

    fmt: QuantFormat | None
    data: torch.Tensor
    in_features: int
    row_scale: torch.Tensor = _EMPTY

    def __post_init__(self) -> None:
        if self.fmt is None:
            if self.data.dim() != 2 or self.data.shape[1] != self.in_features:
                raise ValueError(f"dense weight of shape {tuple(self.data.shape)} does not have "
                                 f"{self.in_features} inputs.")
            return
        row_bytes = self.fmt.row_bytes(self.in_features)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 \
                or self.data.shape[1] != row_bytes:
            raise ValueError(f"{self.fmt.name} weight must be uint8 [rows, {row_bytes}] for "
                             f"{self.in_features} inputs, got {self.data.dtype} "
                             f"{tuple(self.data.shape)}.")
        if self.fmt.row_scaled != (self.row_scale.numel() > 0):
            raise ValueError(f"{self.fmt.name}: row_scale must be given exactly for row-scaled "
                             "formats.")

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.row_scale.numel() * 4

    @property
    def group(self) -> int:
        return self.fmt.values if self.fmt is not None and self.fmt.fmt_id == 7 else 0

    def matmul(self, x: torch.Tensor, *, int8_activations: bool) -> torch.Tensor:
        """``x[T, in] @ W.T`` in fp32: ``[T, rows]``. ``int8_activations``: the engine's
        ``quant_activations`` is ``int8`` (the products of Q8_0, Q4_0 and Q4_1 then quantize
        ``x``; the other formats ignore it)."""
        x = x.float().contiguous()
        if self.fmt is None:
            return x @ self.data.t()
        if self.data.device.type != "cpu":
            return self.device_matmul(x)
        if not cpu_kernel.kernel_available():
            return reference_matmul(x, self)
        small = x.shape[0] <= DIRECT_MAX_TOKENS
        if self.fmt.fmt_id in Q8_DOT_IDS and int8_activations and (small or _PER_SEQUENCE.get()):
            return cpu_kernel.quant_matmul_q8(x, self.data, self.fmt.fmt_id)
        if small:
            return cpu_kernel.quant_matmul(x, self.data, self.row_scale, self.fmt.fmt_id,
                                           self.group)
        return self._tiled_matmul(x, self.dequantize)

    def _tiled_matmul(self, x: torch.Tensor,
                      decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``x @ W.T`` with ``W`` decoded ``TILE_ROWS`` rows at a time by ``decode`` (rows ->
        fp32 rows, on the blocks' device) and multiplied by that device's GEMM."""
        out = x.new_empty(x.shape[0], self.rows)
        for start in range(0, self.rows, TILE_ROWS):
            stop = min(start + TILE_ROWS, self.rows)
            tile = decode(torch.arange(start, stop, device=self.data.device))
            torch.mm(x, tile.t(), out=out[:, start:stop])
        return out

    def device_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``matmul`` for blocks off the CPU (CUDA): the Triton kernel up to
        ``DIRECT_MAX_TOKENS`` tokens for the formats it implements, else ``TILE_ROWS`` rows at a
        time decoded by torch (``torch_dequant``) and multiplied by the device's GEMM. (On CPU
        tensors with Triton's interpreter it runs the same way: the tests' path.)"""
        from twinserve.gpu.quantization import triton_quant
        assert self.fmt is not None
        x = x.float().contiguous()
        if x.shape[0] <= DIRECT_MAX_TOKENS and self.fmt.name in triton_quant.SUPPORTED \
                and triton_quant.HAS_TRITON \
                and (self.data.is_cuda or triton_quant.is_interpreted()):
            return triton_quant.quant_matmul_triton(x, self.data, self.row_scale, self.fmt)
        return self._tiled_matmul(x, self.device_dequantize)

    def device_dequantize(self, rows: torch.Tensor) -> torch.Tensor:
        """``dequantize`` for blocks off the CPU: torch's decoders (``torch_dequant``)."""
        from twinserve.gpu.quantization.torch_dequant import dequantize_rows
        assert self.fmt is not None
        scale = self.row_scale[rows] if self.row_scale.numel() else self.row_scale
        return dequantize_rows(self.fmt, self.data[rows], self.in_features, scale)

    def to(self, device: torch.device | str) -> QuantTensor:
        """The same weight with its blocks (and row scales) on ``device``."""
        return QuantTensor(self.fmt, self.data.to(device), self.in_features,
                           self.row_scale.to(device))

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 ``[len(rows), in_features]`` (all rows when None), by the kernel's decoders
        (by torch's operations off the CPU)."""
        if rows is None:
            rows = torch.arange(self.rows, device=self.data.device)
        if self.fmt is None:
            return self.data[rows]
        if self.data.device.type != "cpu":
            return self.device_dequantize(rows)
        if not cpu_kernel.kernel_available():
            return reference_dequantize(self)[rows]
        return cpu_kernel.quant_dequantize(self.data, self.row_scale, rows.contiguous(),
                                           self.fmt.fmt_id, self.group, self.in_features)

    def select_rows(self, rows: torch.Tensor) -> QuantTensor:
        """The same weight with its output rows reordered/selected (blocks untouched)."""
        scale = self.row_scale[rows] if self.row_scale.numel() else self.row_scale
        return QuantTensor(self.fmt, self.data[rows].contiguous(), self.in_features, scale)


def concat_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Stack same-format weights' rows (a fused projection)."""
    first = parts[0]
    if any(p.fmt != first.fmt or p.in_features != first.in_features for p in parts):
        raise ValueError("concat_rows: the parts differ in format or input size.")
    scale = (torch.cat([p.row_scale for p in parts]) if first.row_scale.numel() else _EMPTY)
    return QuantTensor(first.fmt, torch.cat([p.data for p in parts]), first.in_features, scale)


def reference_dequantize(qt: QuantTensor) -> torch.Tensor:
    """The whole weight in fp32 without the C++ kernel: GGUF blocks by the ``gguf`` package
    (the same values ``gguf_convert`` writes), int8/fp8/4-bit by torch."""
    fmt, k = qt.fmt, qt.in_features
    if fmt is None:
        return qt.data.float()
    if fmt.name in GGUF_FORMATS:
        import gguf
        kind = gguf.GGMLQuantizationType[fmt.name]
        return torch.from_numpy(np.ascontiguousarray(
            gguf.quants.dequantize(qt.data.numpy(), kind).astype(np.float32)))
    if fmt.name == "int8":
        return qt.data.view(torch.int8).float() * qt.row_scale[:, None]
    if fmt.name == "fp8_e4m3":
        return qt.data.view(torch.float8_e4m3fn).float() * qt.row_scale[:, None]
    return _u4_reference(qt.data, fmt.values, k)


def _u4_reference(data: torch.Tensor, group: int, k: int) -> torch.Tensor:
    blocks = data.view(data.shape[0], k // group, 8 + group // 2)
    head = blocks[:, :, :8].contiguous().view(torch.float32)  # [rows, groups, 2]: d, m
    qs = blocks[:, :, 8:].reshape(data.shape[0], k // group, group // 32, 16).long()
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(data.shape[0], k // group, group)
    return (q.float() * head[:, :, :1] + head[:, :, 1:]).reshape(data.shape[0], k)


def reference_matmul(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    return x.float() @ reference_dequantize(qt).t()


def reference_quantize_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 activations of ``x[T, K]`` as the kernel makes them: per 32 values
    ``d = max|x| / 127`` ``[T, K / 32, 1]`` and ``q = round-half-even(x / d)`` ``[T, K / 32, 32]``."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    return d, torch.round(blocks * inv)


def reference_matmul_q8(x: torch.Tensor, qt: QuantTensor) -> torch.Tensor:
    """The integer product's plain version: the dequantized int8 activations times the
    dequantized weight, in fp32."""
    d, q = reference_quantize_q8(x)
    return (d * q).reshape(x.shape) @ reference_dequantize(qt).t()


def pack_u4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> QuantTensor:
    """GPTQ/AWQ-style 4-bit weights ``W = scale * (q - zero)`` (``q`` [rows, in] in 0..15,
    ``scale``/``zero`` [rows, in / group]) in the kernels' U4 layout: per group fp32 ``d = scale``
    and ``m = -scale * zero``, then the nibbles as Q4_1's."""
    from twinserve.gpu.quantization.formats import u4
    fmt = u4(group)
    rows, k = q.shape
    if k % group:
        raise ValueError(f"input size {k} is not a multiple of group_size {group}.")
    d = scale.float().contiguous()
    m = (-d * zero.float()).contiguous()
    head = torch.stack([d, m], dim=-1).view(torch.uint8).reshape(rows, k // group, 8)
    sub = q.to(torch.uint8).reshape(rows, k // group, group // 32, 2, 16)
    nibbles = (sub[:, :, :, 0] | (sub[:, :, :, 1] << 4)).reshape(rows, k // group, group // 2)
    data = torch.cat([head, nibbles], dim=-1).reshape(rows, fmt.row_bytes(k))
    return QuantTensor(fmt, data.contiguous(), k)
