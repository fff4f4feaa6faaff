"""The twin's pipeline parallelism (simulator/pipeline.py): the stages split the base step time
as the engine splits the layers, each boundary costs the link's latency plus the activations'
bytes over its bandwidth, the last stage sends the logits back, the bubble is the idle share,
and ``simulate`` with ``pipeline_parallel_size`` charges it."""

from __future__ import annotations

import dataclasses

import pytest

from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.cost_model import make_cost_model
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.pipeline import LOGITS_BYTES, PipelineCost, stage_layers
from twinserve.simulator.run import SimConfig, simulate
from twinserve.simulator.step_time import StepTimeFunction
from twinserve.traces.trace_request import TraceRequest

SPEC = load_model_spec("llama-3-8b")
HW = load_hardware("h100-sxm")


def _decodes(batch: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(total_num_scheduled_tokens=batch, num_decode_tokens=batch,
                           num_decode_seqs=batch, sum_context_tokens=batch * context,
                           sum_decode_context_tokens=batch * context, max_decode_context=context)


def test_stage_layers_match_the_engines_split() -> None:
    from twinserve.gpu.distributed.pipeline import stage_layer_range  # (the engine's own split)
    for layers, pp in ((32, 3), (32, 4), (3, 2), (81, 8)):
        ranges = [stage_layer_range(layers, pp, r) for r in range(pp)]
        assert stage_layers(layers, pp) == tuple(end - start for start, end in ranges)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be in"):
        stage_layers(2, 3)


def test_a_layer_partition_splits_the_twin_as_it_splits_the_engine() -> None:
    from twinserve.gpu.distributed.pipeline import stage_layer_range
    partition = (20, 12)
    ranges = [stage_layer_range(32, 2, r, partition) for r in range(2)]
    assert stage_layers(32, 2, partition) == tuple(end - start for start, end in ranges)
    with pytest.raises(ValueError, match="sum to num_hidden_layers"):
        stage_layers(32, 2, (20, 11))
    base = StepTimeFunction(lambda out: 0.010)
    even = PipelineCost(base, SPEC, HW, 2).breakdown(_decodes(8, 512))
    moved = PipelineCost(base, SPEC, HW, 2, layer_partition=partition).breakdown(_decodes(8, 512))
    body = 0.010 - PipelineCost(base, SPEC, HW, 2).head_time(8) - HW.step_overhead_s
    assert moved.stage_s[0] - even.stage_s[0] == pytest.approx(body * 4 / 32)
    assert moved.total_s == pytest.approx(even.total_s)  # one batch alone: the same sum
    # (the even split is balanced here: 4 more layers make the first stage the busiest one,
    # which sets the beat of two batches in flight)
    assert moved.stage_s[0] > moved.stage_s[1] and moved.interval(2) > even.interval(2)
    cfg = SimConfig.from_flat({"pipeline_parallel_size": 2, "pp_layer_partition": "20,12"})
    assert cfg.engine.layer_partition() == partition


def test_stages_split_the_base_time_by_layers_with_the_head_last_and_overhead_first() -> None:
    base = StepTimeFunction(lambda out: 0.010)
    model = PipelineCost(base, SPEC, HW, pipeline_parallel_size=4)
    out = _decodes(8, 512)
    cost = model.breakdown(out)
    head = model.head_time(8)
    body = 0.010 - head - HW.step_overhead_s
    assert cost.stage_s[1] == pytest.approx(body / 4) == pytest.approx(cost.stage_s[2])
    assert cost.stage_s[0] == pytest.approx(body / 4 + HW.step_overhead_s)
    assert cost.stage_s[3] == pytest.approx(body / 4 + head)
    assert sum(cost.stage_s) == pytest.approx(0.010)  # the compute is the base's, redistributed
    activations = 2 * 8 * SPEC.hidden_size * SPEC.dtype_bytes
    assert cost.transfer_s == pytest.approx(
        3 * (HW.interconnect_latency_s + activations / HW.interconnect_bandwidth))
    assert cost.logits_s == pytest.approx(
        HW.interconnect_latency_s + 8 * SPEC.vocab_size * LOGITS_BYTES / HW.interconnect_bandwidth)
    assert model.step_time(out) == pytest.approx(0.010 + cost.transfer_s + cost.logits_s)
    # one batch in flight: each device computes a quarter of the step and waits the rest
    assert cost.bubble_fraction == pytest.approx(1 - 0.010 / (4 * cost.total_s))
    assert 0.74 < cost.bubble_fraction < 1.0


def test_the_transfer_grows_with_tokens_and_a_slower_link() -> None:
    base = make_cost_model(SPEC, HW)
    fast = PipelineCost(base, SPEC, HW, 2)
    slow_hw = dataclasses.replace(HW, interconnect_bandwidth=HW.interconnect_bandwidth / 10)
    slow = PipelineCost(base, SPEC, slow_hw, 2)
    small, large = _decodes(4, 256), _decodes(256, 256)
    assert fast.breakdown(large).transfer_s > fast.breakdown(small).transfer_s
    activations = 2 * 256 * SPEC.hidden_size * SPEC.dtype_bytes
    assert slow.breakdown(large).transfer_s - fast.breakdown(large).transfer_s == pytest.approx(
        9 * activations / HW.interconnect_bandwidth)
    assert fast.step_time(large) > base.step_time(large)
    assert fast.step_time(SchedulerOutput()) == base.step_time(SchedulerOutput())
    assert PipelineCost(base, SPEC, HW, 1).step_time(large) == base.step_time(large)


def test_simulate_with_pipeline_parallel_size_charges_the_stages() -> None:
    trace = [TraceRequest(request_id=f"r{i}", arrival_time=0.01 * i, input_tokens=256,
                          output_tokens=32) for i in range(20)]
    one = simulate(SimConfig(max_num_seqs=16), trace)
    two = simulate(SimConfig(max_num_seqs=16, pipeline_parallel_size=2), trace)
    assert two.summary["completed"] == one.summary["completed"] == 20
    # the batch queue keeps two batches in the pipeline: steps overlap in time, and the two
    # devices together deliver more than one
    spans = sorted((s.time, s.time + s.duration) for s in two.steps)
    assert sum(b[0] < a[1] for a, b in zip(spans, spans[1:])) > len(spans) // 2
    assert two.summary["output_throughput"] > one.summary["output_throughput"]
    with pytest.raises(ValueError, match="pipeline_parallel_size must be in"):
        simulate(SimConfig(max_num_seqs=16, pipeline_parallel_size=64), trace)


def test_more_batches_in_flight_shorten_the_interval_down_to_the_slowest_stage() -> None:
    model = PipelineCost(StepTimeFunction(lambda out: 0.040), SPEC, HW, pipeline_parallel_size=4)
    cost = model.breakdown(_decodes(8, 512))
    hop = cost.transfer_s / 3
    stages = cost.stage_s  # each stage busy with its compute and its blocking transfers
    slowest = max(stages[0] + hop, *(hop + s + hop for s in stages[1:3]),
                  hop + stages[3] + cost.logits_s)
    assert cost.interval(1) == pytest.approx(cost.total_s)
    assert cost.interval(2) == pytest.approx(max(cost.total_s / 2, slowest))
    assert cost.interval(4) == pytest.approx(slowest)  # the stages overlap fully: the bottleneck
    bubbles = [cost.bubble_with(k) for k in (1, 2, 3, 4)]
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > 0.7 and bubbles[3] < 0.1
    assert cost.bubble_fraction == bubbles[0]
    with pytest.raises(ValueError, match=r"batches_in_flight must be in \[1, 4\]"):
        cost.interval(5)
