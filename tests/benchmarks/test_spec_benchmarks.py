"""The speculative-decoding benchmarks' own logic: which steps count as verifications and as
decodes, and that the attention benchmark's two plans compute the same attention."""

from __future__ import annotations

import torch

from twinserve.benchmarks.spec_decode_cpu import StepTimes, first_differences
from twinserve.benchmarks.spec_prompts import Prompt
from twinserve.benchmarks.verify_attention import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, chunk_plan, rows_plan
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.kernels.cpu_decode_kernel import build_paged_decode
from twinserve.gpu.layers.attention import planned_attention


def _step(prefill: int = 0, spec: int = 0) -> SchedulerOutput:
    out = SchedulerOutput()
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), 0.0)
    out.scheduled.append(ScheduledRequest(request, 3, 1 + spec, [0], True,
                                          spec_token_ids=[5] * spec))
    out.num_prefill_tokens, out.num_spec_tokens = prefill, spec
    return out


def test_step_times_sort_steps_by_kind():
    times = StepTimes()
    times.record(_step(spec=4), 0.03)
    times.record(_step(), 0.02)
    times.record(_step(prefill=12), 0.05)  # a prompt's step: neither
    times.record(SchedulerOutput(), 0.001)  # nothing scheduled: neither
    assert times.verify == [0.03] and times.decode == [0.02]


def test_the_attention_benchmark_times_the_same_attention_both_ways():
    context, queries = 70, 5
    gen = torch.Generator().manual_seed(1)
    blocks = -(-context // BLOCK_SIZE)
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    tables = torch.arange(blocks, dtype=torch.int32)[None]
    query = torch.randn(queries, HEADS, HEAD_DIM, generator=gen)
    chunk = chunk_plan(tables, context, queries)
    rows = rows_plan(tables, context, queries, build_paged_decode())
    assert chunk.decode_rows is None and len(chunk.prefills) == 1
    assert rows.prefills == [] and rows.decode_lens.tolist() == [66, 67, 68, 69, 70]
    torch.testing.assert_close(planned_attention(query, key_cache, value_cache, rows, 0.125),
                               planned_attention(query, key_cache, value_cache, chunk, 0.125),
                               atol=2e-5, rtol=2e-5)


def test_first_differences_name_the_prompt_and_the_token_where_outputs_part():
    prompts = [Prompt("a", (("user", "x"),)), Prompt("b", (("user", "y"),)),
               Prompt("c", (("user", "z"),))]
    reference = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert first_differences(reference, reference, prompts) == []
    assert first_differences([[1, 2, 3], [4, 9, 6], [7, 8, 0]], reference, prompts) == [("b", 1), ("c", 2)]
