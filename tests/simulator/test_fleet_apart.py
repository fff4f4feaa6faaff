"""A fleet behind a router that reads nothing of the replicas, each replica in an environment of
its own (``simulator.fleet_apart``), against one shared environment (the reference) and the
step-by-step replay."""

from __future__ import annotations

import filecmp
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest

from tests.simulator.test_fleet import _Skewed
from twinserve.routers import RoundRobinRouter
from twinserve.simulator import SimConfig, fleet_apart, simulate, write_sim_run
from twinserve.simulator.fleet_apart import RoutedAhead
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

SMALL = {"model": "smollm2-135m", "hardware": "a100-80gb"}


@pytest.fixture(scope="module")
def workload():
    return multi_app_trace(MultiAppConfig(num_requests=150, request_rate=30.0, num_apps=6,
                                          system_len_max=1024, input_len=200, output_len=120))


def _runs(cfg, trace, make_router, monkeypatch):
    """The replay apart (checked to run apart), in one environment, and step by step."""
    calls = []
    own = fleet_apart.own_arrivals

    def counting(*args, **kwargs):
        calls.append(args[2].index)
        return own(*args, **kwargs)

    monkeypatch.setattr(fleet_apart, "own_arrivals", counting)
    apart = simulate(cfg, trace, router=make_router())
    assert sorted(calls) == list(range(cfg.num_replicas))  # one environment per replica
    shared = simulate(cfg, trace, router=make_router(), replicas_apart=False)
    step_by_step = simulate(cfg, trace, router=make_router(), decode_runs=False)
    return apart, shared, step_by_step


@pytest.mark.parametrize("make_router", [RoundRobinRouter, _Skewed], ids=["round-robin", "skewed"])
@pytest.mark.parametrize("turn", [256, 2], ids=["long-turns", "short-turns"])
def test_replicas_apart_replay_the_shared_environment(monkeypatch, workload, make_router,
                                                       turn) -> None:
    monkeypatch.setattr(fleet_apart, "_TURN", turn)
    cfg = SimConfig(num_replicas=3, **SMALL, num_gpu_blocks_override=300)  # (it evicts)
    apart, shared, step_by_step = _runs(cfg, workload, make_router, monkeypatch)
    assert apart.records == shared.records == step_by_step.records
    assert list(apart.steps) == list(shared.steps) == list(step_by_step.steps)
    assert apart.summary == shared.summary
    assert len({s.replica for s in apart.steps}) == (3 if make_router is RoundRobinRouter else 2)


def test_arrivals_at_a_step_end_order_as_in_the_shared_environment(monkeypatch, workload) -> None:
    """Requests moved to arrive exactly when a step of their replica ends (the start of its
    next step): the arrival and the step's end are due at once, ordered by when each was made."""
    cfg = SimConfig(num_replicas=2, **SMALL)
    trace = list(workload[:60])
    moved = 0
    for q in range(6, 60, 9):  # round robin: request q goes to replica q % 2
        first = simulate(cfg, trace, replicas_apart=False)
        low, high = trace[q - 1].arrival_time, trace[q].arrival_time
        starts = [s.time for s in first.steps if s.replica == q % 2 and low < s.time < high]
        if starts:
            trace[q] = replace(trace[q], arrival_time=starts[0])
            moved += 1
    assert moved >= 3
    apart, shared, step_by_step = _runs(cfg, trace, RoundRobinRouter, monkeypatch)
    assert apart.records == shared.records == step_by_step.records
    assert list(apart.steps) == list(shared.steps) == list(step_by_step.steps)


def test_requests_arriving_together_are_released_in_order(monkeypatch, workload) -> None:
    trace = [replace(tr, arrival_time=round(tr.arrival_time, 0)) for tr in workload[:90]]
    cfg = SimConfig(num_replicas=4, **SMALL)
    apart, shared, step_by_step = _runs(cfg, trace, RoundRobinRouter, monkeypatch)
    assert apart.records == shared.records == step_by_step.records
    assert list(apart.steps) == list(shared.steps)


def test_routed_ahead_replays_the_routing_and_forgets_what_every_replica_passed() -> None:
    times = [0.5 * i for i in range(40)]
    requests = iter([SimpleNamespace(arrival_time=t) for t in times])
    routed = RoutedAhead(requests, RoundRobinRouter(), 2)  # type: ignore[arg-type]
    steps = [routed.step(k) for k in range(41)]
    assert steps[-1] is None and all(s is not None for s in steps[:40])
    # routed ahead until every replica has one pending: two at the first release, then one
    assert steps[0] == (2, times[1]) and steps[1] == (3, times[2])
    assert steps[39] == (40, math.inf)  # (the source ran out while routing for it)
    assert [routed.arrival(i) for i in range(40)] == [(t, i % 2) for i, t in enumerate(times)]
    assert routed.take(1).arrival_time == times[1]
    routed.forget_before(30)
    assert routed.arrival(30) == (times[30], 0)
    with pytest.raises(IndexError):
        routed.arrival(29)
    with pytest.raises(IndexError):
        routed.step(29)
    assert routed.step(30) == steps[30] and routed.step(40) is None
    with pytest.raises(ValueError, match="num_replicas"):
        RoutedAhead(iter(()), RoundRobinRouter(), 0)


def test_a_rejected_request_writes_the_references_run_folder(monkeypatch, tmp_path,
                                                             workload) -> None:
    trace = list(workload[:60])
    trace[7] = replace(trace[7], input_tokens=10**6)  # past max_model_len: recorded as failed
    cfg = SimConfig(num_replicas=3, **SMALL)
    runs = _runs(cfg, trace, RoundRobinRouter, monkeypatch)
    assert sum(not r.success for r in runs[0].records) == 1
    folders = [write_sim_run(run, tmp_path / name, {"trace": "multi-app"})
               for run, name in zip(runs, ("apart", "shared", "step-by-step"))]
    names = sorted(p.name for p in folders[0].iterdir())
    assert "requests.csv" in names
    for other in folders[1:]:
        assert filecmp.cmpfiles(folders[0], other, names, shallow=False)[1:] == ([], [])
