"""Pipeline stages that share one host (``HardwareProfile.shared_stage_slowdown``): the profile
field, and the twin's clock charging the slowdown only while stages compute at once."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
from pipeline_helpers import SLOW_LINK, run_pp2_queue

from twinserve.simulator.hardware import HardwareProfile, load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.pipeline import (
    PipelineCost,
    PipelineStepCost,
    SharedStageClock,
    StageClock,
)
from twinserve.simulator.step_time import StepTimeFunction

CPU = load_hardware("cpu")
SPEC = load_model_spec("llama-3-8b")
# stage 0 computes 1 s, stage 1 2 s; 0.5 s per hop, 0.25 s for the logits (dyadic: exact sums)
COST = PipelineStepCost((1.0, 2.0), 0.5, 0.25, 3.75)


def _shared(factor: float) -> SharedStageClock:
    return SharedStageClock(dataclasses.replace(CPU, shared_stage_slowdown=factor).stage_slowdown)


def test_profiles_without_the_field_load_as_separate_devices_and_round_trip_it(tmp_path) -> None:
    data = CPU.to_dict()
    assert "shared_stage_slowdown" not in data  # (1.0 is not written: older files compare equal)
    assert HardwareProfile.from_dict(data).shared_stage_slowdown == 1.0
    assert load_hardware("h100-sxm").shared_stage_slowdown == 1.0
    path = dataclasses.replace(CPU, shared_stage_slowdown=1.75).save(tmp_path / "p.json")
    assert json.loads(path.read_text())["shared_stage_slowdown"] == 1.75
    assert load_hardware(path).shared_stage_slowdown == 1.75


@pytest.mark.parametrize("bad", [0.5, 0.0, -2.0, math.nan, math.inf, "2", True, None])
def test_nonsense_slowdowns_are_refused_by_name(bad) -> None:
    with pytest.raises(ValueError, match="shared_stage_slowdown"):
        HardwareProfile.from_dict({**CPU.to_dict(), "shared_stage_slowdown": bad})


def test_each_other_busy_stage_adds_the_measured_pairs_extra_time() -> None:
    hw = dataclasses.replace(CPU, shared_stage_slowdown=1.5)
    assert [hw.stage_slowdown(k) for k in range(4)] == [1.0, 1.5, 2.0, 2.5]
    with pytest.raises(ValueError, match="others_busy"):
        hw.stage_slowdown(-1)


def test_the_pipeline_picks_the_independent_clock_at_one_and_the_shared_one_above() -> None:
    base = StepTimeFunction(lambda out: 0.04)
    assert isinstance(PipelineCost(base, SPEC, CPU, 2).clock(), StageClock)
    shared = dataclasses.replace(CPU, shared_stage_slowdown=2.0)
    assert isinstance(PipelineCost(base, SPEC, shared, 2).clock(), SharedStageClock)


def test_only_the_overlap_is_slowed() -> None:
    """A enters at 0: stage 0 alone 0-1, hop to 1.5, stage 1 starts A. B enters at 1.5: both
    stages compute at half speed until stage 0 ends B's 1 s of work at 3.5 (stage 1 has done 1 s
    of A's 2); stage 1 ends A alone at 4.5, its logits reach the driver at 4.75; B's hop then
    runs 4.75-5.25 (the driver free), stage 1 computes B alone to 7.25, logits at 7.5."""
    clock = _shared(2.0)
    assert clock.enter(COST, 0.0) == (1.5, 0)
    assert clock.enter(COST, 1.5) == (5.25, 1)
    assert clock.done(0) == 4.75
    assert clock.done(1) == 7.5
    separate = StageClock()  # the same two batches on separate devices
    assert separate.enter(COST, 0.0) == (1.5, 3.75)
    assert separate.enter(COST, 1.5) == (4.25, 6.5)


def test_a_batch_alone_in_the_pipeline_costs_nothing_extra() -> None:
    clock = _shared(3.0)
    assert clock.enter(COST, 0.0) == (1.5, 0)
    assert clock.done(0) == 3.75  # nothing overlapped: the stages and transfers in turn
    assert clock.enter(COST, 10.0) == (11.5, 1)
    assert clock.done(1) == 13.75


def test_at_one_the_shared_clock_times_batches_as_the_independent_one() -> None:
    """Random batches entered and waited for as the engine does: the same ends (to rounding)."""
    rng = random.Random(7)
    for _ in range(50):
        pp = rng.choice([2, 3, 4])
        old, new, now, queue = StageClock(), _shared(1.0), 0.0, []
        for _ in range(30):
            cost = PipelineStepCost(tuple(rng.uniform(0.1, 1) for _ in range(pp)),
                                    rng.uniform(0, 0.3) * (pp - 1), rng.uniform(0, 0.2), 0.0)
            if len(queue) < pp and rng.random() < 0.7:
                (free, done), (free2, handle) = old.enter(cost, now), new.enter(cost, now)
                assert free2 == pytest.approx(free, abs=1e-9)
                queue.append((done, handle))
                now = free
            elif queue:
                done, handle = queue.pop(0)
                assert new.done(handle) == pytest.approx(done, abs=1e-9)
                now = max(now, done)
            now += rng.choice([0.0, 0.0, rng.uniform(0, 1)])


def test_entering_before_the_clocks_time_or_waiting_for_an_unknown_batch_is_refused() -> None:
    clock = _shared(2.0)
    clock.enter(COST, 0.0)
    with pytest.raises(ValueError, match="before the clock"):
        clock.enter(COST, 1.0)
    with pytest.raises(ValueError, match="batch 5"):
        clock.done(5)


def _times(factor: float, arrivals: list[float]) -> list[tuple[float, float]]:
    """(start, end) of each step of 20-token requests arriving at ``arrivals`` through the
    twin's PP=2 queue on a constant 40 ms base step, on a host of ``factor``."""
    hw = dataclasses.replace(SLOW_LINK, shared_stage_slowdown=factor)
    return [(s.time, s.time + s.duration) for s in run_pp2_queue(arrivals, hw)[0]]


def test_the_twins_queue_slows_overlapping_batches_and_not_a_lone_request() -> None:
    assert _times(2.0, [0.0]) == _times(1.0, [0.0])  # one batch at a time: nothing overlaps
    separate, shared = _times(1.0, [0.0, 0.001]), _times(2.0, [0.0, 0.001])
    assert len(shared) == len(separate) == 40
    assert shared[-1][1] > 1.2 * separate[-1][1]  # two batches in flight: the stages overlap
    assert shared[-1][1] < 2.0 * separate[-1][1]
