"""Loading the real backend a calibration or a replay measures, and what it tells of itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner

Log = Callable[[str], None]


def model_dir_or_default(model: str | None) -> str:
    """``model``, or the bundled model's directory when it is ``None`` or empty."""
    if model:
        return model
    from twinserve.gpu.models.default_model import default_model_path
    return str(default_model_path())


def with_model(engine: EngineArgs) -> EngineArgs:
    """``engine`` naming its model (the bundled one where it names none)."""
    return engine if engine.model else engine.replace(model=model_dir_or_default(None))


def load_runner(engine: EngineArgs, weights_from: ModelRunner | None = None) -> ModelRunner:
    """A loaded ``ModelRunner`` for ``engine``, resolved as a server's (calibration and
    validate measure the engine a server runs); with ``weights_from``, on that runner's
    weights."""
    from twinserve.gpu.worker.model_runner import ModelRunner
    return ModelRunner(with_model(engine), usage_context="server", weights_from=weights_from)


def measure_interconnect(runner: ModelRunner, engine_args: EngineArgs,
                         log: Log | None = None) -> tuple[float, float] | None:
    """With tensor parallelism: the all-reduce timed on this backend at the runner's ranks and
    hidden size, fitted to the profile's (interconnect_bandwidth, interconnect_latency_s)."""
    tp = engine_args.tensor_parallel_size
    if tp < 2 or runner.device.type != "cpu":  # (NCCL across GPUs: not measured here)
        return None
    from twinserve.gpu.distributed.allreduce_benchmark import fit_interconnect, measure_all_reduce
    samples = measure_all_reduce(tp, runner.config.hidden_size, dtype=runner.dtype)
    fit = fit_interconnect(samples)
    if log is not None:
        log(f"all-reduce on {tp} ranks ({len(samples)} sizes): bus bandwidth "
            f"{fit.bandwidth / 1e9:.2f} GB/s, latency {fit.latency_s * 1e6:.0f} us "
            f"(max error {fit.max_relative_error:.0%})")
    return fit.bandwidth, fit.latency_s


def base_hardware_for(device: str | None) -> str:
    """The bundled profile a calibration on ``device`` keeps the roofline numbers of: ``cpu``, or
    on CUDA the profile of the GPU's name (ValueError when none matches: pass base_hardware)."""
    from twinserve.gpu.worker.platform import current_platform
    from twinserve.simulator.hardware import bundled_profile_for_device
    platform = current_platform(device or "auto")
    if platform.device_type == "cpu":
        return "cpu"
    name = bundled_profile_for_device(platform.device_name)
    if name is None:
        raise ValueError(f"no bundled profile matches the GPU {platform.device_name!r}: pass "
                         "--base-hardware (a bundled name or a profile file) for its peaks.")
    return name
