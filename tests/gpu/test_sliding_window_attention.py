"""Sliding-window and soft-capped attention on the CPU paths (the torch planner with and without the
native decode kernel) against the dense reference. Blocks wholly outside a sequence's window are
pointed at a block of NaNs, as the KV manager frees them: a kernel that read one would fail."""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_batch, ref_paged_attention

from twinserve.gpu.kernels.cpu_decode_kernel import load_paged_decode
from twinserve.gpu.layers.attention import paged_attention

DECODE = dict(seq_lens=[7, 33, 50, 64], query_lens=[1, 1, 1, 1])
MIXED = dict(seq_lens=[5, 23, 40, 17, 61], query_lens=[5, 3, 1, 1, 12])


def _poison_outside(batch: dict, window: int) -> dict:
    """A NaN block at the table entries no query of the step can see (as freed blocks are)."""
    kc, vc = batch["key_cache"], batch["value_cache"]
    block_size = kc.shape[1]
    poison = torch.full((1, *kc.shape[1:]), float("nan"), dtype=kc.dtype)
    batch["key_cache"] = torch.cat([kc, poison])
    batch["value_cache"] = torch.cat([vc, poison])
    tables = batch["block_tables"].clone()
    starts = batch["query_start_loc"].tolist()
    for b, seq_len in enumerate(batch["seq_lens"].tolist()):
        first_query = seq_len - (starts[b + 1] - starts[b])
        first_visible = max(0, first_query - window + 1)
        tables[b, :first_visible // block_size] = kc.shape[0]
    batch["block_tables"] = tables
    return batch


def _kernels() -> list:
    kernel = load_paged_decode()
    return [None] if kernel is None else [None, kernel]


@pytest.mark.parametrize("shape", [DECODE, MIXED], ids=["decode", "mixed"])
@pytest.mark.parametrize(("window", "softcap"), [(6, None), (17, None), (200, None), (None, 0.7),
                                                 (9, 0.7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_windowed_and_capped_attention_equals_the_reference(shape, window, softcap, dtype) -> None:
    batch = make_batch(**shape, num_q_heads=6, num_kv_heads=2, head_dim=32, block_size=4, dtype=dtype,
                       seed=7)
    ref = ref_paged_attention(**batch, window=window, softcap=softcap)
    if window is not None:
        batch = _poison_outside(batch, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for kernel in _kernels():
        out = paged_attention(**batch, decode_kernel=kernel, window=window, softcap=softcap)
        assert out.dtype == dtype and not out.isnan().any()
        err = float(((out.float() - ref).abs() / (1 + ref.abs())).max())
        assert err <= tol, (kernel is not None, err)


def test_a_window_changes_the_result_and_a_long_one_does_not() -> None:
    batch = make_batch(**MIXED, head_dim=32, block_size=4, seed=8)
    full = paged_attention(**batch)
    assert torch.allclose(paged_attention(**batch, window=1000), full, atol=1e-6)
    assert not torch.allclose(paged_attention(**batch, window=6), full, atol=1e-3)


def test_the_native_kernel_refuses_a_negative_window() -> None:
    kernel = load_paged_decode()
    if kernel is None:
        pytest.skip("the native decode kernel is not built here")
    b = make_batch(**DECODE, head_dim=32, block_size=4)
    with pytest.raises(RuntimeError, match="window and softcap must be >= 0"):
        kernel(b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["seq_lens"],
               b["scale"], -1, 0.0)
