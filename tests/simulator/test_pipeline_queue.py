"""The twin's batch queue (``simulator.pipeline.pipelined_engine_process``): two batches in the
pipeline at once, each stage on one batch at a time, the steady step interval the step-time
model's ``interval(2)``, and a lone request taking its steps one at a time."""

from __future__ import annotations

import pytest
from pipeline_helpers import run_pp2_queue

from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.pipeline import (
    PipelineStepCost,
    StageClock,
)


def _decode() -> SchedulerOutput:
    return SchedulerOutput(total_num_scheduled_tokens=1, num_decode_tokens=1, num_decode_seqs=1,
                           sum_context_tokens=30, sum_decode_context_tokens=30,
                           max_decode_context=30)


def test_two_requests_alternate_in_two_batches_at_the_steady_interval() -> None:
    steps, pipe, replica = run_pp2_queue([0.0, 0.001])  # r1 arrives while r0's first batch is in flight
    assert len(steps) == 40 and all(s.num_seqs == 1 for s in steps)  # never in one batch
    ends = [s.time + s.duration for s in steps]
    overlapping = sum(b.time < a_end for a_end, b in zip(ends, steps[1:]))
    assert overlapping == len(steps) - 1  # every batch entered before the previous returned
    gaps = [b - a for a, b in zip(ends[4:-2], ends[5:-1])]  # steady decodes
    expected = pipe.breakdown(_decode()).interval(2)
    assert gaps == pytest.approx([expected] * len(gaps), rel=1e-9)
    assert expected < pipe.breakdown(_decode()).interval(1)
    sched = replica.scheduler
    assert not sched.in_flight and sched.kv.num_free_blocks == 64


def test_a_lone_request_takes_its_steps_one_at_a_time() -> None:
    steps, pipe, _ = run_pp2_queue([0.0])
    ends = [s.time + s.duration for s in steps]
    assert all(b.time >= a_end for a_end, b in zip(ends, steps[1:]))  # nothing overlaps
    assert steps[-1].duration == pytest.approx(pipe.breakdown(_decode()).total_s, rel=1e-3)


def test_each_stage_takes_one_batch_at_a_time_and_sends_wait_for_the_receiver() -> None:
    cost = PipelineStepCost((1.0, 3.0), transfer_s=0.5, logits_s=0.25, total_s=4.75)
    clock = StageClock()
    assert clock.enter(cost, 0.0) == (1.5, 4.75)  # stage 1 from 1.5 to 4.5, logits at 4.75
    # the next batch's stage 0 ends at 2.5, but stage 1 is busy until its logits left at 4.75
    assert clock.enter(cost, 1.5) == (5.25, 8.5)
