"""The 8-row packed layout of Q4_0/Q4_1 weights (csrc/quant_packed.h) against the file's rows:
the repack round-trips byte for byte, matches a plain Python statement of the layout, and its
int8 products match the dequantize-then-matmul reference (the same 1e-5 bound as
test_fused_decode.py's int8 products) at every batch size 1..64, 65 and 130, for row counts that
are not multiples of the group; the fused step on packed and unpacked weights gives the same
hidden states."""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import INT8_TOKENS, _activations, _decode_meta, _llm
from test_quant_kernels import ROWS, _gguf_tensor

from twinserve.gpu.kernels import fused_decode
from twinserve.gpu.quantization import cpu_kernel
from twinserve.gpu.quantization import formats as F
from twinserve.gpu.quantization.quant_tensor import (
    reference_dequantize,
    reference_matmul_q8,
    reference_quantize_q8,
)

pytestmark = pytest.mark.skipif(not cpu_kernel.kernel_available(),
                                reason="the C++ quantized kernel cannot be built (no g++?)")
PACKED_FORMATS = (F.Q4_0, F.Q4_1)


def reference_pack(data: torch.Tensor, fmt: F.QuantFormat, k: int) -> torch.Tensor:
    """The layout as quant_packed.h states it, one group block at a time."""
    rows, blocks, nb = data.shape[0], k // 32, fmt.block_bytes
    groups = (rows + 7) // 8
    padded = torch.zeros(groups * 8, blocks, nb, dtype=torch.uint8)
    padded[:rows] = data.view(rows, blocks, nb)
    g = padded.view(groups, 8, blocks, nb).permute(0, 2, 1, 3)  # [group, block, row, bytes]
    qs = g[..., nb - 16:].reshape(groups, blocks, 8, 4, 4).permute(0, 1, 3, 2, 4)  # [.., j, row, 4]
    heads = [g[..., 0:2].reshape(groups, blocks, 16)]
    if fmt is F.Q4_1:
        heads.append(g[..., 2:4].reshape(groups, blocks, 16))
    out = torch.cat([*heads, qs.reshape(groups, blocks, 128)], dim=-1)
    return out.reshape(groups, blocks * 8 * nb)


@pytest.mark.parametrize("fmt", PACKED_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", (*ROWS, 8, 16))
def test_the_repack_round_trips_and_is_the_stated_layout(fmt: F.QuantFormat, rows: int) -> None:
    for k in (32, 96, 576):
        qt = _gguf_tensor(fmt, rows, k, seed=rows + k)
        packed = cpu_kernel.quant_pack(qt.data, fmt.fmt_id, k)
        assert packed.shape == ((rows + 7) // 8, k // 32 * 8 * fmt.block_bytes)
        assert torch.equal(packed, reference_pack(qt.data, fmt, k))
        assert torch.equal(cpu_kernel.quant_unpack(packed, fmt.fmt_id, rows, k), qt.data)


@pytest.mark.parametrize("fmt", PACKED_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", ROWS)
def test_packed_products_match_the_reference(fmt: F.QuantFormat, rows: int) -> None:
    for k in (32, 64, 576):
        qt = _gguf_tensor(fmt, rows, k, seed=rows + k)
        w = reference_dequantize(qt)
        packed = cpu_kernel.quant_pack(qt.data, fmt.fmt_id, k)
        for tokens in INT8_TOKENS:
            x = _activations(tokens, k, tokens)
            got = cpu_kernel.quant_matmul_q8_packed(x, packed, fmt.fmt_id, rows)
            ref = reference_matmul_q8(x, qt)
            d, q = reference_quantize_q8(x)
            bound = (d * q).abs().reshape(x.shape) @ w.abs().t()
            assert bool(((got - ref).abs() <= 1e-5 * bound + 1e-6).all()), (fmt, rows, k, tokens)


def test_packed_layout_refuses_other_formats_and_shapes() -> None:
    qt = _gguf_tensor(F.Q8_0, 8, 64)
    with pytest.raises(RuntimeError, match="covers Q4_0 and Q4_1"):
        cpu_kernel.quant_pack(qt.data, F.Q8_0.fmt_id, 64)
    q4 = _gguf_tensor(F.Q4_1, 9, 64)
    packed = cpu_kernel.quant_pack(q4.data, F.Q4_1.fmt_id, 64)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        cpu_kernel.quant_matmul_q8_packed(torch.randn(1, 64), packed, F.Q4_1.fmt_id, 17)


@pytest.mark.parametrize("seq_lens", ([23], [5, 40, 17]), ids=("one token", "three"))
def test_the_fused_step_on_packed_weights_matches_the_file_s_rows(seq_lens: list[int]) -> None:
    """The bundled Q4_1 model's decode step (random KV) with and without the packed copies, int8
    activations: the same products, the one-token kernel's fp32 sums in another order, so within
    test_fused_decode's bound for fused against per-op (5% in norm; measured 0.33% for one token,
    0 for three: the GEMM on the packed groups sums in the rows' order)."""
    from twinserve.gpu.models.default_model import gguf_path
    llm = _llm(str(gguf_path()), True, "int8")
    runner = llm.engine.runner
    model = runner.model
    gen = torch.Generator().manual_seed(1)
    for key, value in runner.kv_cache.gpu:
        key.copy_(torch.randn(key.shape, generator=gen))
        value.copy_(torch.randn(value.shape, generator=gen))
    meta = _decode_meta(seq_lens, runner.block_size)
    ids = torch.tensor([17, 4000, 123][:len(seq_lens)])
    positions = meta.seq_lens.long() - 1
    out = {}
    for pack in (True, False):
        step = fused_decode.FusedDecode.for_model(model, pack=pack)
        assert any(p.numel() for p in step.packed) == pack
        out[pack] = step.run(model.embed(ids), positions, runner.kv_cache.gpu, meta)
    assert (out[True] - out[False]).norm() <= 5e-2 * out[False].norm()
