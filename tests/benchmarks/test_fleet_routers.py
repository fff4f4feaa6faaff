"""The fleet benchmark end to end on a small workload: its router table, the alternated CPU
rounds (against the fleet's replicas replayed apart too), the cost's decomposition and the
function-call counts."""

from __future__ import annotations

import re
import sys

import pytest

from twinserve.benchmarks import fleet_routers


def test_fleet_benchmark_prints_every_router_and_the_call_counts(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [
        "fleet_routers", "--num-requests", "48", "--num-apps", "4", "--rate", "20",
        "--input-len", "32", "--output-len", "16", "--repeats", "1",
        "--cost-routers", "round-robin,cache-aware", "--calls", "--decompose"])
    fleet_routers.main()
    out = capsys.readouterr().out
    for name in ("round-robin", "least-outstanding", "prefix-affinity", "cache-aware"):
        assert re.search(rf"^\| {name} \| [\d.]+ ms \|", out, re.M), name
    calls = dict(re.findall(r"^- 4 replicas behind ([\w-]+): (\d+), [\d.]+x; [\d.]+x at equal "
                            r"request counts$", out, re.M))
    assert set(calls) == {"round-robin", "cache-aware"}
    lone, whole = map(int, re.search(r"quarter of the requests: (\d+), fed all: (\d+)$", out,
                                     re.M).groups())
    assert lone > 100 and whole > 100 and all(int(n) > 100 for n in calls.values())
    cpu = re.findall(r"^- 4 replicas behind ([\w-]+): [\d.]+ ms, [\d.]+x; [\d.]+x at equal request "
                     r"counts \(([\d.]+)x paired: .*\); against 1 replica .* share [\d.]+x; "
                     r"against its replicas replayed one at a time ([\d.]+)x$", out, re.M)
    assert [name for name, _, _ in cpu] == ["round-robin", "cache-aware"]
    assert all(float(paired) > 0 and float(ratio) > 0 for _, paired, ratio in cpu)
    split = re.findall(r"^- ([\w-]+): router ([\d.]+)x, reads ([\d.]+)x, interleaving ([\d.]+)x, "
                       r"apart vs lone ([\d.]+)x$", out, re.M)
    assert [row[0] for row in split] == ["round-robin", "cache-aware"]
    assert all(float(x) > 0 for row in split for x in row[1:])
    profiled = re.findall(r"^- ([\w-]+): as often (\d+) against (\d+) \(([\d.]+)x\), the fleet's "
                          r"own (\d+), the rest (\d+) against (\d+)$", out, re.M)
    assert [row[0] for row in profiled] == ["round-robin", "cache-aware"]
    for _, same, same_lone, ratio, _own, rest, rest_lone in profiled:
        assert int(same) > 0 and int(same_lone) > 0 and float(ratio) > 0
        assert int(rest) + int(same) > 0 and int(rest_lone) >= 0


def test_a_fleets_shares_replayed_apart_are_its_own_requests() -> None:
    """The recorded routing is the fleet's: each replica replayed alone on its share finishes
    its requests when the fleet did."""
    from twinserve.simulator import SimConfig, simulate
    from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace
    trace = multi_app_trace(MultiAppConfig(num_requests=120, request_rate=40.0, num_apps=6,
                                           input_len=64, output_len=24, seed=2))
    cfg = SimConfig(model=fleet_routers.MODEL, hardware=fleet_routers.HARDWARE, num_replicas=4,
                    router="cache-aware")
    picks, flags = fleet_routers._picks(cfg, trace)
    assert flags == (True, True, False)  # cache-aware reads loads and KV events, not usage
    shares = [[tr for tr, at in zip(trace, picks) if at == i] for i in range(4)]
    assert sorted(len(s) for s in shares) != [30] * 4 and sum(map(len, shares)) == len(trace)
    lone = SimConfig(model=fleet_routers.MODEL, hardware=fleet_routers.HARDWARE)
    apart = sorted((r.request_id, r.ttft, r.finish_time) for share in shares
                   for r in simulate(lone, share).records)
    fleet = sorted((r.request_id, r.ttft, r.finish_time) for r in simulate(cfg, trace).records)
    assert apart == fleet
    # the decomposition's replays of the picks, through the reads and in one environment
    # reading nothing, are the same work too
    for replay in ((picks, *flags, True), (picks, False, False, False, False)):
        router = fleet_routers._Replayed(*replay[:4])
        records = simulate(cfg, trace, router=router, replicas_apart=replay[4]).records
        assert sorted((r.request_id, r.ttft, r.finish_time) for r in records) == fleet


def test_the_profile_split_puts_each_function_in_one_class() -> None:
    """As often: within 10% of the lone replica's calls; the fleet's own: calls the lone
    replica never makes; the rest: the other calls, either side's time."""
    lone = fleet_routers._Profile(4.0, {("a", 1, "f"): (10.0, 1e-6), ("a", 2, "g"): (1.0, 3e-6),
                                        ("a", 3, "h"): (2.0, 5e-6)})
    fleet = fleet_routers._Profile(5.0, {("a", 1, "f"): (10.9, 2e-6), ("a", 2, "g"): (2.0, 4e-6),
                                         ("b", 1, "r"): (1.0, 7e-6)})
    (same_lone, same), own, (rest_lone, rest) = fleet.split(lone)
    assert (same_lone, same, own) == pytest.approx((1.0, 2.0, 7.0))
    assert (rest_lone, rest) == pytest.approx((8.0, 4.0))  # g's calls doubled; h: the lone's only
