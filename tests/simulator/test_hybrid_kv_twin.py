"""The twin's KV capacity from the per-layer windows: Gemma 3 27B's blocks span one KV cache
group's 10 layers (not all 62), so the same memory holds 6.2x the blocks, and a conversation
longer than a full-attention cache could hold completes in the twin, as under the hybrid
allocator of the real engine (the same scheduler and KV manager)."""

from __future__ import annotations

import pytest

from twinserve.core.engine_config import kv_block_bytes, kv_cache_layout_of, sequence_kv_tokens
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.model_spec import load_model_spec
from twinserve.traces.trace_request import TraceRequest

GIB = 1 << 30


def test_gemma3_blocks_span_one_group_and_the_cache_holds_long_sequences() -> None:
    spec = load_model_spec("gemma-3-27b")
    layout = kv_cache_layout_of(spec)
    assert layout.group_windows == (None,) + (1024,) * 6 and layout.slots_per_block == 10
    per_layer_block = 2 * 16 * 16 * 128 * 2  # K and V, 16 tokens, 16 KV heads, dim 128, bf16
    cfg = SimConfig(model="gemma-3-27b", hardware="h200", kv_cache_memory_bytes=8 * GIB,
                    max_num_batched_tokens=2048)
    result = simulate(cfg, [TraceRequest("one", 0.0, 100, 2)])
    engine = result.engine_config
    assert engine.block_bytes == 10 * per_layer_block
    assert engine.block_bytes == kv_block_bytes(spec, 16, "bfloat16", num_layers=10)
    assert result.num_gpu_blocks == 8 * GIB // (10 * per_layer_block)
    assert engine.scheduler.kv_cache_group_windows == layout.group_windows
    full_attention_blocks = 8 * GIB // (62 * per_layer_block)
    # one sequence: the full group holds it all, each sliding group its window and one chunk
    held = sequence_kv_tokens(layout, result.num_gpu_blocks, 16, 2048)
    sliding = 6 * (-(-(1023 + 2048) // 16) + 1)
    assert held == (result.num_gpu_blocks - 1 - sliding) * 16
    assert held > 5 * full_attention_blocks * 16


def test_a_conversation_beyond_full_attention_capacity_completes_in_the_twin() -> None:
    cfg = SimConfig(model="gemma-3-27b", hardware="h200", kv_cache_memory_bytes=4 * GIB,
                    max_num_batched_tokens=2048, max_model_len=32768)
    full_attention_tokens = 4 * GIB // (62 * 2 * 16 * 128 * 2)  # ~8.5K tokens
    trace = [TraceRequest("long", 0.0, 24000, 64), TraceRequest("short", 1.0, 500, 16)]
    assert 24000 > 2 * full_attention_tokens
    result = simulate(cfg, trace)
    assert result.summary["completed"] == 2 and result.summary["failed"] == 0
    peak = max(step.kv_usage for step in result.steps)
    blocks = result.num_gpu_blocks
    # 24K tokens in the full group (1500 blocks) + 6 windows, within the 3200 blocks
    assert 1500 + 6 * 65 <= peak * blocks <= 1500 + 6 * 193 + 40


def test_disabling_the_hybrid_manager_sizes_blocks_of_every_layer() -> None:
    per_layer_block = 2 * 16 * 16 * 128 * 2
    on, off = (simulate(SimConfig(model="gemma-3-27b", hardware="h200",
                                  kv_cache_memory_bytes=8 * GIB, max_num_batched_tokens=2048,
                                  disable_hybrid_kv_cache_manager=flag),
                        [TraceRequest("one", 0.0, 100, 2)]) for flag in (False, True))
    assert off.engine_config.block_bytes == 62 * per_layer_block
    assert off.engine_config.scheduler.kv_cache_group_windows == ()
    assert off.num_gpu_blocks == 8 * GIB // (62 * per_layer_block)
    assert on.num_gpu_blocks == 8 * GIB // (10 * per_layer_block)
    # and in it a 24K conversation cannot fit (max_model_len is capped to the cache's tokens)
    assert off.engine_config.max_model_len < 24000 < on.engine_config.max_model_len


def test_a_hybrid_block_swaps_one_groups_bytes() -> None:
    from twinserve.simulator.run import build_engine_config
    hybrid = SimConfig(model="gemma-3-27b", hardware="h200", kv_cache_memory_bytes=8 * GIB)
    build = build_engine_config(hybrid)
    base = build.cost_model.roofline
    assert base.block_bytes() == build.engine_config.block_bytes == 10 * 2 * 16 * 16 * 128 * 2
    one_group = build_engine_config(hybrid.replace(disable_hybrid_kv_cache_manager=True))
    base_one = one_group.cost_model.roofline
    assert base_one.block_bytes() == one_group.engine_config.block_bytes \
        == 62 * 2 * 16 * 16 * 128 * 2
    assert base.swap_time(100) * 6.2 == pytest.approx(base_one.swap_time(100))
