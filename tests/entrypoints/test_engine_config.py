"""One engine configuration for both halves: EngineArgs, its resolution per device and usage
context, --config YAML files, and the twin of this machine resolving what the real engine does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from twinserve.core.config import SchedulerConfig
from twinserve.core.engine_args import NOT_IMPLEMENTED, EngineArgs
from twinserve.core.engine_config import GIB, Platform, default_batch_limits, resolve_engine_config
from twinserve.simulator import SimConfig
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.run import build_engine_config

H100 = Platform("cuda", "NVIDIA H100 80GB HBM3", 80 * GIB)
A100 = Platform("cuda", "NVIDIA A100-SXM4-80GB", 80 * GIB)
L4 = Platform("cuda", "NVIDIA L4", 24 * GIB)
CPU = Platform("cpu", "cpu", 20 * GIB, native_bf16=False)


# ---- vLLM's defaults per device and usage context -------------------------------------------
@pytest.mark.parametrize("platform, context, expected", [
    (CPU, "llm", (4096, 256)), (CPU, "server", (2048, 128)),
    (H100, "llm", (16384, 1024)), (H100, "server", (8192, 1024)),
    (A100, "llm", (8192, 256)), (A100, "server", (2048, 256)), (L4, "server", (2048, 256)),
])
def test_batch_defaults_follow_vllm(platform: Platform, context: str, expected) -> None:
    assert default_batch_limits(platform, context) == expected


def test_cpu_defaults_scale_with_tensor_parallel_size() -> None:
    assert default_batch_limits(CPU, "server", world_size=2) == (4096, 256)


def test_dtype_auto_follows_the_device() -> None:
    spec = load_model_spec("llama-3-8b")
    assert resolve_engine_config(EngineArgs(), spec, H100).dtype == "bfloat16"
    assert resolve_engine_config(EngineArgs(), spec, CPU).dtype == "float32"
    native = dataclasses.replace(CPU, native_bf16=True)
    assert resolve_engine_config(EngineArgs(), spec, native).dtype == "bfloat16"
    assert resolve_engine_config(EngineArgs(dtype="float16"), spec, CPU).dtype == "float16"
    # quantized weights on a CPU: float32 (their products and the fused decode step), unless told
    for method in ("gguf", "int8", "gptq"):
        assert resolve_engine_config(EngineArgs(quantization=method), spec, native).dtype == "float32"
        assert resolve_engine_config(EngineArgs(quantization=method), spec, H100).dtype == "bfloat16"
    assert resolve_engine_config(EngineArgs(quantization="int8", dtype="bfloat16"), spec,
                                 native).dtype == "bfloat16"


def test_a_gguf_file_runs_in_float32_on_a_cpu_with_native_bf16(monkeypatch, tmp_path) -> None:
    # the method is found in the file (no quantization= given), and the fused step serves it
    from gguf_helpers import write_tiny_gguf

    import twinserve.gpu.worker.model_runner as model_runner
    from twinserve import LLM
    native = dataclasses.replace(model_runner.current_platform("cpu"), native_bf16=True)
    monkeypatch.setattr(model_runner, "current_platform", lambda device: native)
    monkeypatch.setenv("TWINSERVE_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(write_tiny_gguf(tmp_path / "tiny.gguf")), max_model_len=64,
              kv_cache_memory_bytes=4 << 20)
    assert llm.engine.runner.dtype == torch.float32 and llm.engine.runner.quantization == "gguf"


def test_kv_blocks_from_memory() -> None:
    spec = load_model_spec("llama-3-8b")  # 32 layers x 8 KV heads x 128: 128 KiB a token in bf16
    cpu = resolve_engine_config(EngineArgs(dtype="bfloat16"), spec, CPU)
    assert cpu.block_bytes == 16 * 128 * 1024 and cpu.kv_cache_bytes == 2 * GIB
    assert cpu.scheduler.num_gpu_blocks == 2 * GIB // cpu.block_bytes
    assert cpu.scheduler.num_cpu_blocks == 4 * GIB // cpu.block_bytes  # swap_space 4 GiB
    gpu = resolve_engine_config(EngineArgs(), spec, H100, "server", non_kv_bytes=20 * GIB)
    assert gpu.scheduler.num_gpu_blocks == int(80 * GIB * 0.9 - 20 * GIB) // gpu.block_bytes
    pinned = resolve_engine_config(EngineArgs(num_gpu_blocks_override=7), spec, H100)
    assert pinned.scheduler.num_gpu_blocks == 7
    with pytest.raises(ValueError, match="no memory is left for the KV cache"):
        resolve_engine_config(EngineArgs(), spec, L4, non_kv_bytes=30 * GIB)


def test_max_model_len_above_the_model_is_refused_as_vllm_words_it() -> None:
    spec = load_model_spec("llama-3-8b")
    assert resolve_engine_config(EngineArgs(), spec, H100).max_model_len == 8192
    assert resolve_engine_config(EngineArgs(max_model_len=1000), spec, H100).max_model_len == 1000
    with pytest.raises(ValueError, match=r"User-specified max_model_len \(100000\) is greater "
                                         r"than the derived max_model_len"):
        resolve_engine_config(EngineArgs(max_model_len=100000), spec, H100)


# ---- EngineArgs validation ------------------------------------------------------------------
@pytest.mark.parametrize("field, value, match", [
    ("max_num_seqs", 0, "max_num_seqs must be a positive"),
    ("max_num_seqs", "8", "max_num_seqs must be an integer"),
    ("enable_prefix_caching", "yes", "enable_prefix_caching must be a boolean"),
    ("dtype", "fp64", "dtype must be one of"),
    ("preemption_mode", "drop", "preemption_mode must be one of"),
    ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in"),
    ("swap_space", -1, "swap_space must be >= 0"),
    ("block_size", True, "block_size must be an integer"),
])
def test_bad_engine_arguments_name_the_field(field: str, value, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{field: value})


def test_unknown_and_unimplemented_arguments_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seq'"):
        EngineArgs.from_mapping({"max_num_seq": 8}, "engine.yaml")
    for name in ("cpu_offload_gb", "trust_remote_code"):
        value = {"cpu_offload_gb": 2, "trust_remote_code": True}[name]
        with pytest.raises(ValueError, match=f"engine argument '{name}' is not implemented"):
            EngineArgs.from_mapping({name: value}, "engine.yaml")
    # vLLM's "not used" values are accepted: nothing is asked that twinserve lacks
    assert EngineArgs.from_mapping({"cpu_offload_gb": 0, "quantization": None}) \
        == EngineArgs()
    with pytest.raises(ValueError, match="max_loras is set but enable_lora is not"):
        EngineArgs.from_mapping({"max_loras": 4}, "engine.yaml")
    assert set(NOT_IMPLEMENTED).isdisjoint(EngineArgs.field_names())


def test_from_mapping_takes_dashes_and_names_the_source() -> None:
    args = EngineArgs.from_mapping({"max-num-seqs": 8, "enable-prefix-caching": False}, "f.yaml")
    assert args.max_num_seqs == 8 and args.enable_prefix_caching is False
    with pytest.raises(ValueError, match="^f.yaml: max_num_seqs must be an integer"):
        EngineArgs.from_mapping({"max-num-seqs": 8.5}, "f.yaml")


# ---- the twin of this machine resolves what the real engine resolves --------------------------
def _this_machine_profile(tmp_path: Path) -> Path:
    """A profile of this machine as ``calibrate`` writes it: the bundled cpu profile, a fit,
    and the measured device's type and bf16 support."""
    from twinserve.gpu.worker.platform import current_platform
    from twinserve.simulator.calibration import Calibration, save_profile
    from twinserve.simulator.hardware import FittedParams
    cal = Calibration(FittedParams(0.01, {}, model="tiny"))
    return save_profile(cal, "smollm2-135m", "cpu", tmp_path / "this-machine.json",
                        platform=current_platform("cpu"))


def test_a_calibrated_profile_records_the_measured_device(tmp_path: Path) -> None:
    from twinserve.gpu.kernels.cpu_gemm import cpu_has_native_bf16
    profile = load_hardware(_this_machine_profile(tmp_path))
    assert (profile.device_type, profile.native_bf16) == ("cpu", cpu_has_native_bf16())
    assert profile.platform().device_type == "cpu"


def _real_and_twin(model: Path, profile: Path, **engine) -> tuple:
    from twinserve.gpu.worker.model_runner import ModelRunner
    args = EngineArgs(model=str(model), **engine)
    real = ModelRunner(args, usage_context="server").engine_config
    twin = build_engine_config(SimConfig(args, hardware=str(profile))).engine_config
    return real, twin


def _resolved(config) -> dict:
    return {**dataclasses.asdict(config.scheduler), "dtype": config.dtype,
            "block_bytes": config.block_bytes, "kv_cache_bytes": config.kv_cache_bytes,
            "usage_context": config.usage_context, "device_type": config.device_type}


@pytest.mark.parametrize("engine", [
    {},  # every default: 2 GiB of KV, swap_space 4 GiB, vLLM's CPU server limits
    {"kv_cache_memory_bytes": 3 << 20, "max_num_seqs": 8, "block_size": 8, "swap_space": 0.01,
     "max_model_len": 256, "enable_chunked_prefill": False, "preemption_mode": "swap"},
])
def test_twin_of_this_machine_resolves_the_real_engines_configuration(
        tiny_model_dirs, tmp_path: Path, engine: dict) -> None:
    real, twin = _real_and_twin(tiny_model_dirs["llama-tied"], _this_machine_profile(tmp_path),
                                **engine)
    assert _resolved(twin) == _resolved(real)
    for name in SchedulerConfig.field_names():  # field by field, for the failure message
        assert getattr(twin.scheduler, name) == getattr(real.scheduler, name), name


def test_bundled_cpu_profile_describes_this_kind_of_machine(tiny_model_dirs) -> None:
    from twinserve.gpu.kernels.cpu_gemm import cpu_has_native_bf16
    if cpu_has_native_bf16():
        pytest.skip("the bundled cpu profile describes the AVX2-only machines")
    real, twin = _real_and_twin(tiny_model_dirs["llama-tied"], Path("cpu"),
                                kv_cache_memory_bytes=1 << 20, swap_space=0.001)
    assert _resolved(twin) == _resolved(real)


def test_twin_refuses_a_device_its_profile_is_not() -> None:
    with pytest.raises(ValueError, match="does not match the hardware profile"):
        build_engine_config(SimConfig(hardware="cpu", device="cuda", model="smollm2-135m"))


# ---- --config FILE.yaml ---------------------------------------------------------------------
def _parse(argv: list[str]):
    from twinserve.entrypoints.cli.main import build_parser, parse_args
    return parse_args(build_parser(), argv)


def _write(tmp_path: Path, data: dict, name: str = "engine.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_config_file_sets_engine_arguments_and_flags_override_it(tmp_path: Path) -> None:
    from twinserve.entrypoints.engine_args import engine_args_from
    cfg = _write(tmp_path, {"max-num-seqs": 32, "enable_prefix_caching": False,
                            "scheduling-policy": "fair", "swap_space": 2, "block_size": 8})
    for command in ("simulate", "generate", "chat", "validate", "calibrate", "serve"):
        extra = ["--out", str(tmp_path / "x")] if command in ("validate", "calibrate") else []
        args = _parse([command, "--config", str(cfg), "--max-num-seqs", "4", *extra])
        engine = engine_args_from(args)
        assert engine.max_num_seqs == 4, command  # the flag wins
        assert (engine.enable_prefix_caching, engine.scheduling_policy, engine.swap_space,
                engine.block_size) == (False, "fair", 2.0, 8), command


def test_config_file_keys_are_the_llm_api_keys(tmp_path: Path) -> None:
    cfg = _write(tmp_path, {"max_num_seqs": 32, "enable_prefix_caching": False})
    keys = yaml.safe_load(cfg.read_text())
    assert EngineArgs.from_mapping(keys, str(cfg)) == EngineArgs(max_num_seqs=32,
                                                                 enable_prefix_caching=False)


@pytest.mark.parametrize("data, match", [
    ({"max-num-seq": 8}, "unknown key 'max-num-seq' for this command"),
    ({"max_num_seqs": "many"}, "key 'max_num_seqs' must be an integer"),
    ({"enable-prefix-caching": "yes"}, "key 'enable-prefix-caching' must be true or false"),
    ({"quantization": "bitsandbytes"}, "quantization 'bitsandbytes' is not supported by "
                                       "twinserve; supported: gguf, int8, fp8, gptq, awq"),
    ({"swap_space": [1]}, "key 'swap_space' must be a number"),
])
def test_bad_config_files_name_the_key_and_the_file(tmp_path: Path, data: dict, match: str,
                                                    capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    cfg = _write(tmp_path, data)
    assert main(["simulate", "--config", str(cfg), "--num-requests", "2"]) == 2
    err = capsys.readouterr().err
    assert match in err and str(cfg) in err


def test_a_file_that_is_not_a_mapping_is_refused(tmp_path: Path, capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    cfg = tmp_path / "list.yaml"
    cfg.write_text("- 1\n- 2\n")
    assert main(["simulate", "--config", str(cfg)]) == 2
    assert "must hold a mapping" in capsys.readouterr().err


def test_unimplemented_flags_are_refused_by_name(capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    assert main(["simulate", "--cpu-offload-gb", "2", "--num-requests", "2"]) == 2
    assert "'cpu_offload_gb' is not implemented" in capsys.readouterr().err
    assert main(["simulate", "--speculative-config", "x", "--num-requests", "2"]) == 2
    assert "speculative_config is not valid JSON" in capsys.readouterr().err
    assert main(["simulate", "--speculative-config", '{"method": "eagle"}',
                 "--num-requests", "2"]) == 2
    assert "'eagle' is not implemented in twinserve" in capsys.readouterr().err
    assert main(["simulate", "--quantization", "bitsandbytes", "--num-requests", "2"]) == 2
    assert "supported: gguf, int8, fp8, gptq, awq" in capsys.readouterr().err


def test_llm_refuses_unimplemented_and_too_long(tiny_model_dirs) -> None:
    from twinserve.entrypoints.llm import LLM
    model = str(tiny_model_dirs["llama-tied"])
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported"):
        LLM(model, kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="quantization='gptq' needs a checkpoint whose "
                                         "config.json has a quantization_config"):
        LLM(model, quantization="gptq")
    with pytest.raises(ValueError, match=r"User-specified max_model_len \(100000\)"):
        LLM(model, max_model_len=100000, kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seq'"):
        LLM(model, max_num_seq=4)


@pytest.mark.slow
def test_same_yaml_through_simulate_and_validate_gives_the_same_scheduler(
        tiny_model_dirs, tmp_path: Path) -> None:
    from twinserve.entrypoints.cli.main import main
    model = str(tiny_model_dirs["llama-tied"])
    cfg = _write(tmp_path, {"max-num-seqs": 8, "max-num-batched-tokens": 128, "block-size": 8,
                            "kv-cache-memory-bytes": 4 << 20, "swap-space": 0.01,
                            "dtype": "float32", "scheduling-policy": "fair",
                            "max-model-len": 256})
    workload = ["--trace", "synthetic", "--num-requests", "6", "--request-rate", "50",
                "--input-len", "24", "--output-len", "4"]
    profile = _this_machine_profile(tmp_path)
    assert main(["simulate", "--config", str(cfg), "--model", model, "--hardware", str(profile),
                 *workload, "--out", str(tmp_path / "sim"), "--disable-tqdm"]) == 0
    assert main(["validate", "--config", str(cfg), "--model", model, "--profile", str(profile),
                 *workload, "--out", str(tmp_path / "val"), "--quiet"]) == 0
    sim = json.loads((tmp_path / "sim" / "config.json").read_text())
    for run in ("real", "sim"):
        other = json.loads((tmp_path / "val" / run / "config.json").read_text())
        for key in (*SchedulerConfig.field_names(), "dtype", "usage_context", "block_bytes"):
            assert sim[key] == other[key], (run, key)
    assert sim["max_num_seqs"] == 8 and sim["scheduling_policy"] == "fair"


@pytest.mark.parametrize("flags, match", [
    (["--quantization", "awq"], "needs a checkpoint whose config.json has a quantization_config"),
    (["--kv-cache-dtype", "fp8_e5m2"], "kv_cache_dtype 'fp8_e5m2' is not supported"),
    (["--max-model-len", "100000"], "User-specified max_model_len (100000)"),
])
def test_serve_refuses_what_it_cannot_honour_before_it_listens(tiny_model_dirs, flags, match,
                                                               capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    rc = main(["serve", "--model", str(tiny_model_dirs["llama-tied"]), "--port", "1",
               "--kv-cache-memory-bytes", str(1 << 20), *flags])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_a_sliding_window_serves_the_whole_length_and_bounds_the_kv() -> None:
    spec = load_model_spec("mistral-7b-v0.1")  # sliding_window 4096, 32768 positions
    config = resolve_engine_config(EngineArgs(), spec, H100)
    assert config.max_model_len == 32768 and config.scheduler.sliding_window == 4096
    assert resolve_engine_config(EngineArgs(max_model_len=8192), spec, H100).max_model_len == 8192
    llama = resolve_engine_config(EngineArgs(), load_model_spec("llama-3.1-8b"), H100)
    assert llama.scheduler.sliding_window is None


def test_disable_sliding_window_caps_the_length_to_the_window_as_vllm() -> None:
    spec = load_model_spec("mistral-7b-v0.1")
    config = resolve_engine_config(EngineArgs(disable_sliding_window=True), spec, H100)
    assert config.max_model_len == 4096 and config.scheduler.sliding_window is None
    with pytest.raises(ValueError, match=r"max_model_len=8192 exceeds the sliding window \(4096\)"):
        resolve_engine_config(EngineArgs(disable_sliding_window=True, max_model_len=8192), spec,
                              H100)
    llama = load_model_spec("llama-3.1-8b")  # no window: nothing changes
    assert resolve_engine_config(EngineArgs(disable_sliding_window=True), llama,
                                 H100).max_model_len == 131072
