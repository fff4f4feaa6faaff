"""The allocator benchmark on a small workload: a row per allocator, each child run under its
own environment and none leaking into this process."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from twinserve.benchmarks import fleet_pages


def test_each_allocator_row_has_the_lone_replica_and_every_fleet(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["fleet_pages", "--num-requests", "60", "--num-apps", "4",
                                      "--rounds", "1", "--routers", "cache-aware"])
    before = dict(os.environ)
    fleet_pages.main()
    assert dict(os.environ) == before
    rows = re.findall(r"^\| ([\w-]+) \| (\d+) us \| (\d+) us, ([\d.]+)x \| (\d+) kB \|$",
                      capsys.readouterr().out, re.M)
    assert [row[0] for row in rows] == list(fleet_pages.SETTINGS)
    assert all(int(lone) > 0 and int(fleet) > 0 and float(ratio) > 0
               for _, lone, fleet, ratio, _ in rows)


def test_a_child_runs_under_its_settings_environment_only(monkeypatch) -> None:
    seen: list[dict[str, str]] = []

    def run(cmd, env, **kwargs):
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0, "cpu_s=1.5 anon_huge_kb=2048\n", "")

    monkeypatch.setattr(fleet_pages.subprocess, "run", run)
    monkeypatch.setenv("PYTHONMALLOC", "debug")
    assert fleet_pages._child("default", "lone", 10, 2) == (1.5, 2048)
    assert fleet_pages._child("malloc-thp", "cache-aware", 10, 2) == (1.5, 2048)
    assert "PYTHONMALLOC" not in seen[0] and "GLIBC_TUNABLES" not in seen[0]
    assert seen[1]["PYTHONMALLOC"] == "malloc"
    assert seen[1]["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


def test_an_unknown_allocator_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "argv", ["fleet_pages", "--settings", "default,jemalloc"])
    with pytest.raises(SystemExit):
        fleet_pages.main()
    assert "--settings: unknown jemalloc" in capsys.readouterr().err
