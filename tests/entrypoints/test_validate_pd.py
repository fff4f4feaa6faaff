"""``twinserve validate --prefill-instances X --decode-instances Y``: the refusals, the link the
twin takes, and one end-to-end run of 1P1D beside its twin (run folders with the transfer
columns on one clock, the error table's rows)."""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import queue
from pathlib import Path

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.core.metrics import RequestRecord
from twinserve.core.request_output import KVLoadTiming
from twinserve.core.run_dir import PD_REQUEST_COLUMNS
from twinserve.entrypoints.cli import validate_pd
from twinserve.entrypoints.cli.main import main
from twinserve.entrypoints.cli.validate_pd import (
    PD_METRICS,
    FrontTiming,
    PDReplay,
    check_pd_validate,
    error_table,
    load_split,
    pd_summary,
    real_results,
    real_runs,
    twin_link,
)
from twinserve.entrypoints.pd_front import InstanceRecord, PDDeployment
from twinserve.simulator.hardware import load_hardware
from twinserve.traces import TraceRequest

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
    ({"reuse_real": ["runs/real"]}, "--reuse-real"),
    ({"at_host_speed": True}, "--at-host-speed"),
    ({"full_space": True}, "--calibrate-full-space"),
    ({"acceptance_profile": "a.json"}, "--acceptance-profile"),
    ({"use_profile_cache": False}, "--no-profile-cache"),
    ({"detokenize": False}, "--no-detokenize"),
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


def with_link(path: Path, fitted: tuple = ()) -> Path:
    """The bundled CPU profile with a link (so the twin needs no measurement) and ``fitted``."""
    profile = dataclasses.replace(load_hardware("cpu"), kv_link={
        "bandwidth_bytes_per_s": 2.5e9, "latency_s": 4e-4}, fitted=fitted)
    return profile.save(path)


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_validate_1p1d_writes_both_runs_with_transfer_columns_and_the_errors(
        tmp_path: Path, capsys) -> None:
    from twinserve.fidelity.backend import with_model
    from twinserve.simulator.hardware import FittedParams
    from twinserve.simulator.model_spec import load_model_spec
    out = tmp_path / "out"
    model = load_model_spec(str(with_model(EngineArgs()).model)).name
    fit = FittedParams(5e-3, {"num_tokens": 2e-5, "num_decode_seqs": 1e-4}, model)
    profile = with_link(tmp_path / "cpu-link.json", (fit,))
    code = main(["validate", *WORKLOAD, *ENGINE, "--prefill-instances", "1",
                 "--decode-instances", "1", "--kv-transfer-config", f'{{"kv_port": {PORT}}}',
                 "--profile", str(profile), "--at-replay-speed", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    steps = rows(out / "real" / "steps.csv")  # each instance's, prefill first, as the twin's
    assert {s["replica"] for s in steps} == {"0", "1"}
    assert [float(s["seconds"]) for s in rows(out / "real" / "step_features.csv")] == \
        pytest.approx([float(s["duration"]) for s in steps])
    prefill = [s for s in steps if s["replica"] == "0"]
    assert sum(int(s["num_prefill_tokens"]) for s in prefill) >= 6 * 64  # (the prompts)
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
    speed = float(errors["replay_speed_vs_profile"]["real"])  # the twin ran at the real speed
    scaled = load_hardware(str(out / "profile-at-replay-speed.json"))
    assert speed > 0 and scaled.fitted[0].intercept_s == pytest.approx(5e-3 * speed, rel=1e-6)
    assert scaled.kv_link == load_hardware(str(profile)).kv_link


def test_real_results_set_the_instances_records_and_the_load_on_the_fronts_clock() -> None:
    t0, pd = 1000.0, PDDeployment(2, 1)
    trace = [TraceRequest("a", 0.0, 64, 3), TraceRequest("b", 0.5, 64, 3)]
    done: queue.SimpleQueue = queue.SimpleQueue()
    a = FrontTiming("a", t0 + 0.01, done, [t0 + 0.30, t0 + 0.35, t0 + 0.40], t0 + 0.40, "length",
                    kv_load=KVLoadTiming(t0 + 0.15, t0 + 0.20, 4096))
    b = FrontTiming("b", t0 + 0.51, done, [t0 + 0.70, t0 + 0.75, t0 + 0.80], t0 + 0.80, "length",
                    kv_load=KVLoadTiming(t0 + 0.62, t0 + 0.62, 0))  # its prompt was cached
    rec = [InstanceRecord(1, RequestRecord("a", t0 + 0.02, t0 + 0.05, t0 + 0.12, t0 + 0.12, 64, 1)),
           InstanceRecord(2, RequestRecord("a", t0 + 0.14, t0 + 0.22, t0 + 0.25, t0 + 0.39, 64, 3,
                                           cached_tokens=16)),
           InstanceRecord(0, RequestRecord("b", t0 + 0.52, t0 + 0.53, t0 + 0.60, t0 + 0.60, 64, 1)),
           InstanceRecord(2, RequestRecord("b", t0 + 0.61, t0 + 0.65, t0 + 0.68, t0 + 0.79, 64, 3))]
    records, parts = real_results(PDReplay([a, b], rec, [{}] * 3, t0, 1.0), trace, pd)
    ra, rb = records
    assert (ra.arrival_time, ra.first_token_time, ra.finish_time) == pytest.approx((0.01, 0.30,
                                                                                    0.40))
    assert ra.first_scheduled_time == pytest.approx(0.22)  # the decode instance's
    assert ra.cached_tokens == 16 and list(ra.itls) == pytest.approx([0.05, 0.05])
    pa, pb = parts["a"], parts["b"]
    assert (pa.prefill_engine, pa.decode_engine, pb.prefill_engine) == ("prefill-1", "decode-0",
                                                                        "prefill-0")
    row = pa.row(ra.first_token_time)  # kv_transfer_s, bytes, queue, prefill, transfer, decode
    assert row[2:] == pytest.approx((0.05, 4096, 0.04, 0.07, 0.08, 0.10))
    assert sum(row[4:]) == pytest.approx(ra.ttft)
    assert math.isnan(pb.load_end) and pb.row(rb.first_token_time)[6] == pytest.approx(0.0)
    summary = pd_summary(records, parts, pd)
    assert summary["num_kv_transfers"] == 1 and summary["kv_transfer_bytes"] == 4096
    assert summary["mean_kv_transfer_ms"] == pytest.approx(50.0)
    assert summary["mean_ttft_queue_ms"] == pytest.approx((40 + 20) / 2)


def test_each_real_repeat_is_a_fresh_deployment_in_its_own_folder(tmp_path: Path,
                                                                  monkeypatch) -> None:
    started: list[int] = []

    def replay(engine, pd, trace, vocab):  # (replay_pd starts and shuts down its own front)
        started.append(len(started))
        return f"replay-{started[-1]}"

    def write(replay, trace, pd, out, engine, desc):
        out.mkdir(parents=True)
        (out / "from").write_text(replay)
        return out
    monkeypatch.setattr(validate_pd, "replay_pd", replay)
    monkeypatch.setattr(validate_pd, "write_real", write)
    dirs = real_runs(EngineArgs(), PDDeployment(1, 1), [], 100, tmp_path, {}, 3, print)
    assert [d.name for d in dirs] == ["real", "real-2", "real-3"] and started == [0, 1, 2]
    assert [(d / "from").read_text() for d in dirs] == ["replay-0", "replay-1", "replay-2"]
    with pytest.raises(ValueError, match="--real-repeats"):
        real_runs(EngineArgs(), PDDeployment(1, 1), [], 100, tmp_path, {}, 0, print)


def test_the_twin_is_judged_against_the_median_of_the_real_runs() -> None:
    reals = [{"mean_ttft_ms": t, "mean_kv_transfer_ms": k, "request_throughput": 1.0}
             for t, k in ((100.0, 10.0), (120.0, 30.0), (300.0, 12.0))]
    sim = {"mean_ttft_ms": 110.0, "mean_kv_transfer_ms": 12.0, "request_throughput": 1.0}
    table = error_table(reals, sim, "t")
    assert table.row("mean_ttft_ms")["real"] == 120.0
    assert table.row("mean_kv_transfer_ms")["real"] == 12.0
    assert table.row("mean_kv_transfer_ms")["rel_error_pct"] == pytest.approx(0.0)
    assert table.repeatability  # three runs: each left out against the others
    assert not error_table(reals[:1], sim, "t").repeatability


def test_loads_are_split_by_the_decode_instances_steps(tmp_path: Path) -> None:
    # decode-0 emits tokens every 25 ms from 1.0 s to 1.5 s (request "a"): a load of "b" from
    # 1.10 to 1.12 s falls inside its steps, one of "c" at 3.0 s (after a's last token) does not
    def row(rid, arrival, first, itls, transfer_end, load_s):
        return {"request_id": rid, "success": "1", "decode_engine": "decode-0",
                "arrival_time": arrival, "first_token_time": first,
                "itls_ms": " ".join(str(x) for x in itls), "ttft_queue_s": 0.0,
                "ttft_prefill_s": 0.0, "ttft_transfer_s": transfer_end - arrival,
                "kv_transfer_s": load_s}
    rows = [row("a", 0.9, 1.0, [25.0] * 20, 0.95, 0.01),
            row("b", 1.0, 1.2, [25.0] * 3, 1.12, 0.02),
            row("c", 2.9, 3.1, [25.0] * 3, 3.05, 0.005)]
    with open(tmp_path / "requests.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    split = load_split(tmp_path)
    assert (split.in_step, split.idle) == (1, 2)
    assert split.in_step_ms == pytest.approx(20.0)
    assert split.idle_ms == pytest.approx((10.0 + 5.0) / 2)
