"""A lone replica waits for a step it ran ahead to with one SimPy event where one addition lands
on the step's end (``engine._wait_for_step``'s merge): the same records and step rows, float for
float, as with the two events (catch SimPy up to the step's start, then the step), and fewer
events. Arrivals land within steps, at step ends and in ties."""

from __future__ import annotations

import dataclasses
import random

import pytest
import simpy

from twinserve.simulator import SimConfig, simulate
from twinserve.simulator import engine as twin_engine
from twinserve.traces import TraceRequest, first_n, load_trace


def _replay(cfg: SimConfig, trace: list[TraceRequest], merge: bool,
            monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, int]:
    """The run's records and step rows, and the SimPy events it took."""
    events = [0]
    step = simpy.Environment.step

    def counted(env: simpy.Environment) -> None:
        events[0] += 1
        step(env)
    wait = twin_engine._wait_for_step

    def waited(timeout, base, start, duration, end, may_merge):
        return wait(timeout, base, start, duration, end, may_merge and merge)
    with monkeypatch.context() as m:
        m.setattr(simpy.Environment, "step", counted)
        m.setattr(twin_engine, "_wait_for_step", waited)
        result = simulate(cfg, trace)
    return ([dataclasses.astuple(r) for r in result.records],
            [dataclasses.astuple(s) for s in result.steps], events[0])


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_one_event_per_step_waited_gives_the_same_run(monkeypatch, num_replicas: int) -> None:
    cfg = SimConfig(model="llama-3-8b", hardware="h100-sxm", num_replicas=num_replicas)
    trace = first_n(load_trace("azure-conv"), 300)
    records, steps, events = _replay(cfg, trace, False, monkeypatch)
    ends = sorted({s[0] + s[1] for s in steps})  # arrivals exactly at step ends, and ties
    ties = [TraceRequest(f"tie{i}", ends[k], 300, 40) for i, k in enumerate((10, 10, 400, 2000))]
    trace = sorted(trace + ties, key=lambda tr: tr.arrival_time)
    records, steps, events = _replay(cfg, trace, False, monkeypatch)
    merged = _replay(cfg, trace, True, monkeypatch)
    assert merged[:2] == (records, steps)
    if num_replicas == 1:
        assert merged[2] < 0.9 * events
    else:  # a fleet's replicas run ahead to their own horizons: two events each
        assert merged[2] == events


def test_the_waits_land_simpys_clock_exactly_on_the_steps_end() -> None:
    rng = random.Random(3)
    merged = 0
    for _ in range(2000):
        base = rng.uniform(0, 0.01)  # (steps long beside the clock: some sums round)
        start = base + rng.choice([0.0, rng.uniform(0, 0.02)])
        duration = rng.uniform(0, 0.03)
        end = start + duration
        for merge in (False, True):
            delays = list(twin_engine._wait_for_step(lambda d: d, base, start, duration, end,
                                                     merge))
            now = base
            for delay in delays:  # SimPy: now + delay, one event after the other
                now += delay
            assert now == end
            if merge and len(delays) == 1 and start != base:
                merged += 1
            if not merge and start != base:
                assert delays == [start - base, duration]
    assert 900 < merged < 1000  # one event where it lands exactly, two where not
