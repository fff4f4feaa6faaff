"""This machine's device, described for the shared engine configuration (``core.engine_config``)."""

from __future__ import annotations

import torch

from twinserve.core.engine_config import Platform
from twinserve.gpu.kernels.cpu_gemm import cpu_has_native_bf16
from twinserve.gpu.worker.kv_cache import host_memory_available

# ``core.engine_config.resolve_dtype``'s names as torch dtypes.
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """``auto``: the CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA (a CPU build)"
        raise ValueError(f"device {device!r}: no CUDA device is available here (torch "
                         f"{torch.__version__} built {built}); use --device cpu or auto.")
    return torch.device(device)


def current_platform(device: str | torch.device) -> Platform:
    """The CUDA device's name and total memory, or the CPU with the host memory available now."""
    device = resolve_device(device) if isinstance(device, str) else device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Platform("cuda", props.name, int(props.total_memory), True)
    if device.type != "cpu":
        raise ValueError(f"device must be cpu or cuda, got {device.type!r}.")
    return Platform("cpu", "cpu", host_memory_available(), cpu_has_native_bf16())
