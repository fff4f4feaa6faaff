"""Pipeline parallelism in the real engine: the stages' layer split, PP=2 worker processes (gloo on
the CPU), greedy tokens equal to PP=1's under prefix caching, chunked prefill and preemption
(recompute for an untied Llama with an odd layer count, swap for a tied Qwen2 whose last stage
holds the embedding as its head), TP=2 x PP=2 (slow), refusals, and no process left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import _build_tiny

from twinserve.core.engine_args import EngineArgs
from twinserve.core.model_config import ModelConfig
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.distributed.pipeline import StageLayout, stage_layer_range
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.gpu.executor.executor_base import WorkerFailure
from twinserve.gpu.executor.tp_driver import check_tensor_parallel

MAX_TOKENS = 16
REGIME = dict(max_num_batched_tokens=16, num_gpu_blocks_override=10, enable_prefix_caching=True)


@pytest.mark.parametrize(("layers", "pp", "expected"), [
    (32, 4, [(0, 8), (8, 16), (16, 24), (24, 32)]),
    (32, 3, [(0, 11), (11, 22), (22, 32)]),  # vLLM's get_pp_indices: the last stage the fewest
    (3, 2, [(0, 2), (2, 3)]),
    (5, 5, [(i, i + 1) for i in range(5)]),
])
def test_layers_split_evenly_with_the_remainder_before_the_last_stage(layers, pp, expected) -> None:
    assert [stage_layer_range(layers, pp, r) for r in range(pp)] == expected


def test_ranks_are_numbered_stage_major_as_vllm_numbers_them() -> None:
    layout = StageLayout.of(rank=3, tp_size=2, pp_size=2, num_layers=4)
    assert (layout.pp_rank, layout.tp_rank, layout.start, layout.end) == (1, 1, 2, 4)
    assert layout.is_last and not layout.is_first and layout.holds(3) and not layout.holds(1)
    with pytest.raises(ValueError, match=r"num_hidden_layers \(2\) must be at least pipeline"):
        stage_layer_range(2, 3, 0)


def _prompts() -> list[list[int]]:
    shared = list(range(3, 35))  # two prompts share 32 tokens: prefix hits
    own = [[(7 * i + 3 * n) % 120 + 3 for i in range(n)] for n in (5, 17, 33, 9, 40)]
    return own[:3] + [shared + [11, 12], shared + [13]] + own[3:]


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[i] for i in ids]


def _engine(model_dir: Path, pp: int, tp: int = 1, **extra) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", pipeline_parallel_size=pp,
                                tensor_parallel_size=tp, max_model_len=128, swap_space=0.01,
                                **{**REGIME, **extra}))


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    """Three layers (split 2 + 1), untied head, 4 KV heads (TP=2 splits them)."""
    return _build_tiny(tmp_path_factory.mktemp("pp") / "llama3", "llama",
                       {"num_hidden_layers": 3, "num_key_value_heads": 4,
                        "tie_word_embeddings": False})


@pytest.fixture(scope="module")
def llama3_expected(llama3) -> list[list[int]]:
    engine = _engine(llama3, 1)
    tokens = _run(engine, _prompts())
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.kv.prefix_hits > 0
    return tokens


@pytest.fixture(scope="module")
def llama3_pp2(llama3) -> Iterator[LLMEngine]:
    engine = _engine(llama3, 2)
    yield engine
    engine.shutdown()


def test_pp2_greedy_tokens_equal_pp1_under_prefix_caching_chunks_and_recompute(
        llama3_pp2, llama3_expected) -> None:
    engine = llama3_pp2
    model = engine.runner.model
    assert model.layer_range == (0, 2) and model.norm is None and model.lm_head is None
    assert engine.runner.kv_cache.spec.num_layers == 2  # the driver's stage's layers only
    assert engine.batch_queue is not None and engine.batch_queue.depth == 2
    assert _run(engine, _prompts()) == llama3_expected
    sched = engine.scheduler
    assert sched.num_preemptions > 0 and sched.kv.prefix_hits > 0
    assert max(s.num_prefill_tokens for s in engine.metrics.steps) <= 16
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    # the batches overlapped: two were in the pipeline at once, never with a request in both
    assert engine.runner.tp.max_batches_in_flight == 2 and engine.runner.tp.batches_in_flight == 0
    assert not sched.in_flight and _overlapping_batches_share_no_request(engine.metrics.steps)


def _overlapping_batches_share_no_request(steps) -> bool:
    """Some recorded steps overlap in time (a step's record spans its batch's submit to its
    finish); ``BatchQueue.push`` refuses a request already in flight, so none shared one."""
    spans = sorted((s.time, s.time + s.duration) for s in steps)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))


def test_pp2_without_the_batch_queue_runs_one_batch_at_a_time(llama3, llama3_expected) -> None:
    engine = _engine(llama3, 2)
    engine.batch_queue = None  # the synchronous step: each stage in turn
    try:
        assert _run(engine, _prompts()) == llama3_expected
        assert engine.runner.tp.max_batches_in_flight == 0  # submit was never used
    finally:
        engine.shutdown()


def test_a_request_aborted_in_flight_ends_cleanly_without_a_block_leak(
        llama3_pp2, llama3_expected) -> None:
    engine = llama3_pp2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in _prompts()]
    engine.step()  # one batch submitted, not finished: the queue has room for another
    queue = engine.batch_queue
    assert len(queue) == 1
    victim = queue.oldest().out.scheduled[0].request_id
    assert victim in engine.scheduler.in_flight
    engine.abort_request(victim)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert not len(queue) and not engine.scheduler.in_flight
    assert victim not in tokens
    assert {i: tokens[i] for i in ids if i != victim} == {
        i: t for i, t in zip(ids, llama3_expected) if i != victim}
    pool = engine.scheduler.kv.pool
    assert pool.num_free == pool.num_blocks


def test_pp2_refuses_what_the_driver_cannot_serve_by_name(llama3_pp2) -> None:
    from twinserve.core.pooling_params import PoolingParams
    with pytest.raises(ValueError, match="prompt_logprobs with tensor_parallel_size or pipeline"):
        llama3_pp2.add_request([5, 6, 7], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match=r"pooling_params\) with pipeline_parallel_size > 1"):
        llama3_pp2.add_request([5, 6, 7], SamplingParams(max_tokens=1),
                               pooling_params=PoolingParams())
    assert not llama3_pp2.has_unfinished_requests()


def test_pp2_leaves_no_process_after_shutdown(llama3_pp2) -> None:
    pids = llama3_pp2.runner.tp.worker_pids()
    assert len(pids) == 1 and _gone(pids, 0.1) is False
    llama3_pp2.shutdown()
    assert _gone(pids)


def test_pp2_tied_qwen2_with_swap_preemption_equals_pp1(tiny_model_dirs) -> None:
    model_dir = tiny_model_dirs["qwen2-tied"]  # the last stage holds the embedding as its head
    expected = _run(_engine(model_dir, 1, preemption_mode="swap"), _prompts())
    engine = _engine(model_dir, 2, preemption_mode="swap")
    try:
        assert engine.runner.model.embed_tokens is not None
        assert _run(engine, _prompts()) == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.runner.tp.max_batches_in_flight == 2
    finally:
        engine.shutdown()
    assert _gone(engine.runner.tp.worker_pids())


def test_a_stage_killed_mid_run_fails_the_step_naming_it_and_leaves_no_process(llama3) -> None:
    engine = _engine(llama3, 2)
    pids = engine.runner.tp.worker_pids()
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for prompt in _prompts():
        engine.add_request(prompt, params)
    engine.step()
    os.kill(pids[0], signal.SIGKILL)
    with pytest.raises(WorkerFailure, match=r"rank 1 \(pid \d+\) died: killed by signal SIGKILL"):
        for _ in range(50):
            engine.step()
    with pytest.raises(WorkerFailure, match="the tensor-parallel group is down"):
        engine.step()
    engine.shutdown()
    assert _gone(pids)


def test_a_layer_partition_moves_the_stage_boundary_and_keeps_the_tokens(
        llama3, llama3_expected) -> None:
    engine = _engine(llama3, 2, pp_layer_partition="1,2")  # the even split is 2 + 1
    try:
        assert engine.runner.model.layer_range == (0, 1)
        assert engine.runner.kv_cache.spec.num_layers == 1
        assert _run(engine, _prompts()) == llama3_expected
    finally:
        engine.shutdown()
    assert _gone(engine.runner.tp.worker_pids())


def test_a_layer_partition_is_refused_unless_it_fits_the_stages_and_the_layers(llama3) -> None:
    assert stage_layer_range(30, 2, 0, (19, 11)) == (0, 19)
    assert stage_layer_range(30, 2, 1, (19, 11)) == (19, 30)
    assert StageLayout.of(1, 1, 2, 3, (1, 2)).start == 1
    with pytest.raises(ValueError, match=r"sum to num_hidden_layers \(3\)"):
        check_tensor_parallel(EngineArgs(model=str(llama3), pipeline_parallel_size=2,
                                         pp_layer_partition="2,2"), ModelConfig.from_dir(llama3))
    for pp, text in ((2, "3"), (2, "2,x"), (2, "3,0"), (3, "1,2")):
        with pytest.raises(ValueError, match=f"pp_layer_partition must be {pp} positive"):
            EngineArgs(model=str(llama3), pipeline_parallel_size=pp, pp_layer_partition=text)
    with pytest.raises(ValueError, match="needs pipeline_parallel_size > 1"):
        EngineArgs(model=str(llama3), pp_layer_partition="3")


@pytest.mark.slow
def test_tp2_x_pp2_equals_pp1(llama3, llama3_expected) -> None:
    engine = _engine(llama3, 2, tp=2)
    try:
        assert engine.runner.kv_cache.spec.num_kv_heads == 2  # 4 KV heads over 2 TP ranks
        assert _run(engine, _prompts()) == llama3_expected
    finally:
        engine.shutdown()
    assert _gone(engine.runner.tp.worker_pids())


def test_what_the_stages_cannot_serve_is_refused_by_name(llama3) -> None:
    config = ModelConfig.from_dir(llama3)
    with pytest.raises(ValueError, match=r"num_hidden_layers \(3\) must be at least pipeline"):
        check_tensor_parallel(EngineArgs(model=str(llama3), pipeline_parallel_size=4), config)
    with pytest.raises(ValueError, match="enable_lora with tensor_parallel_size > 1"):
        check_tensor_parallel(EngineArgs(model=str(llama3), pipeline_parallel_size=2,
                                         enable_lora=True), config)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be"):
        EngineArgs(model=str(llama3), pipeline_parallel_size=0)


@pytest.mark.slow
def test_pp2_on_the_ray_executor_equals_pp1(llama3, llama3_expected) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = _engine(llama3, 2, distributed_executor_backend="ray")
        pids = engine.runner.tp.worker_pids()
        assert _run(engine, _prompts()) == llama3_expected
        assert engine.runner.tp.max_batches_in_flight == 2  # the batch queue over Ray actors
        engine.shutdown()
        assert _gone(pids)
    finally:
        ray.shutdown()
