"""Calibration: the fit (synthetic samples and a tiny random Llama's grid), and ``twinserve
calibrate`` / ``validate`` end to end on a small synthetic slice. The measurement the fit is
given (grid, probes, engine loop) is tested in ``test_profiler.py``."""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from twinserve.core.outputs import AGGREGATE_FIELDS
from twinserve.core.step_sample import StepSample, read_samples, step_kind, write_samples
from twinserve.simulator.calibration import (
    calibrated_profile,
    combine,
    features_of,
    fit,
    fit_backend,
    fit_errors,
    output_of,
    predict,
    split_backend_samples,
)
from twinserve.simulator.cost_model import ALL_FEATURE_NAMES, make_cost_model
from twinserve.simulator.hardware import FittedParams, load_hardware
from twinserve.simulator.model_spec import load_model_spec


# ---- the fit -------------------------------------------------------------------------------
def _random_aggregates(rng: np.random.Generator) -> dict[str, int]:
    decodes = int(rng.integers(0, 64))
    chunks = int(rng.integers(0 if decodes else 1, 3))
    prefill = sum(int(rng.integers(1, 512)) for _ in range(chunks))
    contexts = [int(rng.integers(2, 2048)) for _ in range(decodes)]
    decode_ctx = sum(contexts)
    prefill_ctx = prefill * int(rng.integers(1, 1024)) if chunks else 0
    return {"total_num_scheduled_tokens": decodes + prefill, "num_prefill_tokens": prefill,
            "num_decode_tokens": decodes, "num_prefill_seqs": chunks, "num_decode_seqs": decodes,
            "sum_context_tokens": decode_ctx + prefill_ctx, "sum_decode_context_tokens": decode_ctx,
            "max_decode_context": max(contexts, default=0)}


TRUE_INTERCEPT = 4e-3
TRUE = {"num_tokens": 2e-4, "num_prefill_tokens": 5e-5, "num_prefill_seqs": 1e-3,
        "num_decode_seqs": 3e-4, "sum_context_tokens": 2e-8, "sum_decode_context_tokens": 1e-7,
        "padded_decode_context_tokens": 5e-8}


def _synthetic_samples(n: int, noise: float, seed: int = 0) -> list[StepSample]:
    rng = np.random.default_rng(seed)
    truth = FittedParams(TRUE_INTERCEPT, TRUE)
    out = []
    for _ in range(n):
        agg = _random_aggregates(rng)
        y = predict(truth, agg) * (1 + noise * rng.standard_normal())
        out.append(StepSample(agg, max(y, 0.0)))
    return out


@pytest.mark.parametrize("weighting", ["absolute", "relative"])
def test_fit_recovers_known_coefficients(weighting: str) -> None:
    params = fit(_synthetic_samples(400, 0.0), "m", 1, weighting)
    c = params.coefficients
    for name in ("num_prefill_seqs", "sum_context_tokens", "sum_decode_context_tokens"):
        assert c[name] == pytest.approx(TRUE[name], rel=1e-4), name
    # num_tokens = num_prefill_tokens + num_decode_seqs, and the token segments add up to it:
    # how the per-token cost splits between those is not identifiable, the step time is
    for sample in _synthetic_samples(50, 0.0, seed=8):
        assert predict(params, sample.aggregates) == pytest.approx(sample.seconds, rel=1e-4)
    assert params.model == "m" and params.num_samples == 400


def test_fit_with_noise_is_close_and_errors_are_per_kind() -> None:
    samples = _synthetic_samples(600, 0.02, seed=1)
    params = fit(samples, None, 1, "relative")
    truth = FittedParams(TRUE_INTERCEPT, TRUE)
    for sample in _synthetic_samples(50, 0.0, seed=8):
        assert predict(params, sample.aggregates) == pytest.approx(
            predict(truth, sample.aggregates), rel=0.05)
    errors = {e.kind: e for e in fit_errors(params, samples)}
    assert {"prefill", "decode", "mixed", "all"} <= set(errors)
    assert errors["all"].mape < 4.0 and errors["all"].count == 600


def test_absolute_fit_matches_the_total() -> None:
    samples = _synthetic_samples(300, 0.1, seed=2)
    params = fit(samples, None, 1, "absolute")
    total = sum(s.seconds for s in samples)
    assert sum(predict(params, s.aggregates) for s in samples) == pytest.approx(total, rel=0.01)


def test_combine_adds_and_features_match_cost_model(tmp_path: Path) -> None:
    a = FittedParams(1e-3, {"num_tokens": 1e-4}, "m")
    b = FittedParams(2e-3, {"num_decode_seqs": 5e-5, "num_tokens": 1e-5}, "m")
    both = combine(a, b)
    agg = _random_aggregates(np.random.default_rng(3))
    assert predict(both, agg) == pytest.approx(predict(a, agg) + predict(b, agg))
    assert set(features_of(agg)) == set(ALL_FEATURE_NAMES)
    assert step_kind({"num_prefill_seqs": 1, "num_decode_seqs": 2}) == "mixed"
    samples = _synthetic_samples(5, 0.0)
    samples[0].execute_seconds = 0.5
    back = read_samples(write_samples(tmp_path / "s.csv", samples))
    assert [s.aggregates for s in back] == [s.aggregates for s in samples]
    assert back[0].execute_seconds == 0.5 and math.isnan(back[1].execute_seconds)
    with pytest.raises(ValueError, match="unknown aggregate"):
        StepSample({"tokens": 3}, 1.0)


def test_step_samples_are_validated_and_written_as_before(tmp_path: Path) -> None:
    """The CSV is the run folders' step_features.csv: its bytes stay what they were."""
    agg = {k: i for i, k in enumerate(AGGREGATE_FIELDS)}
    agg["num_spec_tokens"] = 0  # (its column is written only for steps with drafts)
    samples = [StepSample(agg, 0.0123456789, 0.01), StepSample({}, 0.5, kind="swap")]
    path = write_samples(tmp_path / "s.csv", samples)
    assert path.read_text() == (
        "kind,total_num_scheduled_tokens,num_prefill_tokens,num_decode_tokens,"
        "num_prefill_seqs,num_decode_seqs,sum_context_tokens,sum_decode_context_tokens,"
        "max_decode_context,num_prefix_chunks,sum_prefix_context_tokens,"
        "sum_prefill_attention_area,seconds,execute_seconds\n"
        "mixed,0,1,2,3,4,5,6,7,8,9,10,0.012345679,0.01\n"
        "swap,0,0,0,0,0,0,0,0,0,0,0,0.5,\n")
    assert [s.kind for s in read_samples(path)] == ["mixed", "swap"]
    drafts = write_samples(tmp_path / "d.csv", [StepSample({**agg, "num_spec_tokens": 3}, 0.5)])
    assert "sum_prefill_attention_area,num_spec_tokens,seconds" in drafts.read_text()
    assert read_samples(drafts)[0].aggregates["num_spec_tokens"] == 3
    # a file from before the prefixes' column: derived from the chunks' tokens x context, exact
    # for equal chunks (3 chunks of 8 after 100, 50 and 0 tokens, beside 2 decodes at 10)
    older = tmp_path / "older.csv"
    older.write_text("kind,total_num_scheduled_tokens,num_prefill_tokens,num_decode_tokens,"
                     "num_prefill_seqs,num_decode_seqs,sum_context_tokens,"
                     "sum_decode_context_tokens,max_decode_context,num_prefix_chunks,seconds,"
                     "execute_seconds\n"
                     f"mixed,26,24,2,3,2,{8 * 150 + 3 * 36 + 20},20,10,2,0.5,\n"
                     "decode,2,0,2,0,2,20,20,11,0,0.5,\n")
    assert [s.aggregates["sum_prefix_context_tokens"] for s in read_samples(older)] == [150, 0]
    # and the chunks' attention area too: 8 x (100 + 8) + 8 x (50 + 8) + 8 x 8
    assert [s.aggregates["sum_prefill_attention_area"] for s in read_samples(older)] == [1392, 0]
    # a file from before the prefix chunks' column: exact for decodes, refused for prefills
    old = tmp_path / "old.csv"
    old.write_text("kind,total_num_scheduled_tokens,num_prefill_tokens,num_decode_tokens,"
                   "num_prefill_seqs,num_decode_seqs,sum_context_tokens,"
                   "sum_decode_context_tokens,max_decode_context,seconds,execute_seconds\n"
                   "decode,2,0,2,0,2,20,20,11,0.5,\n")
    assert read_samples(old)[0].aggregates["num_prefix_chunks"] == 0
    old.write_text(old.read_text() + "prefill,8,8,0,1,0,36,0,0,0.5,\n")
    with pytest.raises(ValueError, match=r"old.csv:3: .*num_prefix_chunks.*older"):
        read_samples(old)
    with pytest.raises(FileNotFoundError, match="step_features.csv"):
        read_samples(tmp_path)  # a folder without the run's samples
    with pytest.raises(ValueError, match="kind"):
        StepSample({}, 1.0, kind="idle")
    with pytest.raises(ValueError, match="seconds"):
        StepSample({}, math.nan)
    with pytest.raises(ValueError, match="execute_seconds"):
        StepSample({}, 1.0, -1.0)


def test_runs_are_fitted_at_the_median_runs_speed() -> None:
    """Three runs of one host, one of them 1.5x slower throughout: the fit lands on the typical
    speed (pooled as measured, it would land ~17% above), and reports each run's speed."""
    from twinserve.simulator.calibration import fit_runs, run_speed
    runs = [_synthetic_samples(150, 0.0, seed=s) for s in (5, 6, 7)]
    for s in runs[1]:
        s.seconds *= 1.5
    params, speeds = fit_runs(runs)
    assert speeds == pytest.approx([1.0, 1.5, 1.0], rel=1e-3)
    truth = FittedParams(TRUE_INTERCEPT, TRUE)
    for sample in _synthetic_samples(30, 0.0, seed=8):
        assert predict(params, sample.aggregates) == pytest.approx(
            predict(truth, sample.aggregates), rel=1e-3)
    pooled = fit([s for run in runs for s in run])
    assert run_speed(pooled, runs[0]) < 0.9  # what the median-speed fit avoids
    single, speeds = fit_runs(runs[:1])
    assert speeds == pytest.approx([1.0]) and math.isnan(run_speed(single, []))


def test_calibrated_profile_round_trips_and_drives_the_cost_model(tmp_path: Path,
                                                                  tiny_model: Path) -> None:
    spec = load_model_spec(tiny_model)
    params = fit(_synthetic_samples(100, 0.0), spec.name)
    path = calibrated_profile(load_hardware("cpu"), params, 5e9, name="cpu-cal").save(
        tmp_path / "p.json")
    profile = load_hardware(path)
    assert profile.pcie_bandwidth == 5e9 and profile.find_fitted(spec.name) is not None
    cost = make_cost_model(spec, profile)
    from twinserve.core.outputs import SchedulerOutput
    agg = _random_aggregates(np.random.default_rng(4))
    assert cost.step_time(SchedulerOutput(**agg)) == pytest.approx(predict(params, agg))


# ---- calibrate and validate end to end ----------------------------------------------------
@pytest.mark.slow
def test_calibrate_cli_on_tiny_model(tmp_path: Path, tiny_model: Path, capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    out = tmp_path / "profile.json"
    samples = tmp_path / "samples.csv"
    rc = main(["calibrate", "--model", str(tiny_model), "--out", str(out), "--quick",
               "--dtype", "float32", "--max-num-batched-tokens", "256", "--max-num-seqs", "16",
               "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20), "--repeats", "2",
               "--samples-out", str(samples)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "prefill" in printed and "decode" in printed and "mixed" in printed
    profile = load_hardware(out)
    spec = load_model_spec(tiny_model)
    params = profile.find_fitted(spec.name)
    assert params is not None and params.tensor_parallel_size == 1
    cost = make_cost_model(spec, profile)
    from twinserve.core.outputs import SchedulerOutput

    def prefill(n: int, ctx: int) -> SchedulerOutput:
        return SchedulerOutput(total_num_scheduled_tokens=n, num_prefill_tokens=n,
                               num_prefill_seqs=1, sum_context_tokens=n * ctx + n * (n + 1) // 2)

    def decode(b: int, ctx: int) -> SchedulerOutput:
        return SchedulerOutput(total_num_scheduled_tokens=b, num_decode_tokens=b,
                               num_decode_seqs=b, sum_context_tokens=b * ctx,
                               sum_decode_context_tokens=b * ctx)

    assert cost.step_time(prefill(256, 0)) > cost.step_time(prefill(16, 0))
    assert cost.step_time(prefill(256, 256)) >= cost.step_time(prefill(256, 0))
    assert cost.step_time(decode(16, 64)) > cost.step_time(decode(1, 64))
    assert cost.step_time(decode(16, 400)) >= cost.step_time(decode(16, 64))
    assert len(read_samples(samples)) > 10
    assert len(params.speed_probe) == 4  # the host-speed probe, timed around the measurement
    relevel = tmp_path / "relevel.json"  # the profile at the host's speed now, by the probe
    assert main(["calibrate", "--relevel", str(out), "--model", str(tiny_model), "--dtype",
                 "float32", "--max-num-batched-tokens", "256", "--max-num-seqs", "16",
                 "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20),
                 "--out", str(relevel)]) == 0
    factor = float(printed_factor(capsys.readouterr().out))
    again = load_hardware(relevel).find_fitted(spec.name)
    assert again is not None and 0.2 < factor < 5.0
    assert again.intercept_s == pytest.approx(params.intercept_s * factor, rel=1e-3)
    assert again.host_speed(again.speed_probe) == pytest.approx(1.0)


def printed_factor(printed: str) -> str:
    return printed.split("take ", 1)[1].split("x", 1)[0]


@pytest.mark.slow
def test_validate_end_to_end_on_tiny_model(tmp_path: Path, tiny_model: Path, capsys,
                                           monkeypatch) -> None:
    from twinserve.entrypoints.cli.main import main
    from twinserve.gpu.engine import engine_loop, replay
    from twinserve.reports.fidelity import TARGETS
    from twinserve.reports.repeatability import format_repeatability, read_repeatability
    order: list[str] = []  # the engine loop, which sets the profile's level, before each replay

    def recording(name: str, f: Callable) -> Callable:
        def recorded(*a, **k):
            order.append(name)
            return f(*a, **k)
        return recorded
    for module, name in ((engine_loop, "measure_engine_loop"), (replay, "replay_real")):
        monkeypatch.setattr(module, name, recording(name, getattr(module, name)))
    out = tmp_path / "val"
    rc = main(["validate", "--model", str(tiny_model), "--trace", "synthetic",
               "--num-requests", "12", "--request-rate", "20", "--input-len", "40",
               "--output-len", "8", "--prefix-len", "32", "--prefix-share", "0.5",
               "--policy", "fair", "--tenants", "heavy=3,light=1", "--dtype", "float32",
               "--max-model-len", "256", "--max-num-batched-tokens", "128",
               "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(4 << 20), "--quick",
               "--repeats", "1", "--real-repeats", "2", "--out", str(out), "--quiet",
               "--profile-cache", str(tmp_path / "cache"), "--calibrate-full-space"])
    assert rc == 0
    assert order == ["measure_engine_loop", "replay_real"] * 2
    printed = capsys.readouterr().out
    assert "mean_e2el_ms" in printed and "2 real run(s)" in printed
    for run, backend in (("real", "twinserve"), ("real-2", "twinserve"), ("sim", "sim")):
        config = json.loads((out / run / "config.json").read_text())
        assert config["backend"] == backend and config["trace"] == "synthetic"
        assert config["request_rate"] == 20
        summary = json.loads((out / run / "summary.json").read_text())
        assert summary["completed"] == 12
    real_cfg = json.loads((out / "real" / "config.json").read_text())
    sim_cfg = json.loads((out / "sim" / "config.json").read_text())
    assert sim_cfg["num_gpu_blocks"] == real_cfg["num_gpu_blocks"]
    with open(out / "errors.csv") as f:
        rows = {r["metric"]: r for r in csv.DictReader(f)}
    assert {"request_throughput", "mean_ttft_ms", "mean_tpot_ms", "p90_e2el_ms"} <= set(rows)
    ttft = rows["mean_ttft_ms"]  # the median of the two real replays, with their spread
    assert ttft["real_runs"] == "2"
    assert float(ttft["real_min"]) <= float(ttft["real"]) <= float(ttft["real_max"])
    for tenant in ("heavy", "light"):  # what the fair policy moves, per tenant
        row = rows[f"mean_ttft_ms[{tenant}]"]
        assert row["real_runs"] == "2" and float(row["sim"]) > 0
    assert (out / "profile.json").is_file() and (out / "report.html").is_file()
    assert not (out / "repeatability.csv").exists() and "repeatability:" not in printed
    micro, loop = split_backend_samples(read_samples(out / "profile_samples.csv"))
    assert len(micro) > 10 and len(loop) > 10  # what the profile was fitted on, to refit
    refit = fit_backend(micro, loop, "tiny-llama").params  # (the CSV keeps whole nanoseconds)
    assert refit.intercept_s == pytest.approx(
        load_hardware(out / "profile.json").fitted[0].intercept_s, rel=1e-4)
    assert rows["replayed_step_time_s"]["real_runs"] == "2"  # both replays' steps, as timed
    samples = read_samples(out / "real")
    with open(out / "real" / "steps.csv", newline="") as f:
        steps = list(csv.DictReader(f))
    assert len(samples) == len(steps) > 0
    for run in ("real", "real-2"):  # each replay bracketed by the host-speed probe
        probe = json.loads((out / run / "speed_probe.json").read_text())
        assert set(probe["before"]) == set(probe["after"]) and len(probe["before"]) == 3
    speed = rows["host_speed_vs_profile"]
    assert speed["real_runs"] == "2" and 0.2 < float(speed["real"]) < 5.0
    rc = main(["validate", "--model", str(tiny_model), "--trace", "synthetic",  # at that speed
               "--num-requests", "12", "--request-rate", "20", "--input-len", "40",
               "--output-len", "8", "--prefix-len", "32", "--prefix-share", "0.5",
               "--policy", "fair", "--tenants", "heavy=3,light=1", "--dtype", "float32",
               "--max-model-len", "256", "--profile", str(out / "profile.json"),
               "--reuse-real", str(out / "real"), str(out / "real-2"), "--at-host-speed",
               "--out", str(tmp_path / "at-host"), "--quiet"])
    assert rc == 0
    scaled = load_hardware(tmp_path / "at-host" / "profile-at-host-speed.json").fitted[0]
    calibrated = load_hardware(out / "profile.json").fitted[0]
    assert scaled.intercept_s == pytest.approx(calibrated.intercept_s * float(speed["real"]),
                                               rel=1e-3)
    own = rows["replay_speed_vs_profile"]  # the speed the replays' own steps ran at
    assert own["real_runs"] == "2" and 0.2 < float(own["real"]) < 5.0
    rc = main(["validate", "--model", str(tiny_model), "--trace", "synthetic",
               "--num-requests", "12", "--request-rate", "20", "--input-len", "40",
               "--output-len", "8", "--prefix-len", "32", "--prefix-share", "0.5",
               "--policy", "fair", "--tenants", "heavy=3,light=1", "--dtype", "float32",
               "--max-model-len", "256", "--profile", str(out / "profile.json"),
               "--reuse-real", str(out / "real"), "--at-replay-speed",
               "--out", str(tmp_path / "at-replay"), "--quiet"])
    assert rc == 0
    with open(tmp_path / "at-replay" / "errors.csv") as f:  # one replay: its steps, exactly
        at_replay = {r["metric"]: r for r in csv.DictReader(f)}
    assert float(at_replay["replay_speed_vs_profile"]["real"]) != pytest.approx(1.0)
    assert float(at_replay["replayed_step_time_s"]["rel_error_pct"]) == pytest.approx(0.0,
                                                                                      abs=0.5)
    with pytest.raises(SystemExit):  # one scaling at a time
        main(["validate", "--profile", str(out / "profile.json"), "--at-host-speed",
              "--at-replay-speed", "--reuse-real", str(out / "real"), "--out", str(tmp_path)])
    rc = main(["validate", "--model", str(tiny_model), "--trace", "synthetic",  # 3 runs
               "--num-requests", "12", "--request-rate", "20", "--input-len", "40",
               "--output-len", "8", "--prefix-len", "32", "--prefix-share", "0.5",
               "--policy", "fair", "--tenants", "heavy=3,light=1", "--dtype", "float32",
               "--max-model-len", "256", "--profile", str(out / "profile.json"), "--reuse-real",
               str(out / "real"), str(out / "real-2"), str(out / "real"),
               "--out", str(tmp_path / "three"), "--quiet"])
    assert rc == 0
    repeats = read_repeatability(tmp_path / "three" / "repeatability.csv")
    assert set(repeats) == {m for m, target in TARGETS if target is not None}
    assert all(r.runs == 3 for r in repeats.values())
    assert format_repeatability(list(repeats.values())) in capsys.readouterr().out
    # a second calibration from the recorded steps loads and fits
    rc = main(["calibrate", "--from-run", str(out / "real"), str(out / "real-2"),
               "--out", str(tmp_path / "p2.json")])
    assert rc == 0
    assert load_hardware(tmp_path / "p2.json").find_fitted("tiny-llama") is not None
    assert "run speed" in capsys.readouterr().out  # two runs: each one's speed against the fit
    assert set(AGGREGATE_FIELDS) <= set(read_samples(out / "real")[0].aggregates)


@pytest.mark.slow
def test_fidelity_benchmark_plumbing_on_tiny_model(tmp_path: Path, tiny_model: Path,
                                                   capsys) -> None:
    """The fidelity script end to end at toy size: interleaved rounds of calibration and target
    replays, a single one elsewhere (and of the light calibration slice), leave-one-out and
    in-sample profiles, the table."""
    from twinserve.benchmarks.fidelity import main
    out = tmp_path / "fid"
    rc = main(["--out", str(out), "--model", str(tiny_model), "--num-requests", "6",
               "--calib-window", "0:", "--max-model-len", "128", "--max-output-tokens", "4",
               "--time-scale", "20", "--dtype", "float32", "--threads", "1",
               "--scenarios", "fcfs,light", "--real-repeats", "2", "--calib-light"])
    assert rc == 0
    for run in ("calib-1", "calib-2", "calib-light-1", "fcfs-1", "fcfs-2", "light-1"):
        assert (out / "real" / run / "real" / "summary.json").is_file()
    assert not (out / "real" / "light-2").exists()
    assert not (out / "real" / "calib-light-2").exists()

    def steps(run: str) -> int:
        with open(out / "real" / run / "real" / "step_features.csv") as f:
            return sum(1 for _ in csv.DictReader(f))
    fitted = json.loads((out / "profile.json").read_text())["fitted"][0]["num_samples"]
    assert fitted == sum(steps(run) for run in ("calib-1", "calib-2", "calib-light-1"))
    with open(out / "fidelity.csv") as f:
        rows = list(csv.DictReader(f))
    keyed = {(r["scenario"], r["profile"], r["metric"]): r for r in rows}
    for scenario, runs in (("fcfs", "2"), ("light", "1")):
        for profile in ("from-run", "loo", "self"):
            assert keyed[(scenario, profile, "mean_e2el_ms")]["real_runs"] == runs
    assert "sim vs real, relative error" in capsys.readouterr().out


# ---- issue 27: a fit that generalises, on a tiny model -------------------------------------
def test_region_of_names_the_part_of_the_step_space() -> None:
    from twinserve.simulator.calibration import region_of
    decode = {"num_decode_seqs": 12, "sum_decode_context_tokens": 12 * 300,
              "total_num_scheduled_tokens": 12}
    assert region_of(decode) == "decode b5-16 ctx129-512"
    fresh = {"num_prefill_seqs": 1, "num_prefill_tokens": 64, "sum_context_tokens": 64 * 65 // 2}
    cached = {**fresh, "sum_context_tokens": 64 * 100 + 64 * 65 // 2}
    assert region_of(fresh) == "prefill t33-128 fresh"
    assert region_of(cached) == "prefill t33-128 cached"
    assert region_of({**decode, **fresh, "num_decode_seqs": 1,
                      "sum_decode_context_tokens": 9}) == "mixed b1 t33-128"


def test_trimmed_fit_drops_the_timings_another_process_slowed() -> None:
    """One step in ten timed 3x slower (a shared host): the trimmed fit lands on the truth and
    names those steps; a plain relative fit is pulled off by them."""
    from twinserve.simulator.calibration import fit_trimmed
    samples = _synthetic_samples(300, 0.01, seed=12)
    slowed = samples[::10]
    for s in slowed:
        s.seconds *= 3
    for s in samples:
        s.execute_seconds = s.seconds
    params, dropped = fit_trimmed(samples, [1.0] * len(samples), None)
    assert {id(s) for s in dropped} == {id(s) for s in slowed}
    truth = FittedParams(TRUE_INTERCEPT, TRUE)
    clean = _synthetic_samples(50, 0.0, seed=13)
    worst = max(abs(predict(params, s.aggregates) / predict(truth, s.aggregates) - 1)
                for s in clean)
    plain = fit(samples, None, 1, "relative", "execute_seconds")
    worst_plain = max(abs(predict(plain, s.aggregates) / predict(truth, s.aggregates) - 1)
                      for s in clean)
    assert worst < 0.03 < worst_plain


def test_joint_fit_keeps_the_grid_at_the_runs_speed_and_reports_regions() -> None:
    from twinserve.simulator.calibration import fit_joint
    micro = _synthetic_samples(40, 0.0, seed=14)
    for s in micro:
        s.execute_seconds = s.seconds
    run = _synthetic_samples(2000, 0.0, seed=15)
    for s in run:  # a replay 20% slower than the grid, its loop adding 1 ms per step
        s.execute_seconds = 1.2 * s.seconds
        s.seconds = s.execute_seconds + 1e-3
    cal = fit_joint({"micro": micro, "run": run}, "m")
    assert cal.overhead is not None and cal.overhead.intercept_s == pytest.approx(1e-3, rel=1e-3)
    # the grid reproduced at its own speed (cal.forward), and the profile holding its shape at
    # the replay's speed: 1.2x the grid's timings all over the space, plus the loop's 1 ms
    for s in micro:
        assert predict(cal.forward, s.aggregates) == pytest.approx(s.execute_seconds, rel=1e-3)
        assert predict(cal.params, s.aggregates) == pytest.approx(1.2 * s.execute_seconds + 1e-3,
                                                                  rel=1e-3)
    assert "1.200x" in cal.report
    assert "per region" in cal.report and "decode b" in cal.report
    assert set(cal.params.fit_error) >= {"all_mape", "all_max", "decode_mape"}


def test_tiny_model_fit_is_monotone_reproduces_its_grid_and_predicts_a_held_back_family(
        tiny_runner, tiny_model: Path) -> None:
    """The backend measured on a tiny random Llama: a fit on the micro-benchmark grid and one
    workload family (short prompts, batches filling up) is non-decreasing in tokens and
    context, lands on its own grid within the error it reports, and times the steps of a held-
    back family (long prompts, other batch sizes) within 30% in total."""
    from twinserve.core.outputs import SchedulerOutput
    from twinserve.gpu.engine.engine_loop import LoopScenario, run_engine_loop
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.measurement.profiler import default_grid, run_micro_benchmarks
    eargs, runner = tiny_runner
    micro = run_micro_benchmarks(runner, default_grid(128, 8, 256), warmup=1, repeats=3)
    for sample in micro:  # the fastest repeat, as the engine loop's steps below
        sample.seconds = sample.execute_seconds = min(sample.repeats)
    engine = LLMEngine(eargs, runner=runner, usage_context="server")
    engine.metrics.record_steps = False
    families = ([LoopScenario(8, 24, 6), LoopScenario(3, 40, 6)],
                [LoopScenario(5, 150, 6), LoopScenario(2, 90, 4)])
    # each family 3 times, interleaved; a step is timed by its fastest run (the same steps come
    # every time: all requests are queued at once), which a burst of other work cannot bend
    runs = [[run_engine_loop(engine, scenarios, False) for scenarios in families]
            for _ in range(3)]
    family, held_back = ([StepSample(steps[0].aggregates, min(s.seconds for s in steps),
                                     min(s.execute_seconds for s in steps))
                          for steps in zip(*(r[k] for r in runs))] for k in (0, 1))
    cal = fit_backend(micro, family, "tiny-llama")
    cost = make_cost_model(load_model_spec(tiny_model),
                           calibrated_profile(load_hardware("cpu"), cal.params))

    def step(decodes: int, ctx: int, prefill: int = 0, cached: int = 0) -> SchedulerOutput:
        return SchedulerOutput(
            total_num_scheduled_tokens=decodes + prefill, num_prefill_tokens=prefill,
            num_decode_tokens=decodes, num_prefill_seqs=int(prefill > 0), num_decode_seqs=decodes,
            sum_context_tokens=decodes * ctx + prefill * cached + prefill * (prefill + 1) // 2,
            sum_decode_context_tokens=decodes * ctx, max_decode_context=ctx if decodes else 0)

    for b in range(1, 8):
        for ctx in (8, 64, 200):
            assert cost.step_time(step(b + 1, ctx)) >= cost.step_time(step(b, ctx))
            assert cost.step_time(step(b, ctx + 50)) >= cost.step_time(step(b, ctx))
    for n in (1, 16, 100):
        assert cost.step_time(step(0, 0, n + 10)) >= cost.step_time(step(0, 0, n))
        assert cost.step_time(step(0, 0, n, 64)) >= cost.step_time(step(0, 0, n))
    # the grid and the family's steps within the errors the profile states (mean, max)
    forward = fit_errors(cal.forward, micro, "execute_seconds")[-1]
    stated = cal.params.fit_error
    assert (forward.mape, forward.max_ape) == pytest.approx(
        (stated["micro_mape"], stated["micro_max"]), abs=0.01)
    assert fit_errors(cal.params, family)[-1].mape == pytest.approx(stated["all_mape"], abs=0.01)
    # a sanity bound only: steps of 1-3 ms on a shared 2-core host (load 5) scatter that much
    assert stated["micro_mape"] < 60.0 and stated["all_mape"] < 60.0
    # the held-back family: its typical step within a factor of 2 (steps of a few ms on a
    # shared 2-core host swing 3x from one run to the next at load 5; the kernel-shaped test
    # below and the study on the real model state the tight figures)
    ratios = [cost.step_time(output_of(s.aggregates)) / s.seconds for s in held_back]
    assert 0.5 <= statistics.median(ratios) <= 2.0


def _kernel_shaped_seconds(agg: dict[str, int]) -> float:
    """A step time shaped as the CPU engine's kernels cost (no noise): a GEMM floor stepping up
    with the token count, per-token GEMM work, the decode kernel's summed contexts plus its
    longest one (a small batch splits over heads), prefill attention by each chunk's whole
    query-by-key rectangle (the CPU kernels skip none of its masked half; more per chunk after a
    prefix: a masked kernel that reads the prefix), and per-sequence sampling."""
    tokens, decodes = agg["total_num_scheduled_tokens"], agg["num_decode_seqs"]
    floor = 0.060 if tokens <= 4 else 0.075 if tokens <= 16 else 0.090
    decode_ctx = agg["sum_decode_context_tokens"]
    return (floor + 4e-4 * tokens + 2e-5 * decode_ctx + 3e-5 * agg["max_decode_context"]
            + 8e-7 * agg["sum_prefill_attention_area"] + 3e-4 * decodes
            + 2e-3 * agg["num_prefill_seqs"] + 5e-3 * agg.get("num_prefix_chunks", 0)
            + 1e-5 * agg.get("sum_prefix_context_tokens", 0))


def _family(batches: list[int], prompts: list[int], output: int,
            seed: int = 0) -> list[StepSample]:
    """The steps of every batch of prompts decoding ``output`` tokens (prefill chunks of at most
    512 tokens, then the decodes at equal and spread contexts), the forward pass timed by
    ``_kernel_shaped_seconds`` with 2% noise."""
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    rng = np.random.default_rng(seed)
    steps = []
    for b in batches:
        for p in prompts:
            specs = [StepSpec(prefills=((min(p - c, 512), c),)) for _ in range(b)
                     for c in range(0, p, 512)]
            specs += [StepSpec(decodes=(p + k,) * b) for k in range(1, output)]
            specs += [StepSpec(decodes=tuple(p + k + 3 * i for i in range(b)))
                      for k in range(1, output, 4)]
            for spec in specs:
                agg = aggregates(build_step(spec, 16, 10**6, 256))
                forward = _kernel_shaped_seconds(agg) * (1 + 0.02 * rng.standard_normal())
                # + the loop's sampling and scheduling
                loop = 1e-3 + 5e-5 * (agg["num_decode_seqs"] + agg["num_prefill_seqs"])
                steps.append(StepSample(agg, forward + loop, forward))
    return steps


def _kernel_shaped_grid(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                        seed: int) -> list[StepSample]:
    """The default micro-benchmark grid at these limits, timed by ``_kernel_shaped_seconds``
    with 2% noise."""
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import build_step, default_grid
    rng = np.random.default_rng(seed)
    grid = []
    for spec in default_grid(max_num_batched_tokens, max_num_seqs, max_model_len):
        agg = aggregates(build_step(spec, 16, 10**6, 256))
        seconds = _kernel_shaped_seconds(agg) * (1 + 0.02 * rng.standard_normal())
        grid.append(StepSample(agg, seconds, seconds))
    return grid


def test_a_fit_on_one_family_predicts_a_held_back_one_kernel_shaped() -> None:
    """Steps timed as the kernels cost: the micro-benchmark grid plus one workload family
    (short prompts, small batches) predict a held-back family (long prompts, large batches)
    within 5% per step; the family alone, fitted as ``--from-run`` does, misses by more."""
    grid = _kernel_shaped_grid(1024, 64, 2048, seed=1)
    family = _family([1, 2, 4], [40, 120], 12, seed=2)
    held_back = _family([16, 48], [600, 1500], 12, seed=3)
    truth = [_kernel_shaped_seconds(s.aggregates) + s.seconds - s.execute_seconds
             for s in held_back]
    cal = fit_backend(grid, family, "m")
    worst = max(abs(predict(cal.params, s.aggregates) / t - 1) for s, t in zip(held_back, truth))
    assert worst < 0.05
    alone = fit(family, "m", 1, "absolute", kernel=True)
    worst_alone = max(abs(predict(alone, s.aggregates) / t - 1)
                      for s, t in zip(held_back, truth))
    assert worst_alone > 2 * worst


def test_prefix_hit_bursts_are_predicted_by_the_reads_of_their_prefixes() -> None:
    """Bursts of prefix-cache hits (2 to 10 short chunks after long cached prefixes, with or
    without decodes beside them), a region no workload family of the fit holds: the grid's
    prefix-chunk steps and the prefix-read term predict them within 5%; a fit that cannot see
    the prefixes' lengths (only their count and tokens x context) misses by more than twice that."""
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    grid = _kernel_shaped_grid(512, 32, 512, seed=4)
    family = _family([1, 2, 4], [40, 120], 12, seed=5)
    bursts = [aggregates(build_step(StepSpec(decodes=(300,) * d, prefills=((n, s),) * k),
                                    16, 10**6, 256))
              for k in (2, 5, 10) for n in (4, 7, 16) for s in (100, 300, 490) for d in (0, 4)]
    worst, worst_without = _worst_errors(grid, family, bursts, "sum_prefix_context_tokens")
    assert worst < 0.05
    assert worst_without > 2 * worst


def _worst_errors(grid: list[StepSample], family: list[StepSample], steps: list[dict[str, int]],
                  feature: str) -> tuple[float, float]:
    """The largest relative error on ``steps`` (timed by ``_kernel_shaped_seconds``) of the
    backend fit of ``grid`` and ``family``, and of the same fit with ``feature`` hidden (0)."""
    from dataclasses import replace as replaced

    def blind(samples: list[StepSample]) -> list[StepSample]:
        return [replaced(s, aggregates={**s.aggregates, feature: 0}) for s in samples]

    truth = [_kernel_shaped_seconds(a) for a in steps]
    fitted = fit_backend(grid, family, "m").forward
    without = fit_backend(blind(grid), blind(family), "m").forward
    return (max(abs(predict(fitted, a) / t - 1) for a, t in zip(steps, truth)),
            max(abs(predict(without, {**a, feature: 0}) / t - 1) for a, t in zip(steps, truth)))


def test_long_prompts_are_predicted_by_their_attention_rectangles() -> None:
    """Steps of long prompts (fresh, or chunks after 128-256 computed tokens, one or two of them,
    alone or beside decodes), timed as the CPU kernels cost: the chunks' attention is a quarter
    to half of the step. The grid's fit (timed with 2% noise) predicts them within 4% with the
    rectangle term (1-3.4% over grid seeds 6-10); a fit that sees only tokens x context (the
    triangle of a fresh prompt) misses by more than twice that (8.5-12%)."""
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    grid = _kernel_shaped_grid(1024, 32, 1024, seed=6)
    family = _family([1, 2, 4], [40, 120], 12, seed=7)
    steps = [aggregates(build_step(StepSpec(decodes=(300,) * d, prefills=((n, s),) * k),
                                   16, 10**6, 256))
             for n, k in ((300, 1), (420, 1), (500, 1), (240, 2)) for s in (0, 128, 256)
             for d in (0, 6)]
    worst, worst_without = _worst_errors(grid, family, steps, "sum_prefill_attention_area")
    assert worst < 0.04
    assert worst_without > 2 * worst


def test_the_fit_follows_the_gemm_floors_jumps() -> None:
    """Steps timed as the kernels cost, with 2% noise: the grid times every decode batch size,
    so the fit lands the floor's jumps (15 ms from 5 and from 17 tokens) where they are, instead
    of spreading them over the segment from 4 to 8 or 16 to 32 tokens. (The prior against jumps
    shrinks the one at 5 a little: 5 decodes come out 2-5% short over noise seeds 5-8.)"""
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    from twinserve.simulator.calibration import fit_trimmed
    grid = _kernel_shaped_grid(512, 32, 512, seed=5)
    params, _ = fit_trimmed(grid, [1.0] * len(grid), "m")

    def decodes(b: int) -> dict[str, int]:
        return aggregates(build_step(StepSpec(decodes=(100,) * b), 16, 10**6, 256))

    for b in range(1, 33):
        truth = _kernel_shaped_seconds(decodes(b))
        assert predict(params, decodes(b)) == pytest.approx(truth, rel=0.05), b
    for k in (5, 17):
        jump = predict(params, decodes(k)) - predict(params, decodes(k - 1))
        assert 0.010 < jump < 0.020


def test_from_run_with_backend_samples_fits_the_runs_and_the_grid_jointly(tmp_path: Path) -> None:
    from twinserve.core.step_sample import SAMPLES_FILE
    from twinserve.simulator.calibration import calibrate_from_runs
    micro = _synthetic_samples(60, 0.0, seed=16)
    for s in micro:
        s.execute_seconds = s.seconds
    run = tmp_path / "run"
    run.mkdir()
    steps = _synthetic_samples(300, 0.0, seed=17)
    for s in steps:
        s.execute_seconds, s.seconds = s.seconds, s.seconds + 2e-3
    write_samples(run / SAMPLES_FILE, steps)
    alone = calibrate_from_runs([run], "m")
    assert "extrapolated" in alone.report and alone.overhead is None
    (tmp_path / "copy").mkdir()  # two runs, each its own source
    write_samples(tmp_path / "copy" / SAMPLES_FILE, steps)
    joint = calibrate_from_runs([run, tmp_path / "copy"], "m", backend_samples=micro)
    assert joint.overhead is not None and joint.overhead.intercept_s == pytest.approx(2e-3)
    assert "run 1: 300 steps" in joint.report and "run 2: 300 steps" in joint.report
    assert "run speed" in joint.report
    assert joint.params.fit_error["micro_mape"] < 1.0


def test_host_speed_is_the_median_probe_ratio_and_scaling_follows_it() -> None:
    """The probe's steps at 2x, 1x and 3x their calibration times (one step not probed then):
    the host runs at 2x; the fit scaled by 2 times every step at twice its time."""
    from twinserve.core.outputs import SchedulerOutput
    from twinserve.simulator.cost_model import CostModel, FittedCostModel
    fit = FittedParams(0.01, {"num_tokens": 1e-4, "sum_context_tokens": 1e-6, "tokens_ge_5": 2e-3},
                       model="llama-3-8b", speed_probe={"a": 1.0, "b": 2.0, "c": 4.0})
    assert fit.host_speed({"a": 2.0, "b": 2.0, "c": 12.0, "d": 7.0}) == pytest.approx(2.0)
    slow = fit.scaled(2.0)
    assert dict(slow.speed_probe) == {"a": 2.0, "b": 4.0, "c": 8.0}
    assert slow.host_speed({"a": 2.0, "b": 4.0, "c": 8.0}) == pytest.approx(1.0)
    base = CostModel(load_model_spec("llama-3-8b"), load_hardware("h100"))
    for b in (1, 6, 40):
        out = SchedulerOutput(total_num_scheduled_tokens=b, num_decode_tokens=b, num_decode_seqs=b,
                              sum_context_tokens=100 * b, sum_decode_context_tokens=100 * b,
                              max_decode_context=100)
        assert (FittedCostModel(slow, base).step_time(out)
                == pytest.approx(2 * FittedCostModel(fit, base).step_time(out)))
    with pytest.raises(ValueError, match="no speed probe"):
        FittedParams(0.01, {}, model="llama-3-8b").host_speed({"a": 1.0})
    with pytest.raises(ValueError, match="no speed probe of the probed steps"):
        fit.host_speed({"z": 1.0})
    with pytest.raises(ValueError, match="factor"):
        fit.scaled(0.0)
