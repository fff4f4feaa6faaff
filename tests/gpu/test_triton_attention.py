"""Triton paged attention (gpu/kernels/triton_attention.py) against a dense torch reference, in Triton's interpreter.

Triton decides interpreted-or-compiled when a kernel is decorated, i.e. when the module is first imported; if
another test imported it earlier without TRITON_INTERPRET=1 the kernels would try to compile for a GPU. So the
kernel comparisons run once, in a subprocess started with TRITON_INTERPRET=1 that runs this file as a script
(``python tests/gpu/test_triton_attention.py``) and prints one JSON line of results; each test asserts on its entry.
"""

import sys

import pytest
import torch
from attention_reference import make_batch, ref_paged_attention
from triton_worker import run, work, worker_results

# ------------------------------------------------------------------------------------------ cases

DECODE = dict(seq_lens=[7, 33, 50], query_lens=[1, 1, 1])
MIXED = dict(seq_lens=[5, 23, 40, 17], query_lens=[5, 3, 1, 1])  # prefill 5, extend 3 on 20, two decodes
FP32_TOL, BF16_TOL = 1e-4, 1e-2  # on max |out - ref| / (1 + |ref|)


def _compare(fn, batch, tol, **kwargs):
    out = fn(**batch, **kwargs).cpu()
    masking = {k: kwargs[k] for k in ("window", "softcap") if k in kwargs}
    ref = ref_paged_attention(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()},
                              **masking)
    assert out.shape == batch["query"].shape and out.dtype == batch["query"].dtype
    return float(((out.float() - ref).abs() / (1.0 + ref.abs())).max()), tol


def _check_routing(ta, batch, expected):
    """paged_attention must call `expected` ("decode" or "prefill") and still match the reference."""
    originals = {"decode": ta.paged_decode_attention, "prefill": ta.paged_prefill_attention}
    calls = []

    def spy(kind):
        def wrapped(*args, **kwargs):
            calls.append(kind)
            return originals[kind](*args, **kwargs)
        return wrapped

    ta.paged_decode_attention, ta.paged_prefill_attention = spy("decode"), spy("prefill")
    try:
        result = _compare(ta.paged_attention, batch, FP32_TOL)
    finally:
        ta.paged_decode_attention, ta.paged_prefill_attention = originals["decode"], originals["prefill"]
    assert calls == [expected], calls
    return result


def _check_write_kv_cache(ta, dtype, tol, device="cpu"):
    """Against index_put; shuffled slots across blocks, and two padding tokens (slot -1) left unwritten."""
    g = torch.Generator().manual_seed(1)
    num_blocks, block_size, hkv, d, t = 6, 16, 2, 64, 21
    key = torch.randn((t, hkv, d), generator=g).to(dtype)
    value = torch.randn((t, hkv, d), generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t].long()
    slots[[4, 17]] = -1
    written = slots >= 0
    key_cache = torch.zeros((num_blocks, block_size, hkv, d), dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    ref_k, ref_v = key_cache.clone(), value_cache.clone()
    ref_k.view(-1, hkv, d).index_put_((slots[written],), key[written])
    ref_v.view(-1, hkv, d).index_put_((slots[written],), value[written])
    kc, vc = key_cache.to(device), value_cache.to(device)
    ta.write_kv_cache(key.to(device), value.to(device), kc, vc, slots.to(device))
    err = max(float((kc.cpu().float() - ref_k.float()).abs().max()),
              float((vc.cpu().float() - ref_v.float()).abs().max()))
    return err, tol


def _check_write_then_attend(ta, device="cpu"):
    """Engine order: write the step's new K/V with the kernel, then attend (mixed batch, fp32)."""
    batch = make_batch(**MIXED, seed=3, device=device)
    g = torch.Generator().manual_seed(4)
    kc, vc, bt = batch["key_cache"], batch["value_cache"], batch["block_tables"].cpu()
    block_size, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    slots = []
    for b, (seq_len, q_len) in enumerate(zip(MIXED["seq_lens"], MIXED["query_lens"])):
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(bt[b, pos // block_size]) * block_size + pos % block_size)
    slots = torch.tensor(slots, dtype=torch.int64, device=device)
    new_k = torch.randn((len(slots), hkv, d), generator=g).to(device)
    new_v = torch.randn((len(slots), hkv, d), generator=g).to(device)
    ta.write_kv_cache(new_k, new_v, kc, vc, slots)
    assert torch.equal(kc.view(-1, hkv, d)[slots], new_k) and torch.equal(vc.view(-1, hkv, d)[slots], new_v)
    return _compare(ta.paged_attention, batch, FP32_TOL)


def _checks(ta, device="cpu"):
    """name -> zero-argument callable returning (error, tol); small shapes for the interpreter."""
    bf16 = torch.bfloat16

    def batch(**kw):
        return make_batch(**kw, device=device)

    return {
        "write_kv_cache_fp32": lambda: _check_write_kv_cache(ta, torch.float32, 0.0, device),
        "write_kv_cache_bf16": lambda: _check_write_kv_cache(ta, bf16, 0.0, device),
        "write_then_attend_mixed_fp32": lambda: _check_write_then_attend(ta, device),
        # decode kernel, directly and through the dispatcher
        "decode_fp32_d64": lambda: _compare(ta.paged_decode_attention, batch(**DECODE), FP32_TOL, num_splits=1),
        "dispatch_decode_fp32_d64": lambda: _check_routing(ta, batch(**DECODE), "decode"),
        "decode_fp32_d32": lambda: _compare(ta.paged_decode_attention, batch(**DECODE, head_dim=32), FP32_TOL,
                                            num_splits=1),
        "decode_bf16_d64": lambda: _compare(ta.paged_decode_attention, batch(**DECODE, dtype=bf16), BF16_TOL,
                                            num_splits=1),
        "decode_fp16_d64": lambda: _compare(ta.paged_decode_attention, batch(**DECODE, dtype=torch.float16),
                                            BF16_TOL),
        "decode_splitk3_fp32_d64": lambda: _compare(ta.paged_decode_attention, batch(**DECODE), FP32_TOL,
                                                    num_splits=3, block_n=16),
        # 5 splits of one 16-wide tile each: the 7-token sequence leaves 4 splits empty
        "decode_splitk5_bf16_d32": lambda: _compare(ta.paged_decode_attention,
                                                    batch(**DECODE, head_dim=32, dtype=bf16), BF16_TOL,
                                                    num_splits=5, block_n=16),
        "decode_mqa_block8": lambda: _compare(ta.paged_decode_attention,
                                              batch(**DECODE, num_kv_heads=1, block_size=8), FP32_TOL,
                                              num_splits=2),
        # prefill / extend kernel on a mixed batch, through the dispatcher
        "mixed_fp32_d64": lambda: _check_routing(ta, batch(**MIXED), "prefill"),
        "mixed_fp32_d32": lambda: _compare(ta.paged_attention, batch(**MIXED, head_dim=32), FP32_TOL),
        "mixed_bf16_d64": lambda: _compare(ta.paged_attention, batch(**MIXED, dtype=bf16), BF16_TOL),
        # several query tiles and KV tiles (8 query tokens x 2 heads per 16-row tile), a 21-token prefill
        "prefill_small_tiles_fp32": lambda: _compare(
            ta.paged_prefill_attention, batch(seq_lens=[21, 30, 9], query_lens=[21, 10, 1], seed=5),
            FP32_TOL, block_m=16, block_n=16),
        # group of 3 (not a power of 2), head_dim 48 (masked), block_size 8 with 32-wide KV tiles
        "prefill_group3_d48_block8": lambda: _compare(
            ta.paged_attention,
            batch(seq_lens=[12, 26], query_lens=[12, 6], num_q_heads=6, num_kv_heads=2, head_dim=48,
                  block_size=8, seed=6),
            FP32_TOL),
        # sliding window (Mistral, Gemma's local layers): windows shorter and longer than the sequences,
        # with split-K decode; soft-capping (Gemma 2)
        "decode_window5_fp32": lambda: _compare(ta.paged_decode_attention, batch(**DECODE), FP32_TOL,
                                                num_splits=1, window=5),
        "decode_window20_splitk3_fp32": lambda: _compare(ta.paged_decode_attention, batch(**DECODE), FP32_TOL,
                                                         num_splits=3, block_n=16, window=20),
        "mixed_window6_fp32": lambda: _compare(ta.paged_attention, batch(**MIXED), FP32_TOL, window=6),
        "prefill_window9_small_tiles_fp32": lambda: _compare(
            ta.paged_prefill_attention, batch(seq_lens=[21, 30, 9], query_lens=[21, 10, 1], seed=5),
            FP32_TOL, block_m=16, block_n=16, window=9),
        "mixed_softcap_window_fp32": lambda: _compare(ta.paged_attention, batch(**MIXED), FP32_TOL,
                                                      window=6, softcap=0.5),
        "decode_softcap_bf16": lambda: _compare(ta.paged_decode_attention, batch(**DECODE, dtype=bf16),
                                                BF16_TOL, softcap=0.5),
    }


CHECK_NAMES = [
    "decode_window5_fp32", "decode_window20_splitk3_fp32", "mixed_window6_fp32",
    "prefill_window9_small_tiles_fp32", "mixed_softcap_window_fp32", "decode_softcap_bf16",
    "write_kv_cache_fp32", "write_kv_cache_bf16", "write_then_attend_mixed_fp32",
    "decode_fp32_d64", "dispatch_decode_fp32_d64", "decode_fp32_d32", "decode_bf16_d64", "decode_fp16_d64",
    "decode_splitk3_fp32_d64", "decode_splitk5_bf16_d32", "decode_mqa_block8",
    "mixed_fp32_d64", "mixed_fp32_d32", "mixed_bf16_d64", "prefill_small_tiles_fp32",
    "prefill_group3_d48_block8",
]

CUDA_BF16_TOL = 3e-2  # tensor-core bf16 dots, P rounded to bf16 before P @ V


def _cuda_checks(ta):
    """Serving-sized shapes on a real GPU (compiled kernels, native bf16 dots, default tiles and splits)."""
    bf16 = torch.bfloat16
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda")
    smol = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, device="cuda")
    decode = dict(seq_lens=[1, 17, 300, 1000, 2049, 64], query_lens=[1] * 6)
    long_decode = dict(seq_lens=[4000, 33], query_lens=[1, 1])  # 2 x 8 programs: split-K kicks in
    mixed = dict(seq_lens=[300, 700, 129, 1000, 5], query_lens=[300, 200, 1, 1, 5])
    checks = {f"cuda_{k}": v for k, v in _checks(ta, "cuda").items()}
    checks.update({
        "cuda_decode_llama_bf16": lambda: _compare(ta.paged_attention, make_batch(**decode, **llama, dtype=bf16),
                                                   CUDA_BF16_TOL),
        "cuda_decode_llama_fp32": lambda: _compare(ta.paged_attention, make_batch(**decode, **llama), FP32_TOL),
        "cuda_decode_splitk_auto_bf16": lambda: _compare(ta.paged_attention,
                                                         make_batch(**long_decode, **llama, dtype=bf16),
                                                         CUDA_BF16_TOL),
        "cuda_decode_smol_fp16": lambda: _compare(ta.paged_attention,
                                                  make_batch(**decode, **smol, dtype=torch.float16),
                                                  CUDA_BF16_TOL),
        "cuda_mixed_llama_bf16": lambda: _compare(ta.paged_attention, make_batch(**mixed, **llama, dtype=bf16),
                                                  CUDA_BF16_TOL),
        "cuda_mixed_smol_bf16": lambda: _compare(ta.paged_attention, make_batch(**mixed, **smol, dtype=bf16),
                                                 CUDA_BF16_TOL),
        "cuda_mixed_smol_fp32": lambda: _compare(ta.paged_attention, make_batch(**mixed, **smol), FP32_TOL),
    })
    return checks


def _aot_compile(ta):
    """Compile the CUDA kernels for sm_90 without a GPU (Triton's bundled ptxas), as the JIT would for
    contiguous bf16 tensors (unit last-dim strides), to catch what the interpreter lets through."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_one(fn, ptrs, constexprs, num_warps):
        constexprs = dict(constexprs)
        constexprs.update({n: 1 for n in fn.arg_names if n.startswith("stride_") and n.endswith("d")})
        sig = {n: "constexpr" if n in constexprs else ptrs.get(
            n, "fp32" if n in ("scale_log2", "softcap") else "i32")
               for n in fn.arg_names}
        src = ASTSource(fn, sig, constexprs)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})

    io = {n: "*bf16" for n in ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "key_ptr", "value_ptr",
                                "key_cache_ptr", "value_cache_ptr"]}
    io.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32", slot_mapping_ptr="*i64",
              part_acc_ptr="*fp32", part_ml_ptr="*fp32")
    compile_one(ta._write_kv_cache_kernel, io, dict(BLOCK_H=8, BLOCK_D=128), 4)
    compile_one(ta._paged_decode_kernel, io, dict(GROUP=3, BLOCK_G=16, BLOCK_N=64, BLOCK_D=64, NUM_SPLITS=4,
                                                  DOT_FP32=False, SOFTCAP=False), 4)
    compile_one(ta._decode_reduce_kernel, io, dict(NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=64), 4)
    compile_one(ta._paged_prefill_kernel, io, dict(GROUP=3, BLOCK_Q=21, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64,
                                                   DOT_FP32=False, SOFTCAP=True), 4)


# ------------------------------------------------------------------------------------------------ the tests

pytest.importorskip("triton")


def _worker_results(mode, env_update, timeout=240):
    return worker_results(__file__, mode, env_update, timeout)


@pytest.fixture(scope="module")
def results():
    res = _worker_results("interpret", {"TRITON_INTERPRET": "1"})
    assert res["interpreted"], "kernels were not built by the Triton interpreter"
    return res["checks"]


def test_check_list_is_complete():
    assert sorted(CHECK_NAMES) == sorted(_checks(None))


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_kernel_matches_reference(results, name):
    r = results[name]
    assert r["ok"], r


def test_kernels_compile_for_sm90():
    """Interpreter runs do not type-check like the compiler does: compile each kernel for sm_90 (no GPU)."""
    res = _worker_results("compile", {"CUDA_VISIBLE_DEVICES": ""}, timeout=300)
    if res["compile"].startswith("unavailable"):
        pytest.skip(res["compile"])
    assert res["compile"] == "ok", res["compile"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kernels_match_reference_on_cuda():
    res = _worker_results("cuda", {}, timeout=600)
    failed = {k: v for k, v in res["checks"].items() if not v["ok"]}
    assert not failed, failed


def test_imports_without_interpreter_and_refuses_cpu_tensors():
    code = (
        "import torch\n"
        "from twinserve.gpu.kernels import triton_attention as ta\n"
        "assert ta.HAS_TRITON and not ta.is_interpreted()\n"
        "q = torch.zeros(1, 2, 16); kc = torch.zeros(2, 16, 1, 16)\n"
        "args = (q, kc, kc.clone(), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32),\n"
        "        torch.tensor([0, 1], dtype=torch.int32), 0.25)\n"
        "try:\n"
        "    ta.paged_attention(*args)\n"
        "except RuntimeError as e:\n"
        "    assert 'TRITON_INTERPRET' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('expected RuntimeError')\n"
        "print('OK')\n"
    )
    proc = run(["-c", code], {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


def test_shape_errors_name_the_field():
    from twinserve.gpu.kernels import triton_attention as ta

    b = make_batch(seq_lens=[3], query_lens=[3], head_dim=16)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ta.paged_attention(**{**b, "query": torch.zeros(3, 3, 16)})
    with pytest.raises(ValueError, match="head_dim"):
        ta.paged_attention(**{**b, "query": torch.zeros(3, 4, 32)})
    with pytest.raises(ValueError, match="query_start_loc"):
        ta.paged_prefill_attention(**{**b, "query_start_loc": torch.tensor([0, 1, 3], dtype=torch.int32)})
    with pytest.raises(ValueError, match="slot_mapping"):
        ta.write_kv_cache(torch.zeros(2, 2, 16), torch.zeros(2, 2, 16), b["key_cache"], b["value_cache"],
                          torch.zeros(3, dtype=torch.int64))


def test_reference_matches_sdpa_for_a_single_prefill():
    """The reference itself: a full prefill equals torch's causal SDPA on the gathered K/V."""
    b = make_batch(seq_lens=[20], query_lens=[20], head_dim=16)
    ref = ref_paged_attention(**b)
    pages = b["block_tables"][0, :2].long()
    k = b["key_cache"][pages].reshape(-1, 2, 16)[:20].repeat_interleave(2, 1)
    v = b["value_cache"][pages].reshape(-1, 2, 16)[:20].repeat_interleave(2, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        b["query"].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    assert torch.allclose(ref, sdpa, atol=1e-5)


if __name__ == "__main__":
    from twinserve.gpu.kernels import triton_attention as module
    work(sys.argv[1] if len(sys.argv) > 1 else "interpret", module, _checks, _cuda_checks,
         _aot_compile)
