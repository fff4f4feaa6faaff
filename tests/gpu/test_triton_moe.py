"""The Triton grouped MoE kernel (gpu/kernels/triton_moe.py) against a float64 per-token reference with
the kernel's routing, in Triton's interpreter (a subprocess, as tests/gpu/test_triton_attention.py)
and on CUDA. Errors are ||out - ref|| / ||ref||: torch's own bf16 path lands at 0.4% of the
reference at these shapes, so bf16 passes under 1.5%, float32 under 1e-5."""

import sys

import pytest
import torch
from triton_worker import work, worker_results

from twinserve.core.architectures import MoEFields


def _moe(experts: int, k: int, hidden: int, inter: int, dtype: torch.dtype, device: str):
    from twinserve.gpu.layers.moe import SparseMoE
    torch.manual_seed(2)
    moe = SparseMoE(MoEFields(experts, k, inter, True), hidden, dtype, torch.device(device))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape) * 0.3).to(dtype))
    return moe


def _compare(tm, tokens: int, experts: int, k: int, hidden: int, inter: int, dtype, tol,
             device="cpu", block_m=16):
    """||kernel - reference|| / ||reference||, the reference in float64 on the CPU with the
    kernel's routing (so a near-tie in bf16 routing cannot flip an expert between the two)."""
    moe = _moe(experts, k, hidden, inter, dtype, device)
    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(tokens))).to(
        dtype).to(device)
    with torch.inference_mode():
        weights, ids = moe.route(x)
        got = tm.fused_moe(x, moe.w13, moe.w2, weights, ids, block_m).double().cpu()
        want = _reference64(moe, x, weights, ids)
    return float((got - want).norm() / want.norm()), tol


def _reference64(moe, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    w13, w2 = moe.w13.double().cpu(), moe.w2.double().cpu()
    x64, weights64 = x.double().cpu(), weights.double().cpu()
    out = torch.zeros_like(x64)
    for t in range(x64.shape[0]):
        for j in range(ids.shape[1]):
            gate, up = (x64[t] @ w13[int(ids[t, j])].T).chunk(2)
            out[t] += weights64[t, j] * ((torch.nn.functional.silu(gate) * up) @ w2[int(ids[t, j])].T)
    return out


def _check_alignment(tm):
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    rows, tiles, row_of = tm.align_by_expert(ids, 4, 4)
    # flat choices 2 0 2 1 0 2 -> expert 0: choices 1, 4; expert 1: 3; expert 2: 0, 2, 5; 3: none
    ok = (rows.tolist() == [1, 4, -1, -1, 3, -1, -1, -1, 0, 2, 5, -1] and tiles.tolist() == [0, 1, 2]
          and all(rows[row_of[c]] == c for c in range(6)))
    return (0.0 if ok else 1.0), 0.0


def _checks(tm, device="cpu"):
    bf16 = torch.bfloat16
    return {
        "alignment": lambda: _check_alignment(tm),
        "decode_1_token_fp32": lambda: _compare(tm, 1, 4, 2, 32, 16, torch.float32, 1e-5, device),
        "batch_19_tokens_fp32": lambda: _compare(tm, 19, 6, 2, 32, 24, torch.float32, 1e-5, device),
        "top3_of_8_block8_fp32": lambda: _compare(tm, 13, 8, 3, 48, 40, torch.float32, 1e-5,
                                                  device, 8),
        "batch_9_bf16": lambda: _compare(tm, 9, 4, 2, 32, 16, bf16, 1.5e-2, device),
    }


def _cuda_checks(tm):
    bf16 = torch.bfloat16
    checks = {f"cuda_{k}": v for k, v in _checks(tm, "cuda").items()}
    checks["cuda_qwen3_moe_shape_bf16"] = lambda: _compare(tm, 64, 128, 8, 2048, 768, bf16, 1.5e-2,
                                                           "cuda", 64)
    return checks


def _aot_compile(tm):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = tm._grouped_matmul_kernel
    constexprs = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, SCALE=True, DOT_FP32=False)
    ptrs = dict(a_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", rows_ptr="*i32",
                tile_expert_ptr="*i32", scale_ptr="*fp32")
    sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
    triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4})


pytest.importorskip("triton")
CHECK_NAMES = ["alignment", "decode_1_token_fp32", "batch_19_tokens_fp32", "top3_of_8_block8_fp32",
               "batch_9_bf16"]


@pytest.fixture(scope="module")
def results():
    res = worker_results(__file__, "interpret", {"TRITON_INTERPRET": "1"})
    assert res["interpreted"], "kernels were not built by the Triton interpreter"
    return res["checks"]


def test_check_list_is_complete():
    assert sorted(CHECK_NAMES) == sorted(_checks(None))


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_grouped_kernel_matches_the_reference(results, name):
    assert results[name]["ok"], results[name]


def test_kernel_compiles_for_sm90():
    res = worker_results(__file__, "compile", {"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    if res["compile"].startswith("unavailable"):
        pytest.skip(res["compile"])
    assert res["compile"] == "ok", res["compile"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_grouped_kernel_matches_the_reference_on_cuda():
    res = worker_results(__file__, "cuda", {}, timeout=600)
    failed = {k: v for k, v in res["checks"].items() if not v["ok"]}
    assert not failed, failed


if __name__ == "__main__":
    from twinserve.gpu.kernels import triton_moe as module
    work(sys.argv[1] if len(sys.argv) > 1 else "interpret", module, _checks, _cuda_checks,
         _aot_compile)
