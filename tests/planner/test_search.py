"""The planner's search against exhaustive sweeps of the same replays, and early stopping against
full replays."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core.metrics import RequestRecord
from twinserve.planner.output import front_table
from twinserve.planner.plan import FITTED, PlanResult, _fill, _rank, plan_trace, rate_grid, run_plan
from twinserve.planner.search import (
    RateGrid,
    SearchOutcome,
    SearchTask,
    bracket,
    replay_point,
    replay_requests,
)
from twinserve.planner.slo import FAIL, PASS, Slo, VerdictTracker, parse_slo
from twinserve.planner.spec import parse_plan
from twinserve.simulator.run import SimConfig, simulate

SMALL = {"model": "llama-3-8b", "hardware": ["a100-80gb", "h100-sxm"], "max_gpus": 2,
         "workload": {"trace": "azure-conv", "num_requests": 400, "duration_s": 8},
         "slo": {"ttft_p90_ms": 1000, "tpot_p99_ms": 60},
         "space": {"pipeline_parallel_size": [1], "max_num_seqs": [64],
                   "max_num_batched_tokens": [2048]},
         "search": {"tolerance": 0.4, "base_rps": 1.0, "min_rps": 0.5, "max_rps": 48,
                    "dominance_slack": 0}}
# the same space with disaggregated deployments beside the aggregated ones (1P1D: 2 GPUs at TP 1)
WITH_PD = {**SMALL, "space": {**SMALL["space"], "disaggregation": ["off", "1P1D"]}}
# and each xPyD deployment with its decode pool's own batch limit (none: the deployment's 64)
WITH_POOLS = {**WITH_PD, "space": {**WITH_PD["space"], "decode_max_num_seqs": [None, 8]}}


@given(st.integers(-12, 12), st.integers(-12, 12))
def test_bracket_finds_the_highest_passing_index_of_a_monotone_oracle(threshold: int, start: int) -> None:
    grid = RateGrid(base_rps=1.0, tolerance=0.3, min_rps=0.05, max_rps=20.0)
    asked: list[int] = []

    def passes(k: int) -> bool:
        asked.append(k)
        return k <= threshold

    found = bracket(passes, grid, start)
    expected = min(threshold, grid.highest) if threshold >= grid.lowest else None
    assert found == expected
    assert len(asked) == len(set(asked))  # each index asked once


def _exhaustive(spec, out) -> PlanResult:
    """Every configuration of the plan replayed at every rate of the grid, to its end; capacity:
    the highest rate below the first failing one."""
    planned = run_plan(spec, out / "plan")
    trace = plan_trace(spec)
    grid = rate_grid(spec, len(trace))
    rows = []
    for row in planned.rows:
        row = dict(row)
        task = SearchTask("", row["candidate_id"], {}, trace, spec.slos, grid,
                          early_stop=False, duration_s=spec.duration_s)
        cfg = SimConfig.from_flat(_sim(row, spec))
        points, best = {}, None
        for k in range(grid.lowest, grid.highest + 1):
            points[k] = replay_point(cfg, task, k)
            if points[k]["verdict"] == FAIL:
                break
            best = k
        outcome = SearchOutcome(row["candidate_id"], best,
                                grid.rate(best) if best is not None else math.nan,
                                points[best] if best is not None else {},
                                {k: p["verdict"] for k, p in points.items()}, len(points), 0, 0.0)
        _fill(row, outcome, grid)
        rows.append(row)
    return planned, PlanResult(sorted(rows, key=_rank))


def _sim(row, spec) -> dict:
    keys = ("hardware", "tensor_parallel_size", "pipeline_parallel_size", "num_replicas", "router",
            "max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "scheduling_policy")
    pd = {k: row[k] for k in ("prefill_instances", "decode_instances", "kv_link")} \
        if row["prefill_instances"] else {}
    for pool in ("prefill", "decode"):
        given = {arg: row[f"{pool}_{arg}"] for arg in ("max_num_seqs", "max_num_batched_tokens")
                 if row[f"{pool}_{arg}"] is not None}
        if given:
            pd[f"{pool}_args"] = given
    return {"model": spec.space.model, **{k: row[k] for k in keys}, **pd}


@pytest.mark.parametrize("plan", [SMALL, WITH_PD, WITH_POOLS], ids=["aggregated", "with-pd", "pool-axis"])
def test_plan_front_and_best_equal_an_exhaustive_sweep(tmp_path, plan) -> None:
    spec = parse_plan(plan)
    planned, exhaustive = _exhaustive(spec, tmp_path)
    assert [r["status"] for r in planned.rows].count(FITTED) >= 3
    if plan is WITH_POOLS:  # the decode pool's limit is searched as its own configuration
        pools = {r["decode_max_num_seqs"]: r for r in planned.rows
                 if r["prefill_instances"] and r["hardware"] == "h100-sxm"}
        assert set(pools) == {None, 8} and pools[8]["status"] == FITTED
        assert pools[8]["capacity_rps"] != pools[None]["capacity_rps"]
    if plan is WITH_PD:  # both 1P1D deployments were searched and met the SLOs somewhere
        assert sorted(r["name"].split()[0] for r in planned.rows
                      if r["prefill_instances"] == 1 and r["status"] == FITTED) == \
            ["a100-80gb", "h100-sxm"]
    for mine, theirs in zip(planned.rows, exhaustive.rows):
        assert (mine["name"], mine["capacity_rps"]) == (theirs["name"], theirs["capacity_rps"])
    assert planned.best["name"] == exhaustive.best["name"]
    cols = ["front", "name", "x_value", "y_value"]
    assert front_table(planned)[cols].equals(front_table(exhaustive)[cols])
    assert planned.stats["replays_run"] < sum(r["replays"] for r in exhaustive.rows) + len(exhaustive.rows)


@pytest.mark.parametrize("plan", [SMALL, WITH_PD], ids=["aggregated", "with-pd"])
def test_dominance_skipping_keeps_the_best(tmp_path, plan) -> None:
    pricey = {**plan, "prices": {"a100-80gb": 12.0}}  # the A100's 2-GPU configurations cannot win
    full = run_plan(parse_plan(pricey), tmp_path / "full")
    skipping = run_plan(parse_plan({**pricey, "search": {**SMALL["search"], "dominance_slack": 1.5}}),
                        tmp_path / "skip")
    assert skipping.stats["dominated"] > 0
    assert skipping.best["name"] == full.best["name"]
    assert skipping.best["capacity_rps"] == full.best["capacity_rps"]
    assert skipping.stats["replays_run"] < full.stats["replays_run"]
    # no aggregated configuration bounds an xPyD one: each 1P1D is the smallest of its shape
    assert all(r["status"] == FITTED for r in skipping.rows if r["prefill_instances"])


def test_a_plan_resumes_without_replaying(tmp_path) -> None:
    spec = parse_plan({**SMALL, "hardware": ["h100-sxm"], "space": {**SMALL["space"],
                                                                   "tensor_parallel_size": [1]}})
    first = run_plan(spec, tmp_path)
    with pytest.raises(ValueError, match="--resume"):
        run_plan(spec, tmp_path)
    again = run_plan(spec, tmp_path, resume=True)
    assert first.stats["replays_run"] > 0 and again.stats["replays_run"] == 0
    assert again.best["capacity_rps"] == first.best["capacity_rps"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hardware=st.sampled_from(["a100-80gb", "h100-sxm"]), seqs=st.sampled_from([16, 64]),
       k=st.integers(0, 14), ttft=st.sampled_from([300, 1000, 3000]), tpot=st.sampled_from([30, 80]),
       pct=st.sampled_from([50, 90, 99]))
def test_early_stopping_never_changes_a_verdict(hardware, seqs, k, ttft, tpot, pct) -> None:
    trace = plan_trace(parse_plan(SMALL))
    slos = (parse_slo(f"ttft_p{pct}_ms", ttft, 0.9), parse_slo("tpot_p90_ms", tpot, 0.9))
    cfg = SimConfig(model="llama-3-8b", hardware=hardware, max_num_seqs=seqs)
    task = SearchTask("", "c", {}, trace, slos, RateGrid(tolerance=0.4), duration_s=8.0)
    early = replay_point(cfg, task, k)
    full = replay_point(cfg, replace(task, early_stop=False), k)
    assert early["verdict"] == full["verdict"]
    assert full["finished"] == full["num_requests"]
    # stopping on either decided verdict (a pass too) gives the full replay's verdict as well
    requests = replay_requests(trace, task.grid.rate(k), task.duration_s)
    both = VerdictTracker(slos, len(requests), stop_on=(FAIL, PASS))
    stopped = simulate(cfg, requests, stop_when=both.update)
    both.update(stopped.records)
    assert both.final() == full["verdict"]


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=st.sampled_from([(1, 1), (2, 1), (1, 2)]), k=st.integers(4, 14),
       ttft=st.sampled_from([300, 1000]), tpot=st.sampled_from([30, 80]))
def test_early_stopping_never_changes_a_disaggregated_verdict(shape, k, ttft, tpot) -> None:
    trace = plan_trace(parse_plan(SMALL))
    slos = (parse_slo("ttft_p90_ms", ttft, 0.9), parse_slo("tpot_p90_ms", tpot, 0.9))
    cfg = SimConfig(model="llama-3-8b", hardware="h100-sxm", max_num_seqs=64,
                    prefill_instances=shape[0], decode_instances=shape[1])
    task = SearchTask("", "c", {}, trace, slos, RateGrid(tolerance=0.4), duration_s=8.0)
    early = replay_point(cfg, task, k)
    full = replay_point(cfg, replace(task, early_stop=False), k)
    assert early["verdict"] == full["verdict"]
    assert full["finished"] == full["num_requests"]


def test_early_stopping_stops_an_overloaded_disaggregated_replay() -> None:
    trace = plan_trace(parse_plan(SMALL))
    task = SearchTask("", "c", {}, trace, (parse_slo("ttft_p90_ms", 200, 0.9),),
                      RateGrid(tolerance=0.4, max_rps=100), duration_s=8.0)
    cfg = SimConfig(model="llama-3-8b", hardware="a100-80gb", prefill_instances=1,
                    decode_instances=1)
    point = replay_point(cfg, task, 10)
    assert point["verdict"] == FAIL and point["stopped_early"]
    assert point["finished"] < point["num_requests"]


def test_early_stopping_stops_an_overloaded_replay() -> None:
    trace = plan_trace(parse_plan(SMALL))
    slos = (parse_slo("ttft_p90_ms", 200, 0.9),)
    task = SearchTask("", "c", {}, trace, slos, RateGrid(tolerance=0.4, max_rps=100), duration_s=8.0)
    point = replay_point(SimConfig(model="llama-3-8b", hardware="a100-80gb"), task, 10)
    assert point["verdict"] == FAIL and point["stopped_early"]
    assert point["finished"] < point["num_requests"]


def _record(ttft: float, success: bool = True) -> RequestRecord:
    return RequestRecord("r", 0.0, 0.0, ttft, ttft + 1.0, 10, 11, success=success)


def test_the_tracker_decides_as_soon_as_the_verdict_is_known() -> None:
    slo = Slo("ttft_p50_ms", "ttft", 100.0, 0.5)
    tracker = VerdictTracker((slo,), total=4, stop_on=(FAIL, PASS))
    records = [_record(0.5)]
    assert not tracker.update(records) and tracker.decided is None
    records.append(_record(0.01, success=False))  # a failed request misses: 2 of 4 missed
    assert not tracker.update(records)
    records.append(_record(0.5))  # 3 missed > 4 - 2 allowed
    assert tracker.update(records) and tracker.decided == FAIL
    passing = VerdictTracker((slo,), total=4, stop_on=(PASS,))
    assert passing.update([_record(0.01), _record(0.02)]) and passing.decided == PASS
    assert VerdictTracker((slo,), total=4).final() == FAIL  # requests never recorded miss


def test_the_grid_stops_where_the_trace_runs_out() -> None:
    spec = parse_plan({**SMALL, "workload": {"num_requests": 401, "duration_s": 20}})
    grid = rate_grid(spec, 401)
    assert grid.max_rps == pytest.approx(20.0) and grid.rate(grid.highest) <= 20.0
    assert len(replay_requests(plan_trace(spec), grid.rate(grid.highest), 20.0)) <= 401
    with pytest.raises(ValueError, match="base_rps"):
        rate_grid(parse_plan({**SMALL, "workload": {"num_requests": 5, "duration_s": 20}}), 5)


def _smallest_slack(rows: list[dict], spec) -> float:
    """The smallest slack for which pareto's A(slack) holds on an exhaustive plan: the largest
    ratio of per-GPU output between fitted configurations of one key on more and fewer GPUs."""
    from twinserve.planner.plan import plan_trace
    from twinserve.planner.space import size_candidate
    longest = max(r.input_tokens + r.output_tokens for r in plan_trace(spec))
    keys = {c.candidate_id: (*c.replica_key, size_candidate(c, spec.space.model, {}, longest).cost_basis)
            for c in spec.space.candidates()}
    fitted = [r for r in rows if r["status"] == FITTED]
    return max([c["output_tokens_per_s_per_gpu"] / b["output_tokens_per_s_per_gpu"]
                for b in fitted for c in fitted
                if keys[b["candidate_id"]] == keys[c["candidate_id"]] and b["gpus"] < c["gpus"]],
               default=1.0)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(hardware=st.lists(st.sampled_from(["a100-80gb", "h100-sxm", "h200"]), min_size=2, max_size=2,
                         unique=True),
       cheap_first=st.booleans(), max_gpus=st.sampled_from([2, 3, 4]), tps=st.sampled_from([[1], [1, 2]]),
       seqs=st.lists(st.sampled_from([16, 64, 256]), min_size=1, max_size=2, unique=True),
       ttft=st.sampled_from([500, 1000, 2000]), tpot=st.sampled_from([40, 60, 100]))
def test_skipping_keeps_the_best_where_its_assumption_holds(hardware, cheap_first, max_gpus, tps, seqs,
                                                            ttft, tpot) -> None:
    """pareto's docstring, "What it keeps": on small random spaces, skipping at the smallest
    slack for which A(slack) holds changes neither the best nor any searched capacity, and every
    skipped configuration is worse per dollar than the best; the fronts are those of the
    configurations searched (a skipped one may be missing from them). (Two GPU types 8x apart in
    price, so that the dearer one's larger configurations are skipped.)"""
    import tempfile
    from pathlib import Path
    plan = {"model": "llama-3-8b", "hardware": hardware, "max_gpus": max_gpus,
            "workload": {"trace": "azure-conv", "num_requests": 200, "duration_s": 4},
            "slo": {"ttft_p90_ms": ttft, "tpot_p99_ms": tpot},
            "prices": dict(zip(hardware, (1.0, 8.0) if cheap_first else (8.0, 1.0))),
            "space": {"pipeline_parallel_size": [1], "tensor_parallel_size": tps,
                      "router": ["round-robin"], "max_num_seqs": seqs, "max_num_batched_tokens": [2048]},
            "search": {"tolerance": 0.5, "base_rps": 1.0, "min_rps": 0.5, "max_rps": 45,
                       "dominance_slack": 0}}
    with tempfile.TemporaryDirectory() as folder:
        full = run_plan(parse_plan(plan), Path(folder) / "full", workers=1)
        slack = max(1.0, _smallest_slack(full.rows, parse_plan(plan))) * (1 + 1e-6)
        skipping = run_plan(parse_plan({**plan, "search": {**plan["search"], "dominance_slack": slack}}),
                            Path(folder) / "skip", workers=1)
    assert skipping.stats["dominated"] > 0 and full.best is not None
    assert (skipping.best["name"], skipping.best["capacity_rps"]) == \
        (full.best["name"], full.best["capacity_rps"])
    exhaustive = {r["candidate_id"]: r for r in full.rows}
    best_per_dollar = full.best["output_tokens_per_s"] / (full.best["gpus"] * full.best["price_per_gpu_hour"])
    for row in skipping.rows:
        theirs = exhaustive[row["candidate_id"]]
        if row["status"] == "dominated":
            assert not theirs["output_tokens_per_s"] / (theirs["gpus"] * theirs["price_per_gpu_hour"]) \
                >= best_per_dollar  # (NaN: no capacity, also worse)
        else:
            assert row["status"] == theirs["status"]
            assert row["capacity_rps"] == theirs["capacity_rps"] or \
                (math.isnan(row["capacity_rps"]) and math.isnan(theirs["capacity_rps"]))
    skipped = {r["candidate_id"] for r in skipping.rows if r["status"] == "dominated"}
    searched = PlanResult([r for r in full.rows if r["candidate_id"] not in skipped])
    cols = ["front", "name", "x_value", "y_value"]
    assert front_table(skipping)[cols].equals(front_table(searched)[cols])
