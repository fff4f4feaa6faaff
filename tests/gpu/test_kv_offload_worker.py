"""The host KV tier's worker side (gpu/kv_offload/) on CPU tensors, and the engine with it."""

from __future__ import annotations

import pytest
import torch

from twinserve.core.engine_args import EngineArgs
from twinserve.core.kv_offload import OffloadingConnectorMetadata
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import make_request
from twinserve.gpu.kv_offload.worker import OffloadingConnectorWorker


def _cache(num_blocks: int = 6, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(num_blocks, 4, 2, 8, generator=gen),
             torch.randn(num_blocks, 4, 2, 8, generator=gen)) for _ in range(layers)]


def test_stored_blocks_load_back_bit_exact_into_other_blocks():
    cache = _cache()
    before = [(k.clone(), v.clone()) for k, v in cache]
    worker = OffloadingConnectorWorker(cache, 3)
    worker.start(OffloadingConnectorMetadata(stores=[(1, 0), (4, 2)]))
    assert worker.get_finished().finished_recving == set()  # stores happen after the pass
    for k, v in cache:  # the device blocks are reused meanwhile
        k.zero_()
        v.zero_()
    worker.start(OffloadingConnectorMetadata(loads={"r": [(2, 0), (0, 5)]}))
    report = worker.get_finished()
    assert report.finished_recving == {"r"} and report.failed_recving == set()
    for (k, v), (k0, v0) in zip(cache, before):
        assert torch.equal(k[0], k0[4]) and torch.equal(v[0], v0[4])
        assert torch.equal(k[5], k0[1]) and torch.equal(v[5], v0[1])
        assert not k[1].any() and not k[4].any()  # untouched blocks stay as they were
    assert (worker.num_blocks_stored, worker.num_blocks_loaded) == (2, 2)
    assert worker.host.nbytes == 2 * 2 * 3 * 4 * 2 * 8 * 4


def test_stores_of_a_step_happen_after_its_forward_pass():
    cache = _cache()
    worker = OffloadingConnectorWorker(cache, 2)
    worker.start(OffloadingConnectorMetadata(stores=[(3, 1)]))
    cache[0][0][3].fill_(7.0)  # the forward pass writes the block's KV
    worker.get_finished()
    cache[0][0][3].zero_()
    worker.start(OffloadingConnectorMetadata(loads={"a": [(1, 0)]}))
    worker.get_finished()
    assert bool((cache[0][0][0] == 7.0).all())


def test_a_load_naming_missing_blocks_fails_alone():
    worker = OffloadingConnectorWorker(_cache(), 2)
    worker.start(OffloadingConnectorMetadata(loads={"bad": [(2, 0)], "ok": [(1, 1)]}))
    report = worker.get_finished()
    assert report.failed_recving == {"bad"} and report.finished_recving == {"ok"}
    assert worker.get_finished().failed_recving == set()  # reported once


# ---- the engine with the host tier (the bundled model, fp32 on the CPU) ------------------------
def _engine(model_dir, **kwargs):
    from twinserve.gpu.engine.llm_engine import LLMEngine
    return LLMEngine(EngineArgs(**{"model": str(model_dir), "dtype": "float32", "block_size": 16,
                                   "max_model_len": 256, **kwargs}))


def _generate(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
    return [done[i] for i in ids]


def _prompt(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 104729) % 40000 for i in range(n)]


@pytest.fixture(scope="module")
def engines(default_model_dir):
    """(plain engine, engine with a host tier and 12 device blocks): built once, they take most
    of these tests' time."""
    return (_engine(default_model_dir, num_gpu_blocks_override=64),
            _engine(default_model_dir, num_gpu_blocks_override=12, kv_offloading_size=0.05,
                    max_num_seqs=2))


@pytest.mark.slow
def test_engine_reloads_an_evicted_prefix_from_host_with_fresh_compute_tokens(engines):
    plain, tier = engines
    prompt = _prompt(1, 100)
    (fresh,) = _generate(plain, [prompt], 8)
    assert _generate(tier, [prompt], 8) == [fresh]
    for seed in (2, 3):  # each takes 7 of the 12 device blocks: the prompt's blocks are evicted
        _generate(tier, [_prompt(seed, 100)], 8)
    assert tier.scheduler.kv.get_computed_blocks(make_request("probe", prompt))[1] == 0
    stats = tier.scheduler.connector.stats
    hits, loaded = stats.external_prefix_cache_hits, tier.runner.kv_connector.num_blocks_loaded
    assert _generate(tier, [prompt], 8) == [fresh]
    assert stats.external_prefix_cache_hits - hits == 96  # 6 whole blocks (99 tokens at most)
    assert tier.runner.kv_connector.num_blocks_loaded - loaded == 6
    tier.scheduler.kv.check_consistency()
    assert tier.scheduler.connector.lru.num_pinned == 0
    assert tier.engine_config.kv_transfer_config.kv_connector == "OffloadingConnector"
    assert tier.engine_config.to_dict()["kv_offloading_blocks"] == int(0.05 * 2**30) // (
        tier.engine_config.block_bytes)


@pytest.mark.slow
def test_engine_prompts_loaded_together_cannot_hold_every_block(default_model_dir):
    """Two prompts whose first 160 tokens come back from the host together take 10 blocks each
    of 24, then need 9 more each while 4 are free, with nothing running: one gives its blocks
    back (``Scheduler._release_a_loaded``), and both finish, as without the tier."""
    engine = _engine(default_model_dir, num_gpu_blocks_override=24, kv_offloading_size=0.2,
                     max_num_seqs=8, max_model_len=384)
    plain = _engine(default_model_dir, num_gpu_blocks_override=64, max_model_len=384)
    prefixes = [_prompt(10, 160), _prompt(11, 160)]
    for prefix in prefixes:  # the prefixes reach the host tier
        _generate(engine, [prefix + _prompt(12, 40)], 2)
    for seed in (13, 14, 15):  # other prompts push them out of the device cache
        _generate(engine, [_prompt(seed, 300)], 2)
    prompts = [prefix + _prompt(16 + i, 140) for i, prefix in enumerate(prefixes)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    for _ in range(200):  # (a deadlock steps for ever: bounded here)
        for output in engine.step():
            if output.finished:
                done[output.request_id] = list(output.outputs[0].token_ids)
        if not engine.has_unfinished_requests():
            break
    assert [done.get(i) for i in ids] == _generate(plain, prompts, 2)
    assert engine.scheduler.connector.stats.external_prefix_cache_hits >= 2 * 160
    engine.scheduler.kv.check_consistency()


@pytest.mark.slow
def test_engine_preempted_request_reloads_instead_of_recomputing(engines):
    plain, tier = engines
    # 90-token prompts fill 6 blocks each; the 7th, at output token 7, preempts one of them
    prompts = [_prompt(4, 90), _prompt(5, 90)]
    want = _generate(plain, prompts, 12)
    preemptions, hits = tier.scheduler.num_preemptions, tier.scheduler.connector.stats.external_prefix_cache_hits
    assert _generate(tier, prompts, 12) == want
    assert tier.scheduler.num_preemptions > preemptions
    assert tier.scheduler.connector.stats.external_prefix_cache_hits > hits


@pytest.mark.slow
def test_twin_host_hits_equal_the_engines_on_the_same_workload(default_model_dir):
    """A, B, C, then A again, one at a time, 12 device blocks: the same core in both, so the
    twin's host-tier counts are the engine's."""
    from twinserve.simulator import SimConfig, simulate
    from twinserve.traces import TraceRequest
    blocks = {"A": (1, 2, 3, 4, 5, 6), "B": (11, 12, 13, 14, 15, 16), "C": (21, 22, 23, 24, 25, 26)}
    names = "ABCA"
    trace = [TraceRequest(f"{i}-{n}", 100.0 * i, 100, 2, prefix_blocks=blocks[n])
             for i, n in enumerate(names)]
    settings = dict(block_size=16, num_gpu_blocks_override=12, max_model_len=256, max_num_seqs=2,
                    kv_offloading_size=0.05)
    twin = simulate(SimConfig(model="smollm2-135m", hardware="cpu", **settings), trace).summary
    engine = _engine(default_model_dir, **{k: v for k, v in settings.items()
                                           if k not in ("block_size", "max_model_len")})
    for i, n in enumerate(names):
        prompt = [1000 + 16 * b + j for b in blocks[n] for j in range(16)] + [50 + i] * 4
        _generate(engine, [prompt], 2)
    stats = engine.scheduler.connector.stats
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits,
            stats.num_blocks_stored, stats.num_blocks_loaded) == (
        twin["external_prefix_cache_queries"], twin["external_prefix_cache_hits"],
        twin["kv_offload_blocks_stored"], twin["kv_offload_blocks_loaded"])
    assert stats.external_prefix_cache_hits == 96
