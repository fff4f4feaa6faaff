"""A simulated run's folder against the plain writers (``run_dir._request_row`` through
``csv.writer``, ``run_dir._write_steps_reference``): the same bytes, for one replica (whose ITL
columns are cut from its step times) and a fleet (whose interleaved steps are not its gaps)."""

from __future__ import annotations

import csv
import io

import pytest

from twinserve.core import run_dir
from twinserve.simulator.run import SimConfig, simulate, write_sim_run
from twinserve.traces import load_trace


@pytest.fixture(scope="module", params=[1, 2], ids=["one-replica", "fleet"])
def result(request):
    trace = load_trace("azure-conv", limit=300)
    return simulate(SimConfig(model="llama-3-8b", hardware="h100-sxm",
                              num_replicas=request.param), trace)


def _plain_requests(records, fleet: bool) -> str:
    buf = io.StringIO(newline="")
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(run_dir.REQUEST_COLUMNS + (run_dir.REPLICA_REQUEST_COLUMNS if fleet else ()))
    w.writerows(run_dir._request_row(r, fleet=fleet) for r in records)
    return buf.getvalue()


def test_a_runs_folder_is_the_plain_writers_bytes(result, tmp_path) -> None:
    assert len(result.steps) > 1000 and sum(len(r.itls) for r in result.records) > 10_000
    out = write_sim_run(result, tmp_path / "run", {"trace": "azure-conv"})
    fleet = result.config.num_replicas > 1
    assert (out / "requests.csv").read_text() == _plain_requests(result.records, fleet)
    run_dir._write_steps_reference(tmp_path, list(result.steps))
    for name in ("steps.csv", "tenants.csv"):
        assert (out / name).read_bytes() == (tmp_path / name).read_bytes(), name


def test_one_replicas_itl_columns_are_cut_from_its_step_times(result) -> None:
    records = result.records
    lengths = [len(r.itls) for r in records]
    text, spans = run_dir._step_gap_spans(records, lengths, result.steps.columns()[0])
    if result.config.num_replicas == 1:
        assert len(spans) > 0.9 * len(records)
    for i, (a, b) in spans.items():
        assert text[a:b] == " ".join(f"{g * 1e3:.6g}" for g in records[i].itls)
