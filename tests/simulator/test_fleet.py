"""The twin at fleet scale: a fleet's fast path (each replica runs ahead to its own horizon)
against the step-by-step reference, run folder for run folder, for every router."""

from __future__ import annotations

import filecmp
from bisect import bisect_right
from dataclasses import replace

import pytest

from twinserve.core import decode_run
from twinserve.core.decode_run import DecodeRun
from twinserve.routers import ROUTERS, CacheAwareRouter, ReplicaLoad, make_router, uses_kv_events
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

SMALL = {"model": "smollm2-135m", "hardware": "a100-80gb"}


@pytest.fixture(scope="module")
def workload():
    return multi_app_trace(MultiAppConfig(num_requests=150, request_rate=30.0, num_apps=6,
                                          system_len_max=1024, input_len=200, output_len=120))


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("changes", [{}, {"num_gpu_blocks_override": 300}],
                         ids=["roomy", "evicting"])
def test_fleet_fast_path_writes_the_references_run_folder(monkeypatch, tmp_path, workload,
                                                           router, changes) -> None:
    cfg = SimConfig(num_replicas=3, router=router, **SMALL, **changes)
    reference = simulate(cfg, workload, decode_runs=False)
    in_runs = [0]
    apply = DecodeRun.apply

    def counting_apply(self: DecodeRun, ends: list[float]) -> list[int]:
        in_runs[0] += len(ends)
        return apply(self, ends)

    monkeypatch.setattr(decode_run.DecodeRun, "apply", counting_apply)
    fast = simulate(cfg, workload)
    assert in_runs[0] >= 0.3 * len(fast.steps)  # the fast path was taken
    assert len({s.replica for s in fast.steps}) == 3
    desc = {"trace": "multi-app"}
    a = write_sim_run(reference, tmp_path / "reference", desc)
    b = write_sim_run(fast, tmp_path / "fast", desc)
    names = sorted(p.name for p in a.iterdir())
    assert "steps.csv" in names and "requests.csv" in names
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_fleet_step_rows_are_in_time_order(workload) -> None:
    result = simulate(SimConfig(num_replicas=3, router="round-robin", **SMALL), workload)
    keys = [(s.time, s.replica) for s in result.steps]
    assert keys == sorted(keys)


class _Skewed:
    """Reads nothing of the replicas (routed ahead), never picks replica 0, and sends two of
    three requests to replica 1: some replicas have no request among those routed ahead."""

    reads_loads = False

    def __init__(self) -> None:
        self.n = 0

    def route(self, request, replicas) -> int:
        self.n += 1
        return 2 if self.n % 3 == 0 else 1

    def on_kv_events(self, replica, events) -> None:
        pass

    def on_replica_reset(self, replica) -> None:
        pass


def test_a_router_routed_ahead_that_skips_replicas_matches_the_reference(workload) -> None:
    cfg = SimConfig(num_replicas=3, **SMALL)
    reference = simulate(cfg, workload, decode_runs=False, router=_Skewed())
    fast = simulate(cfg, workload, router=_Skewed())
    assert fast.records == reference.records
    assert list(fast.steps) == list(reference.steps)
    assert {s.replica for s in fast.steps} == {1, 2}


class _Recording:
    """A router (cache-aware by default), keeping what each arrival read of the replicas; it
    reads every field (no ``reads_kv_usage``)."""

    def __init__(self, inner=None) -> None:
        self.inner = CacheAwareRouter(16) if inner is None else inner
        self.uses_kv_events = uses_kv_events(self.inner)
        self.seen: list[tuple[float, list[ReplicaLoad]]] = []

    def route(self, request, replicas) -> int:
        # (copies: the twin refreshes its loads in place for the next arrival)
        self.seen.append((request.arrival_time, [replace(r) for r in replicas]))
        return self.inner.route(request, replicas)

    def on_kv_events(self, replica, events) -> None:
        self.inner.on_kv_events(replica, events)

    def on_replica_reset(self, replica) -> None:
        self.inner.on_replica_reset(replica)


@pytest.mark.parametrize("decode_runs", [True, False], ids=["fast", "reference"])
def test_arrivals_read_each_replicas_step_in_progress_from_its_step_rows(workload,
                                                                         decode_runs) -> None:
    """A load's step times are the replica's own step rows: the step spanning the arrival
    began ``step_elapsed_s`` before it (None: no row spans it) and the row before lasted
    ``last_step_s``; the fast path (decode runs, lazy runs) fills them as the reference does."""
    router = _Recording()
    result = simulate(SimConfig(num_replicas=3, **SMALL), workload, decode_runs=decode_runs,
                      router=router)
    rows = [[s for s in result.steps if s.replica == i] for i in range(3)]
    starts = [[s.time for s in mine] for mine in rows]
    busy = 0
    for t, loads in router.seen:
        for i, load in enumerate(loads):
            k = bisect_right(starts[i], t) - 1  # the last step of replica i begun by t
            spans = k >= 0 and t < rows[i][k].time + rows[i][k].duration
            if load.step_elapsed_s is None:  # idle, or a step begun at t after the read
                assert not spans or rows[i][k].time == t, (t, i)
                continue
            busy += 1
            if not spans:  # begun exactly at t, after the arrival read it: not in the rows yet
                k += 1
            assert rows[i][k].time == pytest.approx(t - load.step_elapsed_s, abs=1e-12), (t, i)
            assert load.last_step_s == pytest.approx(rows[i][k - 1].duration, abs=1e-12), (t, i)
    assert busy > len(router.seen)  # most arrivals found replicas mid-step


@pytest.mark.parametrize("name", ["least-outstanding", "cache-aware"])
@pytest.mark.parametrize("usage", ["server", "llm"])
def test_a_router_reading_every_field_reads_the_references_loads(workload, name, usage) -> None:
    """Every load an arrival reads, KV usage and step times included, is the reference's
    (a run in progress's blocks taken, its ends and the blocks they freed)."""
    cfg = SimConfig(num_replicas=3, num_gpu_blocks_override=300, usage_context=usage, **SMALL)
    fast, reference = _Recording(make_router(name, 16)), _Recording(make_router(name, 16))
    simulate(cfg, workload, router=fast)
    simulate(cfg, workload, decode_runs=False, router=reference)
    assert len(fast.seen) == len(workload)
    assert any(0 < load.kv_usage < 1 for _, loads in fast.seen for load in loads)
    assert fast.seen == reference.seen
