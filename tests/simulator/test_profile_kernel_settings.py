"""A calibrated profile records the kernel settings its steps ran (simulator/hardware.py's
``FittedParams.kernel_settings``, written by ``save_profile``), and ``--from-run`` fits take them
from the runs' config.json (``runs_kernel_settings``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinserve.core.kernel_settings import KernelSettings, kernel_settings_mismatch
from twinserve.simulator.calibration import Calibration, runs_kernel_settings, save_profile
from twinserve.simulator.hardware import FittedParams, load_hardware

TORCH_FP32 = KernelSettings(cpu_attention="torch", quant_activations="fp32")


def test_fitted_params_round_trip_their_kernel_settings() -> None:
    fit = FittedParams(1e-3, {"num_tokens": 1e-5}, "m", kernel_settings=TORCH_FP32.to_dict())
    again = FittedParams.from_dict(fit.to_dict())
    assert again.kernel_settings == TORCH_FP32.to_dict()
    assert "kernel_settings" not in FittedParams(1e-3, {}).to_dict()  # none recorded: none written
    with pytest.raises(ValueError, match="cpu_attention must be one of native, torch"):
        FittedParams(1e-3, {}, kernel_settings={**TORCH_FP32.to_dict(), "cpu_attention": "x"})


def test_save_profile_records_the_settings_and_validate_can_compare_them(tmp_path: Path) -> None:
    cal = Calibration(FittedParams(1e-3, {"num_tokens": 1e-5}, "m"), [])
    path = save_profile(cal, "llama-3-8b", "cpu", tmp_path / "p.json", kernel_settings=TORCH_FP32)
    fit = load_hardware(path).find_fitted("m")
    assert fit is not None and fit.kernel_settings == TORCH_FP32.to_dict()
    assert json.loads(path.read_text())["fitted"][0]["kernel_settings"]["cpu_attention"] == "torch"
    assert kernel_settings_mismatch(fit.to_dict(), TORCH_FP32) is None
    assert "cpu_attention: profile 'torch', engine 'native'" in (
        kernel_settings_mismatch(fit.to_dict(), KernelSettings()) or "")
    assert cal.params.kernel_settings == {}  # the caller's calibration is left as it was


def _run(folder: Path, **config: object) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"backend": "twinserve", **config}))
    return folder


def test_runs_kernel_settings_agree_or_are_refused(tmp_path: Path) -> None:
    a = _run(tmp_path / "a", **TORCH_FP32.to_dict())
    b = _run(tmp_path / "b", **TORCH_FP32.to_dict())
    assert runs_kernel_settings([a, b]) == TORCH_FP32
    old = _run(tmp_path / "old", scheduling_policy="fcfs")  # written before the settings were
    assert runs_kernel_settings([a, old]) is None
    c = _run(tmp_path / "c", **KernelSettings().to_dict())
    with pytest.raises(ValueError, match="the runs ran different kernel settings"):
        runs_kernel_settings([a, c])


def test_simulate_says_when_the_fit_ran_other_kernels(tmp_path: Path, capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    from twinserve.simulator.model_spec import load_model_spec
    cal = Calibration(FittedParams(1e-3, {"num_tokens": 1e-5},
                                   load_model_spec("llama-3-8b").name), [])
    profile = save_profile(cal, "llama-3-8b", "h100-sxm", tmp_path / "p.json",
                           kernel_settings=TORCH_FP32)
    base = ["simulate", "--num-requests", "3", "--hardware", str(profile), "--model", "llama-3-8b"]
    assert main([*base, "--out", str(tmp_path / "a")]) == 0
    err = capsys.readouterr().err
    assert "the profile's fit does not match this run" in err and "cpu_attention: profile 'torch'" in err
    assert main([*base, "--cpu-attention", "torch", "--quant-activations", "fp32",
                 "--out", str(tmp_path / "b")]) == 0
    assert "does not match" not in capsys.readouterr().err
    assert main(["simulate", "--num-requests", "3", "--out", str(tmp_path / "c")]) == 0
    assert "does not match" not in capsys.readouterr().err  # the bundled fits record none


SPACE = {"max_num_seqs": 40, "max_num_batched_tokens": 2048, "max_model_len": 128}


def test_a_fit_names_the_limits_past_its_measured_steps() -> None:
    fit = FittedParams(1e-3, {}, "m", step_space=SPACE)
    assert FittedParams.from_dict(fit.to_dict()).step_space == SPACE
    assert "step_space" not in FittedParams(1e-3, {}).to_dict()
    assert fit.beyond(SPACE) == "" and FittedParams(1e-3, {}).beyond({**SPACE, "max_model_len": 9999}) == ""
    longer = fit.beyond({**SPACE, "max_model_len": 512})
    assert "max_model_len 512 (fitted up to 128)" in longer and "max_num_seqs" not in longer
    rows = fit.beyond({**SPACE, "max_num_seqs": 16}, speculative_tokens=4)
    assert "with verification rows: max_num_seqs 80 (fitted up to 40)" in rows
    assert fit.beyond({**SPACE, "max_num_seqs": 8}, speculative_tokens=4) == ""
    with pytest.raises(ValueError, match="step_space must map"):
        FittedParams(1e-3, {}, step_space={"max_num_seqs": 0, "max_num_batched_tokens": 1,
                                           "max_model_len": 1})


def test_simulate_and_validate_say_when_the_run_reaches_past_the_fit(tmp_path: Path, capsys) -> None:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.entrypoints.cli.main import main
    from twinserve.fidelity.validation import kernel_mismatch
    from twinserve.simulator.model_spec import load_model_spec
    cal = Calibration(FittedParams(1e-3, {"num_tokens": 1e-5},
                                   load_model_spec("llama-3-8b").name), [])
    profile = save_profile(cal, "llama-3-8b", "h100-sxm", tmp_path / "p.json",
                           kernel_settings=KernelSettings(), step_space=SPACE)
    base = ["simulate", "--num-requests", "3", "--hardware", str(profile), "--model", "llama-3-8b",
            "--max-num-seqs", "40", "--max-num-batched-tokens", "2048"]
    assert main([*base, "--max-model-len", "128", "--out", str(tmp_path / "a")]) == 0
    assert "does not match" not in capsys.readouterr().err
    assert main([*base, "--max-model-len", "512", "--out", str(tmp_path / "b")]) == 0
    assert "max_model_len 512 (fitted up to 128)" in capsys.readouterr().err
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps({**SPACE, "max_model_len": 512}))
    found = kernel_mismatch(profile, EngineArgs(model="llama-3-8b"), real)
    assert found is not None and "max_model_len 512 (fitted up to 128)" in found


def test_only_the_steps_a_trace_can_reach_are_named(tmp_path: Path, capsys) -> None:
    """A fit measured on a workload's reach (``reachable_space``) is not flagged for engine
    limits that workload cannot fill: 3 requests never batch 40 sequences."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.entrypoints.cli.main import main
    from twinserve.fidelity.validation import kernel_mismatch
    from twinserve.simulator.model_spec import load_model_spec
    from twinserve.traces import TraceRequest
    cal = Calibration(FittedParams(1e-3, {"num_tokens": 1e-5},
                                   load_model_spec("llama-3-8b").name), [])
    small = {"max_num_seqs": 3, "max_num_batched_tokens": 64, "max_model_len": 128}
    profile = save_profile(cal, "llama-3-8b", "h100-sxm", tmp_path / "p.json",
                           kernel_settings=KernelSettings(), step_space=small)
    assert main(["simulate", "--num-requests", "3", "--hardware", str(profile), "--model",
                 "llama-3-8b", "--trace", "synthetic", "--input-len", "16", "--output-len", "8",
                 "--out", str(tmp_path / "a")]) == 0
    assert "does not match" not in capsys.readouterr().err
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(SPACE))
    requests = [TraceRequest(f"r{i}", 0.0, 16, 8) for i in range(3)]
    assert kernel_mismatch(profile, EngineArgs(model="llama-3-8b"), real, requests) is None
    assert "max_num_seqs 40 (fitted up to 3)" in (
        kernel_mismatch(profile, EngineArgs(model="llama-3-8b"), real) or "")
