"""Triton paged attention on verification batches (speculative decoding): each sequence's query
is its last token plus k drafts (1 + k rows attending causally to the cached context), beside
decodes and a prefill chunk, against the dense torch reference in Triton's interpreter (the
worker pattern of ``test_triton_attention.py``; on CUDA the same and serving-sized batches)."""

import sys

import pytest
import torch
from attention_reference import make_batch, ref_paged_attention
from triton_worker import work, worker_results

FP32_TOL, BF16_TOL, CUDA_BF16_TOL = 1e-4, 1e-2, 3e-2

# k = 4, 2, 0 (a plain decode) and 4 beside a 6-token prefill chunk; contexts across block edges
VERIFY = dict(seq_lens=[20, 35, 9, 16], query_lens=[5, 3, 1, 5])
VERIFY_MIXED = dict(seq_lens=[20, 6, 33], query_lens=[5, 6, 3])
VERIFY_ONLY = dict(seq_lens=[17, 48], query_lens=[5, 5])


def _compare(ta, batch, tol, **kwargs):
    out = ta.paged_attention(**batch, **kwargs).cpu()
    ref = ref_paged_attention(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()},
                              **kwargs)
    assert out.shape == batch["query"].shape
    return float(((out.float() - ref).abs() / (1.0 + ref.abs())).max()), tol


def _checks(ta, device="cpu"):
    def batch(**kw):
        return make_batch(**kw, device=device)

    bf16 = torch.bfloat16
    return {
        "verify_fp32": lambda: _compare(ta, batch(**VERIFY), FP32_TOL),
        "verify_bf16": lambda: _compare(ta, batch(**VERIFY, dtype=bf16), BF16_TOL),
        "verify_mixed_fp32": lambda: _compare(ta, batch(**VERIFY_MIXED, seed=2), FP32_TOL),
        "verify_only_block8_group3": lambda: _compare(
            ta, batch(**VERIFY_ONLY, num_q_heads=6, num_kv_heads=2, block_size=8, seed=3),
            FP32_TOL),
        "verify_window7_fp32": lambda: _compare(ta, batch(**VERIFY, seed=4), FP32_TOL, window=7),
    }


def _cuda_checks(ta):
    smol = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, device="cuda")
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda")
    serving = dict(seq_lens=[300, 1000, 2049, 65, 512], query_lens=[5, 5, 3, 1, 5])
    checks = {f"cuda_{k}": v for k, v in _checks(ta, "cuda").items()}
    checks.update({
        "cuda_verify_smol_bf16": lambda: _compare(ta, make_batch(**serving, **smol,
                                                                 dtype=torch.bfloat16),
                                                  CUDA_BF16_TOL),
        "cuda_verify_llama_bf16": lambda: _compare(ta, make_batch(**serving, **llama,
                                                                  dtype=torch.bfloat16),
                                                   CUDA_BF16_TOL),
    })
    return checks


CHECK_NAMES = ["verify_fp32", "verify_bf16", "verify_mixed_fp32", "verify_only_block8_group3",
               "verify_window7_fp32"]

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def results():
    res = worker_results(__file__, "interpret", {"TRITON_INTERPRET": "1"})
    assert res["interpreted"], "kernels were not built by the Triton interpreter"
    return res["checks"]


def test_check_list_is_complete():
    assert sorted(CHECK_NAMES) == sorted(_checks(None))


@pytest.mark.parametrize("name", CHECK_NAMES)
def test_verification_batch_matches_reference(results, name):
    assert results[name]["ok"], results[name]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_verification_batches_on_cuda():
    res = worker_results(__file__, "cuda", {}, timeout=600)
    failed = {k: v for k, v in res["checks"].items() if not v["ok"]}
    assert not failed, failed


if __name__ == "__main__":
    from twinserve.gpu.kernels import triton_attention

    work(sys.argv[1], triton_attention, _checks, _cuda_checks, lambda ta: None)
