"""The native CPU paged decode kernel against the plain-torch path, and its input checks; short
chunks (a verification's 1 + k queries) served as its decode rows."""

from __future__ import annotations

import os

import pytest
import torch
from attention_reference import make_batch, ref_paged_attention

from twinserve.core.kernel_settings import MAX_ROWS_AS_DECODES_AREA, rows_as_decodes
from twinserve.gpu.kernels.cpu_decode_kernel import build_paged_decode, load_paged_decode
from twinserve.gpu.layers.attention import paged_attention, plan_attention, planned_attention
from twinserve.gpu.layers.attention_backend import AttentionBackend


def _decode_batch(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, block_size: int = 16, max_context: int = 90):
    gen = torch.Generator().manual_seed(num_seqs * 100 + num_heads + head_dim)
    lens = torch.randint(1, max_context + 1, (num_seqs,), generator=gen, dtype=torch.int32)
    width = -(-max_context // block_size)
    num_blocks = num_seqs * width + 3
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                              generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * width].view(num_seqs, width)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen).to(dtype)
    return query, key_cache, value_cache, tables.to(torch.int32), lens


@pytest.mark.parametrize("num_seqs", [1, 3, 33])            # split by KV head, and by sequence
@pytest.mark.parametrize("heads,kv_heads,head_dim", [
    (9, 3, 64),     # SmolLM2: a group of 3
    (4, 4, 32),     # multi-head attention
    (8, 2, 128),    # a group of 4
    (18, 2, 16),    # a group of 9: the generic dot path
    (6, 3, 12),     # head_dim not a multiple of 8: the generic dot path
])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 5e-3)])
def test_native_decode_equals_torch_path(num_seqs, heads, kv_heads, head_dim, dtype, tol):
    query, key_cache, value_cache, tables, lens = _decode_batch(num_seqs, heads, kv_heads,
                                                                head_dim, dtype)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    scale = head_dim ** -0.5
    want = paged_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens,
                           starts, scale)
    got = build_paged_decode()(query, key_cache, value_cache, tables, lens, scale)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("block_size", [5, 8, 24])  # blocks that end inside or on an 8-token group
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_native_decode_handles_any_block_size(block_size, dtype, tol):
    query, key_cache, value_cache, tables, lens = _decode_batch(4, 9, 3, 64, dtype, block_size)
    starts = torch.arange(5, dtype=torch.int32)
    want = paged_attention(query.float(), key_cache.float(), value_cache.float(), tables, lens,
                           starts, 0.125)
    got = build_paged_decode()(query, key_cache, value_cache, tables, lens, 0.125)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_native_decode_reads_a_non_contiguous_query():
    query, key_cache, value_cache, tables, lens = _decode_batch(5, 9, 3, 64, torch.float32)
    wide = torch.cat([query, torch.zeros_like(query)], dim=1)[:, :9]   # strided view
    kernel = build_paged_decode()
    torch.testing.assert_close(kernel(wide, key_cache, value_cache, tables, lens, 0.125),
                               kernel(query.contiguous(), key_cache, value_cache, tables, lens,
                                      0.125))


@pytest.mark.parametrize("bad_len", [0, 10_000])
def test_native_decode_rejects_context_outside_the_block_table(bad_len):
    query, key_cache, value_cache, tables, lens = _decode_batch(2, 9, 3, 64, torch.float32)
    lens[1] = bad_len
    with pytest.raises(RuntimeError, match="seq_lens must lie"):
        build_paged_decode()(query, key_cache, value_cache, tables, lens, 0.125)


def test_cpu_backend_uses_the_kernel_the_engine_argument_names():
    assert AttentionBackend(torch.device("cpu")).decode_kernel is not None
    assert AttentionBackend(torch.device("cpu"), cpu_attention="native").decode_kernel \
        is build_paged_decode()
    assert AttentionBackend(torch.device("cpu"), cpu_attention="torch").decode_kernel is None


def test_unknown_cpu_attention_choice_is_named():
    with pytest.raises(ValueError, match="cpu_attention must be one of native, torch; got 'fast'"):
        load_paged_decode("fast")
    with pytest.raises(ValueError, match="cpu_attention must be one of native, torch; got 'fast'"):
        AttentionBackend(torch.device("cpu"), cpu_attention="fast")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one CPU")
def test_kernel_is_built_with_openmp(two_torch_threads) -> None:
    """Without OpenMP, ATen's at::parallel_for runs the kernel's sequences on the calling
    thread alone (as it did until this test)."""
    build_paged_decode()
    assert torch.ops.twinserve_cpu.cpu_parallel_threads(64) == 2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_short_chunks_run_as_decode_rows_and_equal_the_reference(dtype, tol):
    # a decode, a verification of 4 drafts over a short context (decode rows), one over a long
    # context (a masked chunk), a short fresh prompt (decode rows) and a long one (a chunk)
    long_context = MAX_ROWS_AS_DECODES_AREA // 5 + 40
    seq_lens, query_lens = [37, 60, long_context, 9, 40], [1, 5, 5, 9, 40]
    assert [rows_as_decodes(q, s) for q, s in zip(query_lens, seq_lens)] == [True, True, False,
                                                                             True, False]
    batch = make_batch(seq_lens, query_lens, num_q_heads=9, num_kv_heads=3, head_dim=64,
                       block_size=16, dtype=dtype, seed=3)
    plan = plan_attention(batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 16,
                          build_paged_decode())
    # rows 0 (decode), 1-5 (short verification) and 11-19 (short prompt) in the decode kernel
    assert plan.decode_rows.tolist() == [0, 1, 2, 3, 4, 5, *range(11, 20)]
    assert plan.decode_lens.tolist() == [37, 56, 57, 58, 59, 60, *range(1, 10)]
    assert [(start, end) for start, end, _, _ in plan.prefills] == [(6, 11), (20, 60)]
    out = planned_attention(batch["query"], batch["key_cache"], batch["value_cache"], plan,
                            batch["scale"])
    ref = ref_paged_attention(**batch)
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
