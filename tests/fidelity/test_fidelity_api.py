"""The fidelity library API (``twinserve.fidelity``): the reachable step space, the profile
cache, progress, calibrate -> replay -> twin -> compare on the tiny model, and the CLI as a thin
layer over it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.fidelity import (
    CalibrationSettings,
    ProfileCache,
    ProfileCacheKey,
    Progress,
    StepSpace,
    TraceSpec,
    ValidateSettings,
    reachable_space,
)
from twinserve.traces import TraceRequest


def _requests(*lengths: tuple[int, int]) -> list[TraceRequest]:
    return [TraceRequest(f"r{i}", 0.0, n, o) for i, (n, o) in enumerate(lengths)]


def test_the_reachable_space_is_what_the_workload_can_fill_within_the_limits() -> None:
    limits = StepSpace(256, 2048, 128)
    # 3 requests of 16 + 4: three sequences, all prompts in one step, contexts up to 20
    assert reachable_space(_requests((16, 4), (16, 4), (16, 4)), limits) == StepSpace(3, 48, 20)
    # the engine's limits cap each bound; one tiny request keeps a 16-token floor
    assert reachable_space(_requests(*[(200, 30)] * 40), StepSpace(32, 512, 128)) == \
        StepSpace(32, 512, 128)
    assert reachable_space(_requests((3, 2)), limits) == StepSpace(1, 16, 16)
    assert limits.covers(StepSpace(3, 48, 20)) and not StepSpace(3, 48, 20).covers(limits)
    with pytest.raises(ValueError, match="at least one request"):
        reachable_space([], limits)
    with pytest.raises(ValueError, match="max_num_seqs"):
        StepSpace(0, 16, 16)


def _key(**changes) -> ProfileCacheKey:
    fields = {"device": "AMD EPYC", "threads": 1, "model": "/m", "dtype": "float32",
              "max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 256,
              "block_size": 16}
    return ProfileCacheKey(**{**fields, **changes})


def test_the_profile_cache_serves_an_equal_key_whose_space_covers_the_request(tmp_path: Path) -> None:
    cache = ProfileCache(tmp_path / "cache")
    profile = tmp_path / "p.json"
    profile.write_text('{"name": "cpu-calibrated"}')
    assert cache.find(_key(), StepSpace(3, 48, 20)) is None
    stored = cache.store(profile, _key(), StepSpace(4, 64, 32))
    assert stored.read_text() == profile.read_text()
    assert cache.find(_key(), StepSpace(3, 48, 20)) == stored
    assert cache.find(_key(), StepSpace(5, 48, 20)) is None  # wider than what was timed
    for other in (_key(threads=2), _key(dtype="bfloat16"), _key(max_num_seqs=16),
                  _key(kernel_settings={"cpu_attention": "sdpa"}), _key(pipeline_parallel_size=2)):
        assert cache.find(other, StepSpace(3, 48, 20)) is None
    pp2 = cache.store(profile, _key(pipeline_parallel_size=2), StepSpace(4, 64, 32))
    assert cache.find(_key(pipeline_parallel_size=2), StepSpace(3, 48, 20)) == pp2
    assert cache.find(_key(pipeline_parallel_size=2, pp_layer_partition="19,11"),
                      StepSpace(3, 48, 20)) is None  # (its stages measured apart)
    meta = json.loads(stored.with_name(stored.stem + ".meta.json").read_text())
    assert meta["space"] == {"max_num_seqs": 4, "max_num_batched_tokens": 64,
                             "max_model_len": 32} and meta["kernel_settings"] == {}
    with pytest.raises(ValueError, match="kernel_settings"):
        _key(kernel_settings={"cpu_attention": 1})


def test_progress_counts_the_units_its_messages_close(capsys) -> None:
    progress = Progress("t", messages=True, bar=False)
    progress.expect(3)
    for msg in ("micro-benchmarks: 9 steps x (1 warm-up + 1 repeats)",
                "micro-benchmarks: pass 1 (warm-up) of 9 steps done", "[1] 2 x (16 in)",
                "real replay 1/1: 1.0 s wall, 5 steps", "real replay 2/1: past the total"):
        progress(msg)
    assert progress.done == 3
    assert "real replay 1/1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="total"):
        progress.expect(0)


def test_settings_refuse_bad_values_by_name() -> None:
    with pytest.raises(ValueError, match="repeats"):
        CalibrationSettings(repeats=0)
    with pytest.raises(ValueError, match="threads"):
        CalibrationSettings(threads=0)
    with pytest.raises(ValueError, match="real_repeats"):
        ValidateSettings(real_repeats=0)
    with pytest.raises(ValueError, match="at_speed"):
        ValidateSettings(at_speed="fast")
    with pytest.raises(ValueError, match="--reuse-real needs --profile"):
        ValidateSettings(reuse_real=(Path("r"),))
    with pytest.raises(ValueError, match="--num-requests"):
        TraceSpec("synthetic", num_requests=0).load()


def _engine(model: Path) -> EngineArgs:
    return EngineArgs(str(model), dtype="float32", max_model_len=128, max_num_seqs=8,
                      max_num_batched_tokens=128, kv_cache_memory_bytes=4 << 20)


@pytest.mark.slow
def test_calibrate_replay_twin_compare_on_the_tiny_model(tmp_path: Path, tiny_model: Path) -> None:
    """The docs' script: a profile over the workload's reach, two replays, the twin, the table."""
    from twinserve import fidelity
    from twinserve.simulator.hardware import load_hardware
    engine = _engine(tiny_model)
    workload = TraceSpec("synthetic", num_requests=3, input_len=16, output_len=4,
                         max_model_len=128).load()
    space = reachable_space(workload.requests, StepSpace(8, 128, 128))
    settings = CalibrationSettings(quick=True, repeats=1, threads=1)
    cal = fidelity.calibrate(engine, tmp_path / "profile.json", settings, space)
    assert load_hardware(cal.profile).find_fitted("tiny-llama") is not None
    assert load_hardware(cal.profile).kv_link["bandwidth_bytes_per_s"] > 0  # the connector's
    reals = fidelity.replay(engine, workload, tmp_path / "runs", repeats=2)
    assert [d.name for d in reals] == ["real", "real-2"]
    summary = fidelity.simulate_twin(cal.profile, workload, reals[0], tmp_path / "runs" / "sim")
    assert summary["completed"] == 3
    table = fidelity.compare(tmp_path / "runs" / "sim", reals, cal.profile)
    ttft = table.row("mean_ttft_ms")
    assert ttft["real_runs"] == 2 and float(ttft["sim"]) > 0
    assert table.row("replayed_step_time_s")["real_runs"] == 2
    assert "mean_e2el_ms" in table.format() and table.speeds["host"]
    assert table.write(tmp_path / "runs").name == "errors.csv"


@pytest.mark.slow
def test_validate_times_the_reach_then_reuses_the_cached_profile(tmp_path: Path,
                                                                 tiny_model: Path,
                                                                 monkeypatch) -> None:
    from twinserve.fidelity import validate
    from twinserve.gpu.measurement import profiler
    grids: list[int] = []

    def recording(*a, **k):
        measured = measure(*a, **k)
        grids.append(len(measured.grid.steps))
        return measured
    measure = profiler.measure_backend
    monkeypatch.setattr(profiler, "measure_backend", recording)
    engine = _engine(tiny_model)
    workload = TraceSpec("synthetic", num_requests=3, input_len=16, output_len=4).load()
    settings = ValidateSettings(profile_cache=tmp_path / "cache",
                                calibration=CalibrationSettings(quick=True, repeats=1, threads=1))
    first = validate(engine, workload, tmp_path / "a", settings)
    assert first.profile_source.startswith("calibrated over batches up to 3, steps up to 48 ")
    full = profiler.default_grid(128, 8, 128, quick=True)
    assert grids and grids[0] < len(full)  # a part of the engine's space, not all of it
    second = validate(engine, workload, tmp_path / "b", settings)
    assert second.profile_source.startswith("cached") and len(grids) == 1  # nothing timed
    assert second.profile == tmp_path / "b" / "profile.json" and second.profile.is_file()
    assert second.table.row("request_throughput")["real_runs"] == 1
    wider = TraceSpec("synthetic", num_requests=5, input_len=16, output_len=4).load()
    third = validate(engine, wider, tmp_path / "c", settings)  # 5 sequences: not covered
    assert third.profile_source.startswith("calibrated over batches up to 5") and len(grids) == 2


def test_the_validate_command_builds_the_settings_its_flags_describe(tmp_path: Path,
                                                                    monkeypatch, capsys) -> None:
    """``twinserve validate`` is argument parsing over ``fidelity.validate``."""
    from twinserve.entrypoints.cli.main import main
    from twinserve.fidelity import validation as validate_module
    from twinserve.fidelity.comparison import ErrorTable
    from twinserve.fidelity.validation import ValidationResult
    seen = {}

    def fake(engine, workload, out, settings, log=None, weights_from=None, progress=None):
        seen.update(engine=engine, workload=workload, out=out, settings=settings)
        rows = ({"metric": "mean_ttft_ms", "real": 1.0, "sim": 1.1, "rel_error_pct": 10.0,
                 "target_pct": 10, "within_target": "true", "real_min": 1.0, "real_max": 1.0,
                 "real_runs": 1},)
        return ValidationResult(ErrorTable(rows, title="sim vs real (fair, ...)"), (), Path(out),
                                Path("p.json"), "cached (x)", "fair")
    monkeypatch.setattr(validate_module, "validate", fake)
    rc = main(["validate", "--trace", "synthetic", "--num-requests", "3", "--input-len", "16",
               "--output-len", "4", "--max-model-len", "128", "--policy", "fair",
               "--max-num-seqs", "8", "--real-repeats", "2", "--at-replay-speed", "--quick",
               "--threads", "1", "--profile-cache", str(tmp_path / "c"),
               "--out", str(tmp_path / "o"), "--quiet"])
    assert rc == 0
    engine, settings = seen["engine"], seen["settings"]
    assert (engine.scheduling_policy, engine.max_num_seqs, engine.max_model_len) == ("fair", 8, 128)
    assert engine.model  # the bundled model's directory where none is given
    assert len(seen["workload"].requests) == 3 and seen["workload"].desc["input_len"] == 16
    assert settings == ValidateSettings(None, (), 2, "replay", True, tmp_path / "c", False,
                                        CalibrationSettings(quick=True, threads=1))
    printed = capsys.readouterr().out
    assert "profile: cached (x)" in printed and "mean_ttft_ms" in printed
    main(["validate", "--trace", "synthetic", "--num-requests", "3", "--no-profile-cache",
          "--calibrate-full-space", "--out", str(tmp_path / "o"), "--quiet"])
    assert seen["settings"].profile_cache is None and seen["settings"].full_space
    assert seen["settings"].calibration.threads >= 1  # every core but one by default


def test_the_calibrate_command_builds_the_settings_its_flags_describe(tmp_path: Path,
                                                                     monkeypatch) -> None:
    from twinserve import fidelity
    from twinserve.entrypoints.cli.main import main
    from twinserve.fidelity.threads import measurement_threads
    seen = {}

    def fake(engine, out, settings, space=None, log=None):
        seen.update(engine=engine, out=out, settings=settings, space=space)
        raise SystemExit(0)  # (what is printed of a result is the command's own business)
    monkeypatch.setattr(fidelity, "calibrate", fake)
    with pytest.raises(SystemExit):
        main(["calibrate", "--max-num-seqs", "16", "--repeats", "2", "--no-engine-loop",
              "--base-hardware", "cpu", "--out", str(tmp_path / "p.json")])
    assert seen["engine"].max_num_seqs == 16 and seen["out"] == str(tmp_path / "p.json")
    assert seen["settings"] == CalibrationSettings(False, 1, 2, False, measurement_threads(),
                                                   "cpu", None)
    assert seen["space"] is None  # calibrate times the engine's whole space


@pytest.mark.slow
def test_run_study_on_the_tiny_model(tmp_path: Path, tiny_model: Path) -> None:
    """Two workloads, two rounds: one profile, each workload replayed per round on the
    calibration's weights, judged as calibrated and at the replays' speed."""
    from twinserve.fidelity.study import StudySettings, StudyWorkload, run_study
    trace = TraceSpec("synthetic", num_requests=3, input_len=16, output_len=4, max_model_len=64)
    workloads = [StudyWorkload("a", "fcfs", trace, {"scheduling_policy": "fcfs"}),
                 StudyWorkload("b", "fair", trace.replace(tenants="x=1,y=1"),
                               {"scheduling_policy": "fair"})]
    settings = StudySettings(rounds=2, calibration_model_len=64,
                             calibration=CalibrationSettings(quick=True, repeats=1, threads=1))
    rows = run_study(_engine(tiny_model), workloads, tmp_path, settings)
    for name in ("a", "b"):
        for round_ in (1, 2):
            config = json.loads((tmp_path / "real" / f"{name}-{round_}" / "real" /
                                 "config.json").read_text())
            assert config["scheduling_policy"] == ("fcfs" if name == "a" else "fair")
            assert config["max_model_len"] == 64
    by_key = {(r["workload"], r["metric"]): r for r in rows}
    assert by_key[("a", "mean_e2el_ms")]["real_runs"] == 2
    assert by_key[("b", "mean_ttft_ms")]["verdict_at_replay_speed"] in ("ok", "~", "MISS")
    assert (tmp_path / "profile.json").is_file() and (tmp_path / "fidelity_study.csv").is_file()
    with pytest.raises(ValueError, match="rounds"):
        StudySettings(rounds=0)
    with pytest.raises(ValueError, match="StudyWorkload.name"):
        StudyWorkload("a/b", "", trace)


def test_validate_flags_a_profile_calibrated_under_other_kernels(tmp_path: Path) -> None:
    from twinserve.core.kernel_settings import KernelSettings
    from twinserve.fidelity.validation import kernel_mismatch
    from twinserve.simulator.calibration import Calibration, save_profile
    from twinserve.simulator.hardware import FittedParams
    from twinserve.simulator.model_spec import load_model_spec
    name = load_model_spec("llama-3-8b").name
    cal = Calibration(FittedParams(1e-3, {"num_tokens": 1e-5}, name), [])
    torch_attention = KernelSettings(cpu_attention="torch")
    profile = save_profile(cal, "llama-3-8b", "cpu", tmp_path / "p.json",
                           kernel_settings=torch_attention)
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({"tensor_parallel_size": 1}))
    same = EngineArgs(model="llama-3-8b", cpu_attention="torch")
    assert kernel_mismatch(profile, same, real) is None
    other = EngineArgs(model="llama-3-8b")
    found = kernel_mismatch(profile, other, real)
    assert found is not None and "cpu_attention: profile 'torch', engine 'native'" in found
    bare = save_profile(cal, "llama-3-8b", "cpu", tmp_path / "bare.json")
    assert "records no kernel settings" in (kernel_mismatch(bare, other, real) or "")
