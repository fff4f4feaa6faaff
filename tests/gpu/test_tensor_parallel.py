"""Tensor parallelism in the real engine: sharded layers, TP=2 worker processes, faults.

The layer tests run in this process (a rank's layer without a group returns its partial result, so
the ranks' parts are recomposed by hand). The engine tests spawn worker processes (gloo on the CPU):
greedy tokens with TP=2 equal TP=1's (and HF's) token for token under prefix caching, chunked
prefill and preemption (recompute for a Llama with fewer KV heads than ranks, swap for a Qwen2),
through the server once, through Ray once (slow); a rank killed mid-run and a rank that fails to
start end with clear errors and no processes left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from conftest import TINY_VOCAB, _build_tiny, hf_greedy, with_trained_tokenizer
from tp_faults import FailsLoadingWorker, HangingWorker, use_worker

from twinserve.core.engine_args import EngineArgs
from twinserve.core.engine_config import kv_block_bytes
from twinserve.core.model_config import ModelConfig
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.distributed.parallel_state import TPGroup
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.gpu.executor.executor_base import WorkerFailure
from twinserve.gpu.executor.tp_driver import check_tensor_parallel
from twinserve.gpu.kernels.cpu_gemm import Gemm
from twinserve.gpu.layers.linear import (
    LinearOptions,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from twinserve.gpu.layers.vocab_parallel_embedding import VocabParallel

MAX_TOKENS = 16
# chunks of 16 tokens, prefix caching on, and a cache too small for every request at once
REGIME = dict(max_num_batched_tokens=16, num_gpu_blocks_override=12, enable_prefix_caching=True)
GEMM = Gemm(slabs=True, widen_half=False)


def _options(rank: int, size: int) -> LinearOptions:
    return LinearOptions(GEMM, torch.float32, tp_rank=rank, tp_size=size)


# --- the sharded layers, recomposed by hand ----------------------------------------------------

@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_qkv_ranks_hold_their_heads_and_replicate_kv_heads_fewer_than_ranks(kv_heads) -> None:
    heads, head, hidden, tp = 4, 3, 8, 2
    g = torch.Generator().manual_seed(0)
    parts = {"q": torch.randn(heads * head, hidden, generator=g),
             "k": torch.randn(kv_heads * head, hidden, generator=g),
             "v": torch.randn(kv_heads * head, hidden, generator=g)}
    x = torch.randn(5, hidden, generator=g)
    full = {name: x @ w.t() for name, w in parts.items()}
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, False, _options(rank, tp))
        for name, w in parts.items():
            layer.weight_loader(layer.weight, w, name)
        out = layer(x)
        local_kv = max(1, kv_heads // tp)
        q, k, v = out.split([heads // tp * head, local_kv * head, local_kv * head], dim=1)
        kv_head = rank * local_kv if kv_heads >= tp else rank // (tp // kv_heads)
        kv_cols = slice(kv_head * head, (kv_head + local_kv) * head)
        torch.testing.assert_close(q, full["q"][:, rank * heads // tp * head:
                                                 (rank + 1) * heads // tp * head])
        torch.testing.assert_close(k, full["k"][:, kv_cols])
        torch.testing.assert_close(v, full["v"][:, kv_cols])


def test_merged_column_and_row_parallel_parts_recompose_the_full_product() -> None:
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
    down, bias = torch.randn(8, 6, generator=g), torch.randn(8, generator=g)
    x = torch.randn(4, 8, generator=g)
    partial_sum = torch.zeros(4, 8)
    for rank in range(2):
        merged = MergedColumnParallelLinear(8, [6, 6], False, _options(rank, 2))
        merged.weight_loader(merged.weight, gate, 0)
        merged.weight_loader(merged.weight, up, 1)
        rows = slice(3 * rank, 3 * rank + 3)
        torch.testing.assert_close(merged(x), torch.cat([x @ gate[rows].t(), x @ up[rows].t()], 1))
        row = RowParallelLinear(6, 8, True, _options(rank, 2))  # no group: the partial product
        row.weight_loader(row.weight, down)
        row.weight_loader(row.bias, bias)
        partial_sum += row(x[:, :6][:, rows])
    torch.testing.assert_close(partial_sum, x[:, :6] @ down.t() + bias)  # the bias added once


def test_vocab_parallel_rows_pad_the_last_rank_and_embeddings_sum_to_the_full_lookup() -> None:
    weight = torch.randn(7, 4)
    ids = torch.tensor([0, 3, 4, 6])
    total = torch.zeros(4, 4)
    for rank in range(2):
        vocab = VocabParallel(7, TPGroup(rank, 2, torch.device("cpu")))  # no pg: no reduction
        shard = torch.full((vocab.rows_per_rank, 4), float("nan"))
        vocab.weight_loader(torch.nn.Parameter(shard, requires_grad=False), weight)
        assert (vocab.start, vocab.end, shard.shape[0]) == (4 * rank, min(4 * rank + 4, 7), 4)
        if rank == 1:
            assert torch.equal(shard[3], torch.zeros(4))  # the padding row
        total += vocab.embed(ids, shard)
    torch.testing.assert_close(total, weight[ids])


def test_sizes_tensor_parallelism_cannot_split_are_refused_with_the_reason(
        tiny_model_dirs) -> None:
    config = ModelConfig.from_dir(tiny_model_dirs["llama-tied"])  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"attention heads \(4\) must be divisible by tensor "
                                         r"parallel size \(3\)"):
        check_tensor_parallel(EngineArgs(tensor_parallel_size=3), config)
    with pytest.raises(ValueError, match="key/value heads"):
        QKVParallelLinear(8, 2, 12, 4, False, _options(0, 6))  # 4 KV heads over 6 ranks
    with pytest.raises(ValueError, match="enable_lora with tensor_parallel_size > 1"):
        check_tensor_parallel(EngineArgs(tensor_parallel_size=2, enable_lora=True), config)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of mp, ray"):
        EngineArgs(distributed_executor_backend="threads")
    from_file = EngineArgs.from_mapping({"tensor-parallel-size": 2,
                                         "distributed-executor-backend": "ray"}, "tp.yaml")
    assert (from_file.tensor_parallel_size, from_file.distributed_executor_backend) == (2, "ray")
    # each rank's cache holds half the KV heads: twice the blocks in the same bytes per rank
    assert kv_block_bytes(config, 16, "float32", 2) * 2 == kv_block_bytes(config, 16, "float32")


def test_fit_interconnect_recovers_the_ring_bandwidth_and_latency() -> None:
    from twinserve.gpu.distributed.allreduce_benchmark import AllReduceSample, fit_interconnect
    bandwidth, latency = 2e9, 40e-6
    samples = [AllReduceSample(p, n, latency + 2 * (p - 1) / p * n / bandwidth)
               for p in (2, 3) for n in (2304, 36864, 589824, 2359296)]
    fit = fit_interconnect(samples)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6) and fit.max_relative_error < 1e-6
    with pytest.raises(ValueError, match="does not grow with its size"):
        fit_interconnect([AllReduceSample(2, n, 1e-3) for n in (10, 20)] +
                         [AllReduceSample(2, 30, 5e-4)])


# --- TP=2 engines ------------------------------------------------------------------------------

def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, TINY_VOCAB, (32,), generator=g).tolist()
    own = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33, 9, 40)]
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


def _engine(model_dir: Path, tp: int, **extra) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", tensor_parallel_size=tp,
                                max_model_len=128, swap_space=0.01, **{**REGIME, **extra}))


def _gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids):
            return True
        time.sleep(0.1)
    return False


CORPUS = ["the quick brown fox jumps over the lazy dog", "tensor parallel ranks all reduce",
          "a paged cache of key and value blocks", "hello world, twinserve serves tokens"]
PROMPT = "the quick brown fox"


def _children(pid: int) -> list[int]:
    """Processes ``pid`` started, but multiprocessing's resource tracker (it outlives engines)."""
    return [p.pid for p in psutil.Process(pid).children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]


@pytest.fixture(scope="module")
def llama_kv1(tmp_path_factory) -> Path:
    """A Llama with one KV head (fewer KV heads than ranks, so both ranks hold it) and a
    tokenizer (the server test sends text)."""
    root = tmp_path_factory.mktemp("tp")
    raw = _build_tiny(root / "raw", "llama", {"num_key_value_heads": 1,
                                               "tie_word_embeddings": False})
    return with_trained_tokenizer(raw, root / "llama-kv1", CORPUS)


@pytest.fixture(scope="module")
def llama_tp1(llama_kv1) -> LLMEngine:
    return _engine(llama_kv1, 1)


@pytest.fixture(scope="module")
def llama_expected(llama_kv1, llama_tp1) -> list[list[int]]:
    tokens = _run(llama_tp1, _prompts())
    assert llama_tp1.scheduler.num_preemptions > 0 and llama_tp1.scheduler.kv.prefix_hits > 0
    assert tokens == hf_greedy(llama_kv1, _prompts(), MAX_TOKENS)
    return tokens


@pytest.fixture(scope="module")
def llama_tp2(llama_kv1) -> Iterator[LLMEngine]:
    engine = _engine(llama_kv1, 2)
    yield engine
    engine.shutdown()


def test_tp2_greedy_tokens_equal_tp1_under_prefix_caching_chunks_and_recompute(
        llama_tp2, llama_expected) -> None:
    engine = llama_tp2
    assert engine.runner.kv_cache.spec.num_kv_heads == 1  # the one KV head, on each rank
    assert _run(engine, _prompts()) == llama_expected
    sched = engine.scheduler
    assert sched.num_preemptions > 0 and sched.kv.prefix_hits > 0
    assert max(s.num_prefill_tokens for s in engine.metrics.steps) <= 16
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


def test_tp2_qwen2_with_swap_preemption_equals_tp1(tiny_model_dirs) -> None:
    model_dir = tiny_model_dirs["qwen2-tied"]  # q/k/v biases, tied embeddings, 2 KV heads
    reference = _engine(model_dir, 1, preemption_mode="swap")
    expected = _run(reference, _prompts())
    engine = _engine(model_dir, 2, preemption_mode="swap")
    try:
        assert _run(engine, _prompts()) == expected
        assert engine.scheduler.num_preemptions > 0
        assert engine.runner.kv_cache.spec.num_kv_heads == 1  # 2 KV heads split over 2 ranks
    finally:
        engine.shutdown()
    assert _gone(engine.runner.tp.worker_pids())


def test_a_rank_killed_mid_run_fails_the_step_naming_it_and_leaves_no_process(
        llama_tp2) -> None:
    engine = llama_tp2  # (after the equality test: this one ends the engine)
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
    assert _gone(pids)


def test_a_rank_that_fails_to_start_is_a_clear_error(llama_kv1, monkeypatch) -> None:
    use_worker(monkeypatch, FailsLoadingWorker)
    before = set(_children(os.getpid()))
    with pytest.raises(WorkerFailure, match="tensor-parallel rank 1 failed to start: "
                                            "RuntimeError: injected fault: rank 1 cannot load"):
        _engine(llama_kv1, 2)
    spawned = [p for p in _children(os.getpid()) if p not in before]
    assert _gone(spawned)


@pytest.mark.slow
def test_a_hung_rank_times_out_with_an_error(llama_kv1, monkeypatch) -> None:
    from twinserve.gpu.executor import tp_driver
    use_worker(monkeypatch, HangingWorker)
    monkeypatch.setattr(tp_driver, "COLLECTIVE_TIMEOUT_S", 3.0)
    engine = _engine(llama_kv1, 2)
    pids = engine.runner.tp.worker_pids()
    t0 = time.monotonic()
    with pytest.raises(WorkerFailure, match="alive but a collective failed within the 3 s"):
        _run(engine, _prompts())
    assert time.monotonic() - t0 < 60
    assert _gone(pids)


# --- the server and Ray ------------------------------------------------------------------------

def test_server_tp2_serves_the_tp1_text_then_a_dead_rank_turns_it_unhealthy(
        llama_kv1, llama_tp1) -> None:
    from server_fixture import start_server, stop_server
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    rid = llama_tp1.add_request(PROMPT, params)
    expected = None
    while llama_tp1.has_unfinished_requests():
        expected = next((o.outputs[0].text for o in llama_tp1.step()
                         if o.request_id == rid and o.finished), expected)
    server = start_server(["--model", str(llama_kv1), "-tp", "2", "--max-model-len", "128"])
    try:
        body = {"model": str(llama_kv1), "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        workers = _children(server.process.pid)
        assert len(workers) == 1
        os.kill(workers[0], signal.SIGKILL)
        r = httpx.post(server.url("/v1/completions"), json=body, timeout=120)
        assert r.status_code == 503 and "rank 1" in r.text, r.text
        assert httpx.get(server.url("/health"), timeout=10).status_code == 503
    finally:
        pid = server.process.pid
        children = _children(pid)
        stop_server(server)
    assert server.process.returncode is not None and _gone(children)


@pytest.mark.slow
def test_ray_executor_in_local_mode_equals_tp1(llama_kv1, llama_expected) -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = _engine(llama_kv1, 2, distributed_executor_backend="ray")
        pids = engine.runner.tp.worker_pids()
        assert _run(engine, _prompts()) == llama_expected
        engine.shutdown()
        assert _gone(pids)
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_bundled_model_tp3_equals_tp1_and_tp2_is_refused_with_the_reason(
        default_model_dir) -> None:
    config = ModelConfig.from_dir(default_model_dir)  # SmolLM2-135M: 9 heads, 3 KV heads
    with pytest.raises(ValueError, match=r"attention heads \(9\) must be divisible by tensor "
                                         r"parallel size \(2\)"):
        check_tensor_parallel(EngineArgs(tensor_parallel_size=2), config)
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 17036, 28, 905, 253, 1165, 30, 2]]
    tokens = {}
    for tp in (1, 3):
        engine = LLMEngine(EngineArgs(model=str(default_model_dir), dtype="float32",
                                      tensor_parallel_size=tp, max_model_len=64,
                                      max_num_batched_tokens=8))
        try:
            tokens[tp] = _run(engine, prompts)
        finally:
            engine.shutdown()
    assert tokens[3] == tokens[1]


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_is_killed(llama_kv1) -> None:
    import subprocess
    import sys
    code = ("import os, sys; from twinserve.core.engine_args import EngineArgs; "
            "from twinserve.gpu.engine.llm_engine import LLMEngine; "
            f"e = LLMEngine(EngineArgs(model={str(llama_kv1)!r}, dtype='float32', "
            "tensor_parallel_size=2, max_model_len=64)); "
            "print(*e.runner.tp.worker_pids(), flush=True); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1 and _gone(pids, timeout_s=30)  # the pipe's end-of-file ends it


def test_tp2_starts_from_a_script_on_standard_input(llama_kv1, llama_tp1) -> None:
    """``python - <<EOF``: spawned ranks cannot re-run ``<stdin>``; they start all the same and
    the script's greedy tokens equal TP=1's."""
    import subprocess
    import sys
    script = (
        "from twinserve import LLM, SamplingParams\n"
        f"llm = LLM({str(llama_kv1)!r}, dtype='float32', tensor_parallel_size=2, "
        "max_model_len=64)\n"
        "out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=8, "
        "ignore_eos=True), use_tqdm=False)\n"
        "print('TOKENS', *out[0].outputs[0].token_ids, flush=True)\n")
    proc = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("TOKENS"))
    expected = _run_n(llama_tp1, [5, 6, 7, 8], 8)
    assert [int(t) for t in line.split()[1:]] == expected


def _run_n(engine: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return list(out.outputs[0].token_ids)
    raise AssertionError("the request did not finish")
