"""Speculative decoding through the shared scheduler and the model runner together: greedy
outputs with ngram, suffix and draft-model drafts equal those without speculation under prefix
caching, chunked prefill, recompute and swap preemption and n > 1 (tiny random model, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from twinserve.core.config import SchedulerConfig
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.gpu.worker.rejection_sampler import VerifySettings
from twinserve.policies import get_policy
from twinserve.policies.speculation import FixedSpeculation
from twinserve.spec_decode.ngram import NgramProposer
from twinserve.spec_decode.suffix import SuffixProposer

BASE = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6, 12, 13, 14, 15]

REGIMES = {  # scheduler settings over the runner's 64 blocks of 16 tokens
    "plain": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=8),
    "recompute": dict(num_gpu_blocks=7),
    "swap": dict(num_gpu_blocks=7, preemption_mode="swap", num_cpu_blocks=64),
    "no_prefix_caching": dict(enable_prefix_caching=False),
}


def _requests(n: int = 1) -> list[Request]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=n)
    prompts = [BASE, BASE[:12] + [20, 21], [30, 31, 30, 31, 30], BASE[::-1]]
    return [Request(f"r{i}", list(p), params, 0.0) for i, p in enumerate(prompts)]


def _run(runner, regime: dict, k: int, n: int = 1) -> dict[str, list[int]]:
    """The outputs by request id; checks that drafts were accepted (k > 0), that the preempting
    regimes preempted, and that no block leaked."""
    config = SchedulerConfig(**{**dict(num_gpu_blocks=64, block_size=16, max_num_seqs=8,
                                       max_num_batched_tokens=128, max_model_len=256),
                                **regime, "num_speculative_tokens": k})
    sched = Scheduler(config, get_policy("fcfs"), speculation=FixedSpeculation(k) if k else None)
    requests = _requests(n)
    for request in requests:
        sched.add_request(request)
    outputs: dict[str, list[int]] = {}
    now = 0.0
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule(now)
        result = runner.execute(out)
        now += 0.01
        for o in sched.update_from_output(out, result, now):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not sched.has_unfinished_requests()
    sched.kv.check_consistency()
    assert sched.kv.usage == 0.0  # every block back (cached ones are free to evict)
    if k:
        assert sched.spec_num_accepted_tokens > 0
    if "num_gpu_blocks" in regime:
        assert sum(r.num_preemptions for r in requests) > 0
    return outputs


@pytest.fixture(scope="module")
def engine_runner(tiny_model):
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eargs = EngineArgs(str(tiny_model), dtype="float32", max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=128, num_gpu_blocks_override=64,
                       kv_cache_memory_bytes=None, swap_space=0.01)
    yield eargs, ModelRunner(eargs, usage_context="server")
    torch.set_num_threads(threads)


def _proposers(eargs, tiny_model):
    from twinserve.gpu.spec_decode.draft_model import DraftModelProposer
    return {"ngram": lambda: NgramProposer(1, 3), "suffix": lambda: SuffixProposer(),
            "draft_model": lambda: DraftModelProposer(
                dataclasses.replace(eargs, num_gpu_blocks_override=32), str(tiny_model), 256)}


@pytest.mark.parametrize("regime", REGIMES)
def test_greedy_outputs_with_speculation_equal_those_without(engine_runner, tiny_model, regime):
    eargs, runner = engine_runner
    runner._spec = None
    expected = _run(runner, REGIMES[regime], 0)
    for name, make in _proposers(eargs, tiny_model).items():
        runner.configure_speculation(make(), VerifySettings("probabilistic"))
        assert _run(runner, REGIMES[regime], 4) == expected, name
    runner._spec = None


def test_n2_children_with_speculation_equal_those_without(engine_runner, tiny_model):
    eargs, runner = engine_runner
    runner._spec = None
    expected = _run(runner, REGIMES["plain"], 0, n=2)
    assert len(expected) == 8
    runner.configure_speculation(NgramProposer(1, 3), VerifySettings("probabilistic"))
    assert _run(runner, REGIMES["plain"], 4, n=2) == expected
    runner._spec = None


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "policy": "fixed"},
    {"method": "suffix", "num_speculative_tokens": 4, "policy": "adaptive"},
    {"method": "draft_model", "num_speculative_tokens": 2, "policy": "fixed"},
    {"method": "ngram", "num_speculative_tokens": 2, "max_num_speculative_tokens": 6,
     "policy": "adaptive"},
], ids=lambda spec: spec["method"] + ("_raised" if "max_num_speculative_tokens" in spec else ""))
def test_llm_engine_builds_speculation_from_speculative_config(tiny_model, spec):
    """EngineArgs(speculative_config=...) -> the scheduler's policy and the runner's proposer;
    greedy tokens equal the engine's without it (with logprobs for every token)."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    if spec["method"] == "draft_model":
        spec = {**spec, "model": str(tiny_model)}
    common = dict(model=str(tiny_model), dtype="float32", max_model_len=256,
                  kv_cache_memory_bytes=1 << 22)
    outputs = []
    for speculative_config in (None, spec):
        engine = LLMEngine(EngineArgs(**common, speculative_config=speculative_config))
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1)
        for i, prompt in enumerate(_requests()):
            engine.add_request(list(prompt.prompt_token_ids), params, request_id=f"q{i}")
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (list(out.outputs[0].token_ids),
                                            len(out.outputs[0].logprobs))
        outputs.append(done)
    assert outputs[0] == outputs[1]
    assert all(n == 20 for _, n in outputs[1].values())
    sched = engine.scheduler
    assert sched.speculation is not None and sched.spec_num_drafts > 0
    if "max_num_speculative_tokens" in spec:  # the scheduler lets the policy raise k to 6
        assert sched.config.num_speculative_tokens == 6
        assert (sched.speculation.k_base, sched.speculation.k_max) == (2, 6)
        assert len(sched.spec_num_accepted_tokens_per_pos) == 6
    if spec["policy"] == "fixed":
        assert sched.spec_num_accepted_tokens > 0
