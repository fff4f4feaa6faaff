"""A simulated run's folder against the plain writers (``run_dir._request_row`` through
``csv.writer``, ``run_dir._write_steps_reference``), written in this process and by the forked
steps writer: the same bytes."""

from __future__ import annotations

import csv
import io

import pytest

from twinserve.core import run_dir
from twinserve.simulator.run import SimConfig, simulate, write_sim_run
from twinserve.traces import load_trace


@pytest.fixture(scope="module")
def result():
    trace = load_trace("azure-conv", limit=300)
    return simulate(SimConfig(model="llama-3-8b", hardware="h100-sxm", num_replicas=2), trace)


def _plain_requests(records) -> str:
    buf = io.StringIO(newline="")
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(run_dir.REQUEST_COLUMNS)
    w.writerows(run_dir._request_row(r) for r in records)
    return buf.getvalue()


@pytest.mark.parametrize("fork_at", [10**9, 1], ids=["in-process", "forked"])
def test_a_runs_folder_is_the_plain_writers_bytes(result, tmp_path, monkeypatch, fork_at) -> None:
    assert len(result.steps) > 1000 and sum(len(r.itls) for r in result.records) > 10_000
    monkeypatch.setattr(run_dir, "_FORK_STEPS_AT", fork_at)
    out = write_sim_run(result, tmp_path / "run", {"trace": "azure-conv"})
    assert (out / "requests.csv").read_text() == _plain_requests(result.records)
    run_dir._write_steps_reference(tmp_path, list(result.steps))
    for name in ("steps.csv", "tenants.csv"):
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name
