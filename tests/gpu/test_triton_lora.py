"""Multi-LoRA shrink/expand kernels (gpu/kernels/triton_lora.py) against the torch reference and a per-row loop.

As in tests/gpu/test_triton_attention.py: Triton decides interpreted-or-compiled when a kernel is decorated, so the
kernel comparisons run once, in a subprocess started with TRITON_INTERPRET=1 that runs this file as a script
(``python tests/gpu/test_triton_lora.py``) and prints one JSON line of results; each test asserts on its entry.
"""

import importlib.util
import sys

import pytest
import torch
from triton_worker import run, work, worker_results

FP32_TOL, BF16_TOL = 1e-4, 2e-2  # on rel_err: max |out - ref| / (1 + |ref|), see there
CUDA_BF16_TOL = 2e-2  # native bf16 dots in the shrink, tf32 in the expand

# ------------------------------------------------------------------------------------------ reference + cases

# 3 adapters in use (slots 2, 0, 3) plus an empty segment for slot 1; 19 rows span two 16-row tiles; of the
# 32 rows of x, 5 are in no segment.
SEGMENTS = dict(num_rows=32, seg_lens=[7, 0, 19, 1], seg_slots=[2, 1, 0, 3], num_slots=4)
DECODE = dict(num_rows=6, seg_lens=[1] * 6, seg_slots=[3, 0, 3, 1, 2, 0], num_slots=4)


def naive_shrink(x, lora_a, rows_per_segment, slots):
    h = torch.zeros((x.shape[0], lora_a.shape[1]), dtype=torch.float32)
    for rows, slot in zip(rows_per_segment, slots):
        for t in rows:
            h[t] = lora_a[slot].float() @ x[t].float()
    return h


def naive_expand(h, lora_b, rows_per_segment, slots, out, h_offset=0):
    rank = lora_b.shape[2]
    for rows, slot in zip(rows_per_segment, slots):
        for t in rows:
            out[t] += (lora_b[slot].float() @ h[t, h_offset:h_offset + rank]).to(out.dtype)


def make_segments(num_rows, seg_lens, seg_slots, num_slots, seed=0):
    """Segments over a shuffled subset of the rows: (sorted_rows, seg_start, seg_slot, rows_per_segment)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_rows, generator=g)[:sum(seg_lens)]
    starts = [0]
    for n in seg_lens:
        starts.append(starts[-1] + n)
    rows_per_segment = [perm[starts[i]:starts[i + 1]].tolist() for i in range(len(seg_lens))]
    return (perm.int(), torch.tensor(starts, dtype=torch.int32), torch.tensor(seg_slots, dtype=torch.int32),
            rows_per_segment)


def rel_err(out, ref, before=None):
    """max |out - ref| / (1 + |ref|); for an update ``out = before + delta`` the scale is that of both addends,
    1 + |before| + |delta|, since delta is rounded to out's dtype before the add (bf16: one ulp of delta)."""
    out, ref = out.float(), ref.float()
    scale = 1.0 + ref.abs() if before is None else 1.0 + before.float().abs() + (ref - before.float()).abs()
    return float(((out - ref).abs() / scale).max())


def _randn(shape, g, scale=1.0, dtype=torch.float32):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def check_shrink(lora, *, k, rank, dtype, tol, segments=SEGMENTS, x_pad=0, split_k=None, device="cpu"):
    """Kernel h against the reference and the per-row loop; rows in no segment must be exactly zero."""
    g = torch.Generator().manual_seed(k + rank)
    sorted_rows, seg_start, seg_slot, rows_per_segment = make_segments(**segments)
    x = _randn((segments["num_rows"], k + x_pad), g, dtype=dtype)[:, :k]  # row stride k + x_pad
    lora_a = _randn((segments["num_slots"], rank, k), g, k ** -0.5, dtype)
    args = [t.to(device) for t in (x, lora_a, sorted_rows, seg_start, seg_slot)]
    max_len = max(segments["seg_lens"])
    h = lora.lora_shrink(*args, max_len, **({} if split_k is None else {"split_k": split_k})).cpu()
    assert h.dtype == torch.float32 and h.shape == (x.shape[0], rank)
    ref = lora.lora_shrink_reference(x, lora_a, sorted_rows, seg_start, seg_slot, max_len)
    naive = naive_shrink(x, lora_a, rows_per_segment, seg_slot.tolist())
    unused = sorted(set(range(x.shape[0])) - set(sorted_rows.tolist()))
    assert not h[unused].any(), "rows in no segment must get h = 0"
    return max(rel_err(h, ref), rel_err(h, naive)), tol


def _expand_base(kind, num_rows, n, dtype, g):
    """The tensor behind ``out``: [T, N] (plain), [T, N + 40] (column_slice) or [N, T] (transposed)."""
    shape = {"plain": (num_rows, n), "column_slice": (num_rows, n + 40), "transposed": (n, num_rows)}[kind]
    return _randn(shape, g, dtype=dtype)


def _expand_view(kind, base, n):
    """``out`` as a view of its base: itself, columns 24 .. 24 + N, or the transpose (out.stride(0) == 1)."""
    return {"plain": base, "column_slice": base[:, 24:24 + n], "transposed": base.t()}[kind]


def check_expand(lora, *, n, rank, dtype, tol, kind="plain", h_offset=0, segments=SEGMENTS, device="cpu"):
    """Kernel against the reference and the per-row loop on the whole backing tensor: rows in no segment and
    columns outside a slice view must come back bit-identical."""
    g = torch.Generator().manual_seed(n + rank + h_offset)
    sorted_rows, seg_start, seg_slot, rows_per_segment = make_segments(**segments, seed=1)
    num_rows = segments["num_rows"]
    h = _randn((num_rows, h_offset + rank + 5), g)  # every row nonzero, so a stray row would show
    lora_b = _randn((segments["num_slots"], n, rank), g, rank ** -0.5, dtype)
    base = _expand_base(kind, num_rows, n, dtype, g)
    base_dev = base.to(device, copy=True)  # the kernel writes into it; `base` stays the initial value
    out_dev = _expand_view(kind, base_dev, n)
    args = [t.to(device) for t in (h, lora_b, sorted_rows, seg_start, seg_slot)]
    max_len = max(segments["seg_lens"])
    lora.lora_expand(*args, max_len, out_dev, h_offset)
    ref_base, naive_base = base.clone(), base.clone()
    lora.lora_expand_reference(h, lora_b, sorted_rows, seg_start, seg_slot, max_len,
                               _expand_view(kind, ref_base, n), h_offset)
    naive_expand(h, lora_b, rows_per_segment, seg_slot.tolist(), _expand_view(kind, naive_base, n), h_offset)
    got = base_dev.cpu()
    touched = torch.zeros_like(base, dtype=torch.bool)
    _expand_view(kind, touched, n)[sorted_rows.long()] = True
    untouched = ~touched
    assert torch.equal(got[untouched], base[untouched]), "rows in no segment / outside the view changed"
    return max(rel_err(got, ref_base, base), rel_err(got, naive_base, base)), tol


def check_fused_qkv(lora, *, k, rank, n_parts, dtype, tol, device="cpu"):
    """One shrink with stacked A [S, 3R, K] then one expand per part (h_offset = i * R) into column slices of
    one [T, sum(n_parts)] output, as a fused QKV projection would; against the reference chain."""
    g = torch.Generator().manual_seed(7)
    sorted_rows, seg_start, seg_slot, _ = make_segments(**SEGMENTS, seed=2)
    num_rows, num_slots, parts = SEGMENTS["num_rows"], SEGMENTS["num_slots"], len(n_parts)
    x = _randn((num_rows, k), g, dtype=dtype)
    lora_a = _randn((num_slots, parts * rank, k), g, k ** -0.5, dtype)
    lora_bs = [_randn((num_slots, n, rank), g, rank ** -0.5, dtype) for n in n_parts]
    out = _randn((num_rows, sum(n_parts)), g, dtype=dtype)
    max_len = max(SEGMENTS["seg_lens"])
    seg = [t.to(device) for t in (sorted_rows, seg_start, seg_slot)]

    def chain(shrink, expand, x, lora_a, lora_bs, out, seg):
        h = shrink(x, lora_a, *seg, max_len)
        col = 0
        for i, (b, n) in enumerate(zip(lora_bs, n_parts)):
            expand(h, b, *seg, max_len, out[:, col:col + n], i * rank)
            col += n
        return out

    got = chain(lora.lora_shrink, lora.lora_expand, x.to(device), lora_a.to(device),
                [b.to(device) for b in lora_bs], out.to(device, copy=True), seg).cpu()
    ref = chain(lora.lora_shrink_reference, lora.lora_expand_reference, x, lora_a, lora_bs, out.clone(),
                [sorted_rows, seg_start, seg_slot])
    return rel_err(got, ref, out), tol


def check_no_segments(lora, device="cpu"):
    """L == 0 (and max_seg_len == 0): h is all zeros, out is untouched."""
    g = torch.Generator().manual_seed(3)
    x = _randn((5, 64), g).to(device)
    lora_a = _randn((2, 16, 64), g).to(device)
    lora_b = _randn((2, 48, 16), g).to(device)
    empty = torch.zeros(0, dtype=torch.int32, device=device)
    start = torch.zeros(1, dtype=torch.int32, device=device)
    h = lora.lora_shrink(x, lora_a, empty, start, empty, 0)
    out = _randn((5, 48), g).to(device)
    before = out.clone()
    lora.lora_expand(_randn((5, 16), g).to(device), lora_b, empty, start, empty, 0, out)
    assert h.shape == (5, 16) and not h.any() and torch.equal(out, before)
    return 0.0, 0.0


def _checks(lora, device="cpu"):
    """name -> zero-argument callable returning (error, tol); small shapes for the interpreter."""
    bf16, fp16 = torch.bfloat16, torch.float16
    return {
        "shrink_fp32_k64_r16": lambda: check_shrink(lora, k=64, rank=16, dtype=torch.float32, tol=FP32_TOL,
                                                    device=device),
        "shrink_bf16_k96_r8": lambda: check_shrink(lora, k=96, rank=8, dtype=bf16, tol=BF16_TOL, device=device),
        "shrink_fp16_k100_r24_strided_x": lambda: check_shrink(lora, k=100, rank=24, dtype=fp16, tol=BF16_TOL,
                                                              x_pad=13, device=device),
        # 32-wide K tiles: K = 100 in 2 splits is 64 + 36 (a masked tail), K = 96 in 4 leaves one split empty
        "shrink_split2_fp32_k100_r16": lambda: check_shrink(lora, k=100, rank=16, dtype=torch.float32,
                                                           tol=FP32_TOL, split_k=2, device=device),
        "shrink_split4_bf16_k96_r16": lambda: check_shrink(lora, k=96, rank=16, dtype=bf16, tol=BF16_TOL,
                                                           split_k=4, device=device),
        "shrink_decode_bf16_k64_r16": lambda: check_shrink(lora, k=64, rank=16, dtype=bf16, tol=BF16_TOL,
                                                           segments=DECODE, device=device),
        "expand_fp32_n48_r16": lambda: check_expand(lora, n=48, rank=16, dtype=torch.float32, tol=FP32_TOL,
                                                    device=device),
        "expand_bf16_n80_r8": lambda: check_expand(lora, n=80, rank=8, dtype=bf16, tol=BF16_TOL, device=device),
        "expand_bf16_column_slice_n48_r16_offset8": lambda: check_expand(
            lora, n=48, rank=16, dtype=bf16, tol=BF16_TOL, kind="column_slice", h_offset=8, device=device),
        "expand_fp32_transposed_n80_r24": lambda: check_expand(
            lora, n=80, rank=24, dtype=torch.float32, tol=FP32_TOL, kind="transposed", device=device),
        "expand_fp16_transposed_decode_n48_r8": lambda: check_expand(
            lora, n=48, rank=8, dtype=fp16, tol=BF16_TOL, kind="transposed", segments=DECODE, device=device),
        "fused_qkv_bf16_k64_r8": lambda: check_fused_qkv(lora, k=64, rank=8, n_parts=(48, 16, 16), dtype=bf16,
                                                         tol=BF16_TOL, device=device),
        "no_segments": lambda: check_no_segments(lora, device),
    }


CHECK_NAMES = [
    "shrink_fp32_k64_r16", "shrink_bf16_k96_r8", "shrink_fp16_k100_r24_strided_x", "shrink_split2_fp32_k100_r16",
    "shrink_split4_bf16_k96_r16", "shrink_decode_bf16_k64_r16",
    "expand_fp32_n48_r16", "expand_bf16_n80_r8", "expand_bf16_column_slice_n48_r16_offset8",
    "expand_fp32_transposed_n80_r24", "expand_fp16_transposed_decode_n48_r8",
    "fused_qkv_bf16_k64_r8", "no_segments",
]

# Serving-sized segments: a mixed step of 3 prefills and 40 decodes over 8 adapter slots, 300 rows unused
SERVING = dict(num_rows=1000, seg_lens=[300, 0, 257, 103] + [1] * 40, seg_slots=[5, 0, 7, 2] + [i % 8 for i in range(40)],
               num_slots=8)
CUDA_DECODE = dict(num_rows=64, seg_lens=[1] * 64, seg_slots=[i % 8 for i in range(64)], num_slots=8)


def _cuda_checks(lora):
    """Llama-8B-like shapes on a real GPU (compiled kernels, native bf16 dots, default tiles and split-K)."""
    bf16 = torch.bfloat16
    checks = {f"cuda_{k}": v for k, v in _checks(lora, "cuda").items()}
    checks.update({
        "cuda_shrink_serving_bf16_k4096_r16": lambda: check_shrink(lora, k=4096, rank=16, dtype=bf16,
                                                                   tol=CUDA_BF16_TOL, segments=SERVING, device="cuda"),
        "cuda_shrink_decode_bf16_k4096_r64": lambda: check_shrink(lora, k=4096, rank=64, dtype=bf16,
                                                                  tol=CUDA_BF16_TOL, segments=CUDA_DECODE, device="cuda"),
        "cuda_shrink_serving_fp32_k4096_r24": lambda: check_shrink(lora, k=4096, rank=24, dtype=torch.float32,
                                                                   tol=FP32_TOL, segments=SERVING, device="cuda"),
        "cuda_expand_serving_bf16_n14336_r16": lambda: check_expand(lora, n=14336, rank=16, dtype=bf16,
                                                                    tol=CUDA_BF16_TOL, segments=SERVING, device="cuda"),
        "cuda_expand_decode_bf16_transposed_n4096_r128": lambda: check_expand(
            lora, n=4096, rank=128, dtype=bf16, tol=CUDA_BF16_TOL, kind="transposed", segments=CUDA_DECODE,
            device="cuda"),
        "cuda_expand_serving_fp16_slice_n1024_r32": lambda: check_expand(
            lora, n=1024, rank=32, dtype=torch.float16, tol=CUDA_BF16_TOL, kind="column_slice", h_offset=32,
            segments=SERVING, device="cuda"),
        "cuda_fused_qkv_bf16_k4096_r16": lambda: check_fused_qkv(lora, k=4096, rank=16, n_parts=(4096, 1024, 1024),
                                                                 dtype=bf16, tol=CUDA_BF16_TOL, device="cuda"),
    })
    return checks


def _aot_compile(lora):
    """Compile both kernels for sm_90 without a GPU (Triton's bundled ptxas), bf16 and fp32, with the JIT's
    unit-stride specialisation of the weights' and x's last dims, to catch what the interpreter lets through."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_one(fn, ptrs, constexprs):
        sig = {n: "constexpr" if n in constexprs else ptrs.get(n, "i32") for n in fn.arg_names}
        triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})

    idx = dict(sorted_rows_ptr="*i32", seg_start_ptr="*i32", seg_slot_ptr="*i32")
    for dtype, fp32 in (("bf16", False), ("fp32", True)):
        compile_one(lora._lora_shrink_kernel, dict(idx, x_ptr=f"*{dtype}", a_ptr=f"*{dtype}", h_ptr="*fp32"),
                    dict(stride_xk=1, stride_ak=1, stride_hr=1, BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, SPLIT_K=1,
                         DOT_FP32=fp32))
        compile_one(lora._lora_shrink_kernel, dict(idx, x_ptr=f"*{dtype}", a_ptr=f"*{dtype}", h_ptr="*fp32"),
                    dict(stride_xk=1, stride_ak=1, stride_hr=1, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=8,
                         DOT_FP32=fp32))
        compile_one(lora._lora_expand_kernel, dict(idx, h_ptr="*fp32", b_ptr=f"*{dtype}", out_ptr=f"*{dtype}"),
                    dict(stride_hr=1, stride_br=1, BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, DOT_IEEE=fp32))


# ------------------------------------------------------------------------------------------------ the tests


def test_reference_matches_per_row_loop():
    """The reference itself (plain torch, no Triton needed), bf16 weights, with an empty segment."""
    from twinserve.gpu.kernels import triton_lora as lora

    g = torch.Generator().manual_seed(11)
    sorted_rows, seg_start, seg_slot, rows_per_segment = make_segments(**SEGMENTS)
    x = _randn((32, 40), g, dtype=torch.bfloat16)
    lora_a = _randn((4, 8, 40), g, 0.2, torch.bfloat16)
    lora_b = _randn((4, 24, 8), g, 0.3, torch.bfloat16)
    h = lora.lora_shrink_reference(x, lora_a, sorted_rows, seg_start, seg_slot)
    assert torch.allclose(h, naive_shrink(x, lora_a, rows_per_segment, seg_slot.tolist()), atol=1e-5)
    out = _randn((32, 24), g, dtype=torch.bfloat16)
    ref, naive = out.clone(), out.clone()
    lora.lora_expand_reference(h, lora_b, sorted_rows, seg_start, seg_slot, None, ref)
    naive_expand(h, lora_b, rows_per_segment, seg_slot.tolist(), naive)
    assert torch.equal(ref, naive)


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _worker_results(mode, env_update, timeout=240):
    return worker_results(__file__, mode, env_update, timeout)


@pytest.fixture(scope="module")
def results():
    res = _worker_results("interpret", {"TRITON_INTERPRET": "1"})
    assert res["interpreted"], "kernels were not built by the Triton interpreter"
    return res["checks"]


@needs_triton
def test_check_list_is_complete():
    assert sorted(CHECK_NAMES) == sorted(_checks(None))


@needs_triton
@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_reference(results, name):
    r = results[name]
    assert r["ok"], r


@needs_triton
def test_kernels_compile_for_sm90():
    """Interpreter runs do not type-check like the compiler does: compile each kernel for sm_90 (no GPU)."""
    res = _worker_results("compile", {"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    if res["compile"].startswith("unavailable"):
        pytest.skip(res["compile"])
    assert res["compile"] == "ok", res["compile"]


@pytest.mark.cuda
@needs_triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_match_reference_on_cuda():
    res = _worker_results("cuda", {}, timeout=600)
    failed = {k: v for k, v in res["checks"].items() if not v["ok"]}
    assert not failed, failed


@needs_triton
def test_imports_without_interpreter_and_refuses_cpu_tensors():
    code = (
        "import torch\n"
        "from twinserve.gpu.kernels import triton_lora as lora\n"
        "assert lora.HAS_TRITON and not lora.is_interpreted()\n"
        "i = torch.zeros(1, dtype=torch.int32)\n"
        "try:\n"
        "    lora.lora_shrink(torch.zeros(1, 16), torch.zeros(1, 16, 16), i, torch.tensor([0, 1], dtype=torch.int32), i, 1)\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('expected RuntimeError')\n"
        "print('OK')\n"
    )
    proc = run(["-c", code], {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_shape_errors_name_the_field():
    from twinserve.gpu.kernels import triton_lora as lora

    i32 = torch.int32
    rows, start, slot = torch.arange(3, dtype=i32), torch.tensor([0, 3], dtype=i32), torch.zeros(1, dtype=i32)
    x, a, b, h, out = torch.zeros(4, 32), torch.zeros(2, 8, 32), torch.zeros(2, 16, 8), torch.zeros(4, 8), torch.zeros(4, 16)
    with pytest.raises(ValueError, match="lora_a has K"):
        lora.lora_shrink(x, torch.zeros(2, 8, 16), rows, start, slot, 3)
    with pytest.raises(ValueError, match="lora_a dtype"):
        lora.lora_shrink(x, a.bfloat16(), rows, start, slot, 3)
    with pytest.raises(ValueError, match="seg_start"):
        lora.lora_shrink(x, a, rows, torch.tensor([0, 1, 3], dtype=i32), slot, 3)
    with pytest.raises(ValueError, match="sorted_rows"):
        lora.lora_shrink(x, a, rows.float(), start, slot, 3)
    with pytest.raises(ValueError, match="sorted_rows has 5"):
        lora.lora_shrink(x, a, torch.arange(5, dtype=i32), start, slot, 3)
    with pytest.raises(ValueError, match="max_seg_len"):
        lora.lora_shrink(x, a, rows, start, slot, -1)
    with pytest.raises(ValueError, match="h must be float32"):
        lora.lora_expand(h.bfloat16(), b, rows, start, slot, 3, out)
    with pytest.raises(ValueError, match="h_offset"):
        lora.lora_expand(h, b, rows, start, slot, 3, out, h_offset=1)
    with pytest.raises(ValueError, match="out must be"):
        lora.lora_expand(h, b, rows, start, slot, 3, torch.zeros(4, 15))


if __name__ == "__main__":
    from twinserve.gpu.kernels import triton_lora as module
    work(sys.argv[1] if len(sys.argv) > 1 else "interpret", module, _checks, _cuda_checks,
         _aot_compile)
