"""``twinserve validate --prefill-instances X --decode-instances Y``: the refusals, the link the
twin takes, and one end-to-end run of 1P1D beside its twin (run folders with the transfer
columns on one clock, the error table's rows)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
from pathlib import Path

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.core.run_dir import PD_REQUEST_COLUMNS
from twinserve.entrypoints.cli.main import main
from twinserve.entrypoints.cli.validate_pd import PD_METRICS, check_pd_validate, twin_link
from twinserve.simulator.hardware import load_hardware

PORT = 15480  # the instances' side channels (apart from the other P/D tests' ports)
WORKLOAD = ["--trace", "synthetic", "--num-requests", "6", "--request-rate", "2",
            "--input-len", "64", "--output-len", "8", "--seed", "3"]
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
          "--kv-cache-memory-bytes", str(16 << 20)]


def namespace(**given) -> argparse.Namespace:
    flags = dict(real_repeats=1, reuse_real=None, at_host_speed=False, at_replay_speed=False,
                 full_space=False, acceptance_profile=None, profile="cpu")
    return argparse.Namespace(**{**flags, **given})


@pytest.mark.parametrize(("given", "named"), [
    ({"real_repeats": 3}, "--real-repeats"),
    ({"reuse_real": ["runs/real"]}, "--reuse-real"),
    ({"at_host_speed": True}, "--at-host-speed"),
    ({"at_replay_speed": True}, "--at-replay-speed"),
    ({"full_space": True}, "--calibrate-full-space"),
    ({"acceptance_profile": "a.json"}, "--acceptance-profile"),
    ({"profile": None}, "needs --profile"),
])
def test_flags_a_pd_validate_does_not_take_are_refused_by_name(given: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_pd_validate(namespace(**given), EngineArgs())


@pytest.mark.parametrize(("engine", "named"), [
    (EngineArgs(data_parallel_size=2), "--data-parallel-size"),
    (EngineArgs(enable_lora=True), "--enable-lora"),
    (EngineArgs(tensor_parallel_size=2), "--tensor-parallel-size"),
])
def test_engines_a_pd_validate_does_not_run_are_refused_by_name(engine: EngineArgs,
                                                                named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_pd_validate(namespace(), engine)
    check_pd_validate(namespace(), EngineArgs())  # (the plain one passes)


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill-instances", "1"], "give both"),
    (["--kv-link", "nvlink"], "--kv-link needs --prefill-instances"),
    (["--prefill-instances", "1", "--decode-instances", "1", "--data-parallel-size", "2"],
     "--data-parallel-size"),
    (["--prefill-instances", "1", "--decode-instances", "1", "--real-repeats", "2",
      "--profile", "cpu"], "--real-repeats"),
])
def test_the_command_refuses_before_starting_anything(flags: list[str], message: str,
                                                      tmp_path: Path, capsys) -> None:
    code = main(["validate", *WORKLOAD, *flags, "--out", str(tmp_path / "out")])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "real").exists()


def test_the_twin_takes_the_given_link_else_the_profiles_measured_one(tmp_path: Path) -> None:
    gpu = {"device_type": "cuda"}
    assert twin_link("h100-sxm", "infiniband", "m", gpu, tmp_path, print) == ("h100-sxm",
                                                                              "infiniband")
    assert twin_link("h100-sxm", None, "m", gpu, tmp_path, print) == ("h100-sxm", None)
    with pytest.raises(ValueError, match="--kv-link measured: profile h100-sxm has no kv_link"):
        twin_link("h100-sxm", "measured", "m", gpu, tmp_path, print)
    linked = str(with_link(tmp_path / "linked.json"))
    assert twin_link(linked, None, "m", {"device_type": "cpu"}, tmp_path, print) == (linked, None)
    assert not (tmp_path / "profile.json").exists()  # nothing measured


def with_link(path: Path) -> Path:
    """The bundled CPU profile with a link (so the twin needs no measurement)."""
    profile = dataclasses.replace(load_hardware("cpu"), kv_link={
        "bandwidth_bytes_per_s": 2.5e9, "latency_s": 4e-4})
    return profile.save(path)


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_validate_1p1d_writes_both_runs_with_transfer_columns_and_the_errors(
        tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["validate", *WORKLOAD, *ENGINE, "--prefill-instances", "1",
                 "--decode-instances", "1", "--kv-transfer-config", f'{{"kv_port": {PORT}}}',
                 "--profile", str(with_link(tmp_path / "cpu-link.json")), "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    for side in ("real", "sim"):
        requests = rows(out / side / "requests.csv")
        assert len(requests) == 6 and set(PD_REQUEST_COLUMNS) <= set(requests[0])
        for r in requests:
            assert r["success"] == "1" and r["prefill_engine"] == "prefill-0"
            assert r["decode_engine"] == "decode-0" and int(r["kv_transfer_bytes"]) > 0
            ttft = float(r["ttft_ms"]) / 1e3
            parts = [float(r[f"ttft_{p}_s"]) for p in ("queue", "prefill", "transfer", "decode")]
            # every part >= 0: the instances' clocks and the front's line up
            assert min(parts) >= 0 and sum(parts) == pytest.approx(ttft, abs=1e-6), (side, r)
            assert 0 < float(r["kv_transfer_s"]) <= float(r["ttft_transfer_s"]) < ttft
    errors = {r["metric"]: r for r in rows(out / "errors.csv")}
    for metric in ("mean_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", *PD_METRICS):
        low = 0.0 if metric == "mean_ttft_queue_ms" else 1e-9  # (an idle prefill: no queue)
        assert float(errors[metric]["real"]) >= low and float(errors[metric]["sim"]) >= low, metric
        assert not math.isnan(float(errors[metric]["rel_error_pct"]))
        assert metric in printed
    assert "1P1D" in printed
