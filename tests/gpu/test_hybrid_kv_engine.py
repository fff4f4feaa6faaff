"""The hybrid KV cache through the real engine: Gemma 2 (alternating local/global layers: a
sliding and a full group) and Gemma 3 (5:1: five sliding groups and a full one) give HF's greedy
tokens (fp32, same random weights) on prompts longer than the window, under prefix caching,
chunked prefill and preemption, while the sliding groups free the blocks outside their window
(counted exactly at every chunk) and no block leaks once every request ended."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy
from test_model_families import GEMMA, hf_model

from twinserve.core.engine_args import EngineArgs
from twinserve.core.kv_cache_coordinator import HybridKVCacheManager
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.llm_engine import LLMEngine

WINDOW, BLOCK, TOKENS = 8, 4, 12
GEMMA3_6 = (transformers.Gemma3TextConfig, {**GEMMA, "num_hidden_layers": 6,
                                            "sliding_window_pattern": 6})
REGIMES: dict[str, dict[str, Any]] = {
    "prefix-caching": {},
    "chunks-of-8": dict(max_num_batched_tokens=8),
    "recompute-preemption": dict(max_num_batched_tokens=16),
    "swap-preemption": dict(max_num_batched_tokens=16, preemption_mode="swap"),
}
# blocks that force preemptions: the longest request alone holds 13 full blocks and 7 in each
# sliding group (window 8, chunks of 16), the five together about twice that
PRESSURE = {"gemma2": 24, "gemma3-6": 52}


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from test_model_families import FAMILIES
    root = tmp_path_factory.mktemp("hybrid")
    FAMILIES.setdefault("gemma3-6", GEMMA3_6)  # test_model_families' builder, one more config
    dirs = {}
    for name in ("gemma2", "gemma3-6"):
        hf_model(name).save_pretrained(root / name, safe_serialization=True)
        dirs[name] = root / name
    return dirs


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 160, (20,), generator=g).tolist()
    own = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (30, 11, 41, 6)]
    return [own[0], shared + own[1], own[2], shared + own[3], own[1]]


def _run(model_dir: Path, regime: dict[str, Any]) -> tuple[list[list[int]], LLMEngine, int]:
    """Greedy tokens, the engine, and the blocks the sliding groups freed (each request's
    most, summed); every scheduled chunk is checked for its freed count and the window bound."""
    engine = LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", block_size=BLOCK,
                                  kv_cache_memory_bytes=1 << 22, swap_space=0.01, **regime))
    sched = engine.scheduler
    kv = sched.kv
    assert isinstance(kv, HybridKVCacheManager)
    most = -(-(WINDOW - 1 + sched.config.max_num_batched_tokens) // BLOCK) + 1
    freed: dict[str, int] = {}
    schedule = sched.schedule

    def checked_schedule(now: float):
        out = schedule(now)
        for sr in out.scheduled:
            assert len(sr.group_block_ids) == kv.num_groups
            for group in kv.sliding_groups:
                table = group.tables[sr.request_id]
                if sr.num_new_tokens > 1:  # allocate_slots ran: it freed exactly these
                    assert table.num_dropped == max(0, sr.start - WINDOW + 1) // BLOCK
                assert len(table.blocks) - table.num_dropped <= most
                freed[sr.request_id] = max(freed.get(sr.request_id, 0), table.num_dropped)
        kv.check_consistency()
        return out

    sched.schedule = checked_schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    prompts = _prompts()
    ids = [engine.add_request(p, params) for p in prompts[:2]]
    tokens: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() or len(ids) < len(prompts):
        if steps == 2:  # the rest once the shared prefix is cached
            ids += [engine.add_request(p, params) for p in prompts[2:]]
        steps += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[i] for i in ids], engine, sum(freed.values())


# Gemma 2 also runs every regime in test_model_families (tokens and leaks, not freed counts)
# (prefix caching is on in every regime: chunks-of-8 also asserts hits)
CASES = [("gemma3-6", regime) for regime in REGIMES if regime != "prefix-caching"] + [
    ("gemma2", "chunks-of-8"), ("gemma2", "swap-preemption")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "regime"), CASES)
def test_hybrid_groups_give_hf_greedy_tokens(name: str, regime: str,
                                             gemma_dirs: dict[str, Path]) -> None:
    settings = REGIMES[regime]
    if "preemption" in regime:
        settings = {**settings, "num_gpu_blocks_override": PRESSURE[name]}
    got, engine, freed = _run(gemma_dirs[name], settings)
    assert got == hf_greedy(gemma_dirs[name], _prompts(), TOKENS)
    kv = engine.scheduler.kv
    assert kv.num_groups == (2 if name == "gemma2" else 6)
    assert freed > 0  # the 41-token prompt alone leaves 8 blocks behind its window
    assert kv.pool.num_free == kv.pool.num_blocks - 1  # only the null block is held
    assert all(not g.tables for g in kv.groups) and kv.host_pool.num_free == kv.host_pool.num_blocks
    if "preemption" in regime:
        assert engine.scheduler.num_preemptions > 0
        # the same bytes as blocks of every layer (one group) hold fewer tokens than the
        # longest conversation (41 + 12), which the hybrid cache served
        layout = engine.runner.kv_layout
        full_tokens = PRESSURE[name] * layout.slots_per_block // layout.num_layers * BLOCK
        assert full_tokens < 41 + TOKENS
    else:
        assert kv.prefix_hits > 0


# --- the backend's pieces, fast -------------------------------------------------------------

def _scheduled(kv, prompts: list[int]):
    """One step's entries for fresh requests of the given prompt lengths."""
    from core_helpers import make_req

    from twinserve.core.outputs import ScheduledRequest
    out = []
    for i, n in enumerate(prompts):
        req = make_req(f"r{i}", n)
        table = kv.allocate_slots(req, n)
        out.append(ScheduledRequest(req, 0, n, table.ids, True, table.group_ids))
    return out


def test_one_group_tables_and_caches_are_as_without_a_layout() -> None:
    from twinserve.core.kv_cache_groups import kv_cache_layout
    from twinserve.core.kv_cache_manager import KVCacheManager
    from twinserve.gpu.worker.batch import build_model_input
    from twinserve.gpu.worker.kv_cache import KVCache, KVCacheSpec
    cpu = torch.device("cpu")
    scheduled = _scheduled(KVCacheManager(32, 4), [5, 9])
    layout = kv_cache_layout([None] * 3)
    plain = build_model_input(scheduled, 4, 64, cpu)
    laid = build_model_input(scheduled, 4, 64, cpu, layout)
    assert not laid.meta.groups and laid.meta.for_layer(2) is laid.meta
    assert torch.equal(plain.meta.block_tables, laid.meta.block_tables)
    assert torch.equal(plain.meta.slot_mapping, laid.meta.slot_mapping)
    spec = KVCacheSpec(3, 4, 2, 8, torch.float32)
    cache = KVCache(spec, 8, 2, cpu, layout)
    assert len({id(k) for k, _ in cache.gpu}) == 3 and len(cache.gpu_slots) == 3


def test_hybrid_groups_get_their_own_tables_slots_and_shared_tensors() -> None:
    from twinserve.core.kv_cache_groups import kv_cache_layout
    from twinserve.gpu.worker.batch import build_model_input
    from twinserve.gpu.worker.kv_cache import KVCache, KVCacheSpec
    cpu = torch.device("cpu")
    layout = kv_cache_layout([8, None, 8, None])  # 2 groups of 2 layers
    kv = HybridKVCacheManager(32, 4, num_cpu_blocks=8, group_windows=layout.group_windows)
    scheduled = _scheduled(kv, [5, 9])
    inputs = build_model_input(scheduled, 4, 64, cpu, layout)
    meta = inputs.meta
    assert len(meta.groups) == 2 and meta.layer_groups == (1, 0, 1, 0)
    for g, group_meta in enumerate(meta.groups):
        assert meta.for_layer(layout.group_layers[g][0]) is group_meta
        ids = [sr.group_block_ids[g] for sr in scheduled]
        assert group_meta.block_tables[1, :3].tolist() == ids[1][:3]
        assert group_meta.slot_mapping[5].item() == ids[1][0] * 4  # row 5: r1's position 0
    assert set(meta.groups[0].block_tables.flatten().tolist()).isdisjoint(
        meta.groups[1].block_tables[meta.groups[1].block_tables > 0].tolist())
    cache = KVCache(KVCacheSpec(4, 4, 1, 2, torch.float32), 32, 8, cpu, layout)
    assert len(cache.gpu_slots) == 2 and cache.gpu[1] is cache.gpu[0]  # slot 0 of each group
    key, value = cache.gpu[0]
    key[5].fill_(3.0)
    cache.swap_out([(5, 1)])
    cache.swap_in([(1, 6)])
    assert torch.equal(cache.gpu[1][0][6], key[5]) and cache.cpu[0] is cache.cpu[1]


def test_the_profiler_steps_a_hybrid_runner(gemma_dirs: dict[str, Path]) -> None:
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    from twinserve.gpu.worker.model_runner import ModelRunner
    runner = ModelRunner(EngineArgs(model=str(gemma_dirs["gemma3-6"]), dtype="float32",
                                    block_size=BLOCK, num_gpu_blocks_override=64))
    groups = runner.kv_layout.num_groups
    step = build_step(StepSpec(decodes=(20,), prefills=((9, 0),)), BLOCK, 64,
                      runner.vocab_size, groups)
    assert groups == 6 and all(len(sr.group_block_ids) == groups for sr in step.scheduled)
    assert len(runner.execute(step).sampled_token_ids) == 2
