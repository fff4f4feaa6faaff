"""The quantized products (gpu/kernels/csrc/quant_matmul.cpp through QuantTensor) against the plain
reference: the whole weight dequantized (GGUF blocks by the ``gguf`` package, the others by torch)
and multiplied in fp32.

Tolerance: |kernel - reference| <= 1e-5 * (|x| @ |W|.T) + 1e-6 elementwise, i.e. a relative 1e-5 of
the sum of absolute products (fp32 accumulation in another order; typical errors are ~1e-7 of it).
The dequantized values themselves must be bit-equal to the reference's (U4: within 1e-6).
These are the fp32-activation products (``int8_activations=False``, the engine's
``quant_activations="fp32"``); the int8 ones are tested in tests/gpu/test_fused_decode.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from twinserve.gpu.quantization import formats as F
from twinserve.gpu.quantization.cpu_kernel import kernel_available
from twinserve.gpu.quantization.fp8 import quantize_fp8
from twinserve.gpu.quantization.int8 import quantize_int8
from twinserve.gpu.quantization.quant_tensor import (
    DIRECT_MAX_TOKENS,
    QuantTensor,
    pack_u4,
    reference_dequantize,
    reference_matmul,
)

pytestmark = pytest.mark.skipif(not kernel_available(),
                                reason="the C++ quantized kernel cannot be built (no g++?)")
BATCHES = (1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64)


ROWS = (1, 7, 33, 100)  # output rows: odd counts, not multiples of any block or tile


def _gguf_tensor(fmt: F.QuantFormat, rows: int, k: int, seed: int = 0) -> QuantTensor:
    import gguf
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[fmt.name]
    if fmt.name in ("Q8_0", "Q4_0", "Q4_1"):
        data = gguf.quants.quantize(rng.standard_normal((rows, k)).astype(np.float32), kind)
    else:  # gguf cannot quantize K-quants: any bytes are valid blocks, given sane fp16 scales
        data = rng.integers(0, 256, (rows, k // fmt.values, fmt.block_bytes), dtype=np.uint8)
        offsets = (0, 2) if fmt.name == "Q4_K" else (208,)
        for off in offsets:
            half = (rng.standard_normal(data.shape[:2]) * 0.01).astype(np.float16)
            data[:, :, off:off + 2] = half.view(np.uint8).reshape(*data.shape[:2], 2)
        data = data.reshape(rows, -1)
    return QuantTensor(fmt, torch.from_numpy(np.ascontiguousarray(data)), k)


def _check_products(qt: QuantTensor, batches: tuple[int, ...] = BATCHES,
                    exact: bool = True) -> None:
    w = reference_dequantize(qt)
    if exact:
        assert torch.equal(qt.dequantize(), w)
    else:  # U4's d * q + m is one fused rounding in the kernel, two in torch
        torch.testing.assert_close(qt.dequantize(), w, rtol=1e-6, atol=1e-7)
    gen = torch.Generator().manual_seed(1)
    for t in batches:
        x = torch.randn(t, qt.in_features, generator=gen)
        got, ref = qt.matmul(x, int8_activations=False), reference_matmul(x, qt)
        bound = x.abs() @ w.abs().t()
        assert got.shape == (t, qt.rows)
        assert bool(((got - ref).abs() <= 1e-5 * bound + 1e-6).all()), (qt.fmt, t)


@pytest.mark.parametrize("name", list(F.GGUF_FORMATS))
@pytest.mark.parametrize("rows", ROWS)
def test_gguf_blocks_match_the_gguf_reference(name: str, rows: int) -> None:
    fmt = F.GGUF_FORMATS[name]
    for k in sorted({fmt.values, 2 * fmt.values, 576 if fmt.values == 32 else 768}):
        _check_products(_gguf_tensor(fmt, rows, k, seed=rows + k))


def test_the_reference_is_gguf_convert_s_dequantization() -> None:
    import gguf
    qt = _gguf_tensor(F.Q4_1, 5, 64)
    expected = gguf.quants.dequantize(qt.data.numpy(), gguf.GGMLQuantizationType.Q4_1)
    assert np.array_equal(reference_dequantize(qt).numpy(), expected.astype(np.float32))


@pytest.mark.parametrize("quantize, step", [(quantize_int8, 1 / 127), (quantize_fp8, 1 / 16)])
@pytest.mark.parametrize("rows", ROWS)
def test_int8_and_fp8_products_match_torch(quantize, step: float, rows: int) -> None:
    w = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    qt = quantize(w)
    _check_products(qt)
    # quantization error within half a step of each row's scale (fp8: 3 mantissa bits)
    err = (reference_dequantize(qt) - w).abs().amax(dim=1)
    assert bool((err <= step * w.abs().amax(dim=1) + 1e-7).all())


@pytest.mark.parametrize("group", F.U4_GROUPS)
@pytest.mark.parametrize("rows", ROWS)
def test_u4_products_match_torch(group: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(group + rows)
    k = 2 * 128
    q = torch.randint(0, 16, (rows, k), generator=gen)
    scale = torch.rand(rows, k // group, generator=gen) * 0.1
    zero = torch.randint(0, 16, (rows, k // group), generator=gen).float()
    qt = pack_u4(q, scale, zero, group)
    g = torch.arange(k) // group
    plain = scale[:, g] * (q.float() - zero[:, g])
    torch.testing.assert_close(reference_dequantize(qt), plain, rtol=1e-6, atol=1e-6)
    _check_products(qt, (1, 4, 9, 64), exact=False)


def test_both_paths_are_exercised() -> None:
    assert min(BATCHES) <= DIRECT_MAX_TOKENS < max(BATCHES)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of the block size 32"):
        F.Q4_1.row_bytes(100)
    with pytest.raises(ValueError, match="Q4_1 weight must be uint8"):
        QuantTensor(F.Q4_1, torch.zeros(4, 10, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="group_size must be one of 32, 64, 128"):
        F.u4(256)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU")
def test_the_kernels_share_work_out_to_threads(two_torch_threads) -> None:
    """The extension is built with OpenMP: without it ATen's at::parallel_for runs every product,
    attention and per-token loop on the calling thread (as it did up to this test)."""
    assert torch.ops.twinserve_quant.quant_parallel_threads(64) == 2
