"""The kernel engine arguments from the command line to the kernels: the flags (and --config
keys) reach the model's choices, bad values are refused naming the flag, a real run folder's
config.json records them, and tensor-parallel workers receive them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from twinserve.core.engine_args import EngineArgs
from twinserve.core.kernel_settings import KernelSettings
from twinserve.entrypoints.cli.main import build_parser, parse_args
from twinserve.entrypoints.engine_args import engine_args_from
from twinserve.gpu.engine.llm_engine import LLMEngine

OFF = ["--cpu-attention", "torch", "--no-fused-decode", "--no-fused-packed",
       "--quant-activations", "fp32"]
OFF_SETTINGS = KernelSettings("torch", False, False, "fp32")
LIMITS = ["--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory-bytes", str(4 << 20)]


def _engine_args(model: Path, argv: list[str]) -> EngineArgs:
    args = parse_args(build_parser("generate"), ["generate", "--model", str(model), *argv])
    return engine_args_from(args, model=str(model))


def test_flags_reach_the_kernel_choices(tiny_model_dirs: dict[str, Path]) -> None:
    from twinserve.gpu.quantization.quant_linear import QuantizedLinearMethod
    model = tiny_model_dirs["llama-tied"]
    engine = LLMEngine(_engine_args(model, [*OFF, *LIMITS, "--quantization", "int8"]))
    runner = engine.runner
    assert runner.kernels == OFF_SETTINGS and runner.model.kernels == OFF_SETTINGS
    assert runner.model.backend.decode_kernel is None  # --cpu-attention torch
    methods = [m.quant_method for m in runner.model.modules()
               if isinstance(getattr(m, "quant_method", None), QuantizedLinearMethod)]
    assert methods and not any(m.int8_activations for m in methods)  # --quant-activations fp32
    default = LLMEngine(_engine_args(model, [*LIMITS, "--quantization", "int8"])).runner
    assert default.kernels == KernelSettings()
    assert default.model.backend.decode_kernel is not None
    assert all(m.quant_method.int8_activations for m in default.model.modules()
               if isinstance(getattr(m, "quant_method", None), QuantizedLinearMethod))


def test_config_file_keys_set_the_kernels_and_flags_override_them(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_attention: torch\nfused-decode: false\nquant_activations: fp32\n")
    args = _engine_args(tmp_path, ["--config", str(config), "--quant-activations", "int8"])
    assert args.kernel_settings() == KernelSettings("torch", False, True, "int8")


@pytest.mark.parametrize(("flag", "value"), [("--cpu-attention", "fast"),
                                             ("--quant-activations", "int4")])
def test_a_bad_value_is_refused_naming_the_flag(flag: str, value: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _engine_args(tmp_path, [flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: invalid choice: '{value}'" in capsys.readouterr().err


def test_a_bad_config_value_is_refused_naming_the_key_and_file(tmp_path: Path) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text("cpu_attention: fast\n")
    with pytest.raises(ValueError, match=r"engine.yaml: key 'cpu_attention' must be one of "
                                         r"native, torch, got 'fast'"):
        _engine_args(tmp_path, ["--config", str(config)])
    config.write_text("fused_decode: 0\n")
    with pytest.raises(ValueError, match="key 'fused_decode' must be true or false, got 0"):
        _engine_args(tmp_path, ["--config", str(config)])


def test_a_real_run_folder_records_the_settings(tiny_model_dirs: dict[str, Path],
                                                tmp_path: Path) -> None:
    from twinserve.gpu.engine.replay import replay_real, write_real_run
    from twinserve.simulator.calibration import runs_kernel_settings
    from twinserve.traces import TraceRequest
    model = tiny_model_dirs["llama-tied"]
    engine = LLMEngine(_engine_args(model, [*OFF, *LIMITS]))
    trace = [TraceRequest("r0", 0.0, 8, 3), TraceRequest("r1", 0.01, 5, 2)]
    replay = replay_real(engine, trace, progress=False, detokenize=False)
    out = write_real_run(replay, engine, tmp_path / "run", {"trace": "tiny"}, str(model))
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in KernelSettings.field_names()} == OFF_SETTINGS.to_dict()
    assert runs_kernel_settings([out]) == OFF_SETTINGS  # what calibrate --from-run records


def test_tensor_parallel_workers_receive_the_settings(tiny_model_dirs: dict[str, Path],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's ShardSpec carries them, and a worker builds its shard with them."""
    from twinserve.gpu.distributed.parallel_state import GroupAddress
    from twinserve.gpu.executor import tp_driver
    from twinserve.gpu.executor.shard_worker import ShardSpec, ShardWorker
    model = tiny_model_dirs["llama-tied"]
    specs: list[ShardSpec] = []

    class Stop(Exception):
        pass

    def capture(backend: str, spec: ShardSpec) -> None:
        specs.append(spec)
        raise Stop
    monkeypatch.setattr(tp_driver, "make_executor", capture)
    args = EngineArgs(model=str(model), tensor_parallel_size=2, cpu_attention="torch")
    threads = torch.get_num_threads()  # (the driver splits the cores between the ranks)
    try:
        with pytest.raises(Stop):
            tp_driver.TPDriver(args, str(model), "float32", torch.device("cpu"), 64)
    finally:
        torch.set_num_threads(threads)
    assert specs[0].kernels == args.kernel_settings()
    alone = ShardSpec(str(model), "float32", "cpu", 64, 16, GroupAddress("127.0.0.1", 0, 1, "gloo"),
                      1, kernels=specs[0].kernels)  # a group of one: no peer to wait for
    worker = ShardWorker(alone, 0)
    try:
        assert worker.model.kernels == specs[0].kernels
        assert worker.model.backend.decode_kernel is None
    finally:
        worker.close()
