"""The fleet benchmark end to end on a small workload: its router table, the alternated CPU
rounds and the function-call counts."""

from __future__ import annotations

import re
import sys

from twinserve.benchmarks import fleet_routers


def test_fleet_benchmark_prints_every_router_and_the_call_counts(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", [
        "fleet_routers", "--num-requests", "48", "--num-apps", "4", "--rate", "20",
        "--input-len", "32", "--output-len", "16", "--repeats", "1",
        "--cost-routers", "round-robin,cache-aware", "--calls"])
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
                     r"counts; against 1 replica", out, re.M)
    assert cpu == ["round-robin", "cache-aware"]
