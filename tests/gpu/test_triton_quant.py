"""The Triton quantized product (gpu/quantization/triton_quant.py) against the plain reference
(dequantize, then fp32 matmul), in Triton's interpreter: this file run as a script is the worker
(TRITON_INTERPRET set before triton is imported), as tests/gpu/test_triton_lora.py.
Tolerance: max |out - ref| / (1 + max |ref|) <= 1e-4 (fp32 accumulation in another order)."""

import importlib.util
import sys

import pytest
import torch
from triton_worker import run, work, worker_results

TOL = 1e-4
CASES = {"Q8_0": (33, 64, 2), "Q4_0": (17, 96, 1), "Q4_1": (40, 64, 3), "int8": (9, 64, 2),
         "fp8_e4m3": (33, 32, 1), "u4g32": (5, 64, 2), "u4g128": (33, 256, 1)}


def _tensor(name: str, rows: int, k: int):
    import gguf
    import numpy as np

    from twinserve.gpu.quantization import formats as F
    from twinserve.gpu.quantization.fp8 import quantize_fp8
    from twinserve.gpu.quantization.int8 import quantize_int8
    from twinserve.gpu.quantization.quant_tensor import QuantTensor, pack_u4
    gen = torch.Generator().manual_seed(rows * k)
    w = torch.randn(rows, k, generator=gen)
    if name in F.GGUF_FORMATS:
        kind = gguf.GGMLQuantizationType[name]
        data = gguf.quants.quantize(w.numpy().astype(np.float32), kind)
        return QuantTensor(F.GGUF_FORMATS[name], torch.from_numpy(data), k)
    if name == "int8":
        return quantize_int8(w)
    if name == "fp8_e4m3":
        return quantize_fp8(w)
    group = int(name.removeprefix("u4g"))
    q = torch.randint(0, 16, (rows, k), generator=gen)
    return pack_u4(q, torch.rand(rows, k // group, generator=gen),
                   torch.randint(0, 16, (rows, k // group), generator=gen).float(), group)


def _check(name: str, device: str = "cpu"):
    from twinserve.gpu.quantization.quant_tensor import reference_matmul
    from twinserve.gpu.quantization.triton_quant import quant_matmul_triton
    rows, k, tokens = CASES[name]
    qt = _tensor(name, rows, k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    ref = reference_matmul(x, qt)
    out = quant_matmul_triton(x.to(device), qt.data.to(device), qt.row_scale.to(device), qt.fmt)
    err = ((out.cpu() - ref).abs().max() / (1 + ref.abs().max())).item()
    return err, TOL


def _checks(_module):
    return {name: (lambda n=name: _check(n)) for name in CASES}


def _cuda_checks(_module):
    return {name: (lambda n=name: _check(n, "cuda")) for name in CASES}


def _compile(module):
    raise FileNotFoundError("no AOT compile check for the quantized kernel")


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(scope="module")
def results():
    res = worker_results(__file__, "interpret", {"TRITON_INTERPRET": "1"}, 600)
    assert res["interpreted"], "kernels were not built by the Triton interpreter"
    return res["checks"]


@needs_triton
@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_reference(results, name):
    assert results[name]["ok"], results[name]


@pytest.mark.cuda
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_kernel_matches_reference_on_cuda():
    res = worker_results(__file__, "cuda", {}, 600)
    failed = {k: v for k, v in res["checks"].items() if not v["ok"]}
    assert not failed, failed


@needs_triton
def test_unsupported_formats_are_refused():
    code = ("import os; os.environ['TRITON_INTERPRET'] = '1'\n"
            "import torch\n"
            "from twinserve.gpu.quantization import formats as F\n"
            "from twinserve.gpu.quantization.triton_quant import quant_matmul_triton\n"
            "try:\n"
            "    quant_matmul_triton(torch.zeros(1, 256), torch.zeros(1, 144, dtype=torch.uint8),"
            " torch.empty(0), F.Q4_K)\n"
            "except ValueError as e:\n"
            "    assert 'does not implement Q4_K' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('expected ValueError')\n"
            "print('OK')\n")
    proc = run(["-c", code], {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


if __name__ == "__main__":
    import twinserve.gpu.quantization.triton_quant as module
    work(sys.argv[1], module, _checks, _cuda_checks, _compile)
