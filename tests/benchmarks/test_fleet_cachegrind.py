"""The counted fleet benchmark: cachegrind's totals read, the replay's share taken, a row per
replay, and each child replay (run here without valgrind) the one its name says."""

from __future__ import annotations

import re
import sys

import pytest

from twinserve.benchmarks import fleet_cachegrind
from twinserve.simulator import run as sim_run

_OUT = """desc: I1 cache:         32768 B, 64 B, 8-way associative
cmd: python -m twinserve.benchmarks.fleet_cachegrind --replay lone
events: Ir I1mr ILmr Dr D1mr DLmr Dw D1mw DLmw Bc Bcm Bi Bim
fl=/x/ceval.c
fn=_PyEval_EvalFrameDefault
12 9 1 0 3 1 0 2 0 0 1 0 0 0
summary: 9000 40 4 3000 300 30 1000 100 10 800 80 200 20
"""


def test_totals_reads_the_summary_by_event() -> None:
    counts = fleet_cachegrind.totals(_OUT)
    assert counts["Ir"] == 9000 and counts["DLmr"] == 30 and counts["Bim"] == 20
    assert len(counts) == 13


@pytest.mark.parametrize("text", ["", "events: Ir D1mr\n", "events: Ir D1mr\nsummary: 5\n"])
def test_a_truncated_output_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cachegrind output"):
        fleet_cachegrind.totals(text)


def test_the_replays_share_is_the_full_child_less_the_stopped_one() -> None:
    full, stopped = {"Ir": 9000, "DLmr": 30}, {"Ir": 1000, "DLmr": 10}
    assert fleet_cachegrind.per_request(full, stopped, 4) == {"Ir": 2000.0, "DLmr": 5.0}


def test_a_row_per_replay_each_against_the_lone_one(monkeypatch, capsys) -> None:
    seen: list[tuple[str, bool]] = []

    def child(name, stop_before, args, tmp):
        seen.append((name, stop_before))
        scale = 1 if stop_before else (2 if name == "lone" else 3)
        return {e: 100 * scale for e in ("Ir", "D1mr", "D1mw", "DLmr", "DLmw", "ILmr", "Bcm",
                                         "Bim")}

    monkeypatch.setattr(fleet_cachegrind, "_child", child)
    monkeypatch.setattr(fleet_cachegrind.shutil, "which", lambda name: "/usr/bin/valgrind")
    monkeypatch.setattr(sys, "argv", ["fleet_cachegrind", "--num-requests", "10"])
    fleet_cachegrind.main()
    out = capsys.readouterr().out
    names = ["lone", *fleet_cachegrind.FLEETS,
             *(f"least-outstanding:{how}" for how in fleet_cachegrind.SPLITS)]
    assert sorted(seen) == sorted((n, s) for n in names for s in (False, True))
    rows = re.findall(r"^\| ([\w:-]+) \| (.*) \|$", out, re.M)[1:]
    assert [name for name, _ in rows] == names
    assert rows[0][1] == "10 | 20 | 30 | 20"  # (2 - 1) * 100 / 10 per event, summed per column
    assert rows[1][1] == "20 (2.000x) | 40 (2.000x) | 60 (2.000x) | 40 (2.000x)"


@pytest.mark.parametrize("argv, message", [
    (["--split", "round-robin"], "--split: a router that reads the replicas"),
    (["--split", "nope"], "--split: a router that reads the replicas"),
    (["--num-requests", "0"], "--num-requests must be at least 1, got 0"),
    (["--num-apps", "0"], "--num-apps must be at least 1, got 0"),
    (["--jobs", "0"], "--jobs must be at least 1, got 0"),
])
def test_bad_flags_are_refused_by_name(monkeypatch, capsys, argv,
                                       message) -> None:
    monkeypatch.setattr(sys, "argv", ["fleet_cachegrind", *argv])
    with pytest.raises(SystemExit):
        fleet_cachegrind.main()
    assert message in capsys.readouterr().err


def test_without_valgrind_it_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setattr(fleet_cachegrind.shutil, "which", lambda name: None)
    monkeypatch.setattr(sys, "argv", ["fleet_cachegrind"])
    with pytest.raises(SystemExit):
        fleet_cachegrind.main()
    assert "valgrind is not on the PATH" in capsys.readouterr().err


@pytest.mark.parametrize("name, replicas, apart, reads", [
    ("lone", 1, None, None),
    ("cache-aware", 4, None, None),
    ("least-outstanding:apart", 4, True, False),
    ("least-outstanding:interleaved", 4, False, False),
    ("least-outstanding:read", 4, False, True),
])
def test_each_child_replays_what_its_name_says(monkeypatch, name, replicas, apart,
                                               reads) -> None:
    calls: list[tuple[int, int, dict]] = []
    real = sim_run.simulate

    def simulate(cfg, trace, **kwargs):
        calls.append((cfg.num_replicas, len(trace), kwargs))
        return real(cfg, trace, **kwargs)

    monkeypatch.setattr(fleet_cachegrind, "simulate", simulate)
    fleet_cachegrind.replay(name, 80, 4)
    assert [c[1] for c in calls] == [50, 80]  # the warm-up, then the replay
    num_replicas, _, kwargs = calls[1]
    assert num_replicas == replicas
    if apart is None:
        assert "router" not in kwargs
    else:
        assert kwargs["replicas_apart"] is apart
        assert kwargs["router"].reads_loads is reads
        assert len(kwargs["router"].picks) == 80
        assert calls[0][2]["router"] is not kwargs["router"]  # (each walks its picks once)
    calls.clear()
    fleet_cachegrind.replay(name, 80, 4, stop_before=True)
    assert [c[1] for c in calls] == [50]  # the warm-up alone


def test_a_child_runs_under_cachegrind_with_one_hash_seed(monkeypatch, tmp_path) -> None:
    seen: list[tuple[list[str], dict[str, str]]] = []

    def run(cmd, env, **kwargs):
        seen.append((cmd, env))
        out = next(a.split("=", 1)[1] for a in cmd if a.startswith("--cachegrind-out-file="))
        with open(out, "w") as f:
            f.write(_OUT)
        return fleet_cachegrind.subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fleet_cachegrind.subprocess, "run", run)
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    args = fleet_cachegrind.argparse.Namespace(d1="32768,8,64", ll="1048576,8,64",
                                               split="cache-aware", num_requests=10, num_apps=2)
    assert fleet_cachegrind._child("cache-aware:read", True, args, tmp_path)["Ir"] == 9000
    (cmd, env), = seen
    assert cmd[:2] == ["valgrind", "--tool=cachegrind"] and "--LL=1048576,8,64" in cmd
    assert cmd[-3:] == ["--num-apps", "2", "--stop-before"]
    assert env["PYTHONHASHSEED"] == "0"
