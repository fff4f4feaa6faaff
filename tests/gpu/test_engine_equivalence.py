"""The engine's greedy tokens do not depend on how the scheduler got there.

Each run feeds the same prompts (some sharing a two-block prefix; half of them arriving after a
few steps) through ``LLMEngine`` under one scheduling regime: prefix caching off, chunked prefill
with a 16-token budget or whole prompts, a KV cache cut so small that requests are preempted by
recompute or by swap. Every regime must produce HF transformers' greedy tokens (fp32) and end with
every KV block free. The same matrix runs on CUDA where present, with and without CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, hf_greedy

from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.llm_engine import LLMEngine

MAX_TOKENS = 24
LATE_AFTER_STEPS = 3  # the second half of the prompts arrives after this many steps
PRESSURE_BLOCKS = 12  # any one request fits (at most 5 blocks); ten at once do not

REGIMES: dict[str, dict] = {
    "defaults": {},
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "chunks-of-16": dict(max_num_batched_tokens=16),
    "whole-prompts": dict(enable_chunked_prefill=False),
    "recompute-preemption": dict(num_gpu_blocks_override=PRESSURE_BLOCKS),
    "swap-preemption": dict(num_gpu_blocks_override=PRESSURE_BLOCKS, preemption_mode="swap"),
}
CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])
MODELS = ("llama-untied-llama3rope", "qwen2-tied")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(3, TINY_VOCAB, (32,), generator=g).tolist()
    own = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist()
           for n in (5, 17, 33, 9, 48, 3, 11, 1, 20, 7)]
    with_prefix = [shared + tail for tail in own[5:]]
    return own[:4] + with_prefix[:1] + own[4:5] + with_prefix[1:]  # one shared prompt arrives early


@pytest.fixture(scope="module")
def expected(tiny_model_dirs) -> dict[str, list[list[int]]]:
    return {name: hf_greedy(tiny_model_dirs[name], _prompts(), MAX_TOKENS) for name in MODELS}


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    half = len(prompts) // 2
    ids = [engine.add_request(p, params) for p in prompts[:half]]
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() or len(ids) < len(prompts):
        if steps == LATE_AFTER_STEPS:
            ids += [engine.add_request(p, params) for p in prompts[half:]]
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return [tokens[i] for i in ids]


def _engine(model_dir, device: str, regime: dict, enforce_eager: bool = False) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device=device,
                                kv_cache_memory_bytes=1 << 22, swap_space=0.01,
                                enforce_eager=enforce_eager, **regime))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("name", MODELS)
def test_every_regime_gives_hf_greedy_tokens_and_frees_every_block(name, regime, device,
                                                                    tiny_model_dirs, expected):
    engine = _engine(tiny_model_dirs[name], device, REGIMES[regime])
    assert _run(engine, _prompts()) == expected[name]

    sched = engine.scheduler
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert sched.kv.host_pool.num_free == sched.kv.host_pool.num_blocks
    assert not sched.running and not engine.has_unfinished_requests()
    if "preemption" in regime:
        assert sched.num_preemptions > 0
    caching = regime != "no-prefix-caching"
    assert (sched.kv.prefix_hits > 0) == caching
    prefill_sizes = [s.num_prefill_tokens for s in engine.metrics.steps]
    if regime == "chunks-of-16":
        assert max(prefill_sizes) <= 16
    else:  # the 48-token prompt went in one step
        assert max(prefill_sizes) >= 48


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_graphs_give_the_eager_tokens(name, tiny_model_dirs, expected):
    graphed = _engine(tiny_model_dirs[name], "cuda", {})
    eager = _engine(tiny_model_dirs[name], "cuda", {}, enforce_eager=True)
    assert graphed.runner._graphs is not None and eager.runner._graphs is None
    assert _run(graphed, _prompts()) == _run(eager, _prompts()) == expected[name]
