"""Request workloads: the bundled public traces, trace files, synthetic workloads and their transforms.

Names are imported on first use (PEP 562), so that adding the workload flags to a parser
(``add_trace_args``) does not load numpy: a simulator command's ``--help`` starts fast."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_SOURCES = {
    "add_lora_args": "cli_flags", "add_trace_args": "cli_flags",
    "lora_adapters_from_args": "cli_args", "trace_desc": "cli_args", "trace_from_args": "cli_args",
    "TraceError": "errors",
    "BUNDLED_TRACES": "bundled", "load_trace": "loaders",
    "AdapterShape": "lora", "LoRAAdapters": "lora", "adapter_names": "lora", "assign_loras": "lora",
    "SyntheticConfig": "synthetic", "synthetic_trace": "synthetic",
    "LOWEST_TOKEN_ID": "trace_request", "TraceRequest": "trace_request",
    "assign_priorities": "transforms", "assign_tenants": "transforms",
    "clip_lengths": "transforms", "first_n": "transforms", "repeat": "transforms",
    "scale_time": "transforms", "time_window": "transforms",
}
__all__ = [
    "AdapterShape", "BUNDLED_TRACES", "LOWEST_TOKEN_ID", "LoRAAdapters", "SyntheticConfig",
    "TraceError", "TraceRequest", "adapter_names", "add_lora_args", "add_trace_args",
    "assign_loras", "assign_priorities", "assign_tenants", "clip_lengths", "first_n",
    "load_trace", "lora_adapters_from_args", "repeat", "scale_time", "synthetic_trace",
    "time_window", "trace_desc", "trace_from_args",
]


def __getattr__(name: str) -> Any:
    module = _SOURCES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_SOURCES})


if TYPE_CHECKING:  # the names for type checkers and IDEs
    from twinserve.traces.bundled import BUNDLED_TRACES
    from twinserve.traces.cli_args import lora_adapters_from_args, trace_desc, trace_from_args
    from twinserve.traces.cli_flags import add_lora_args, add_trace_args
    from twinserve.traces.errors import TraceError
    from twinserve.traces.loaders import load_trace
    from twinserve.traces.lora import AdapterShape, LoRAAdapters, adapter_names, assign_loras
    from twinserve.traces.synthetic import SyntheticConfig, synthetic_trace
    from twinserve.traces.trace_request import LOWEST_TOKEN_ID, TraceRequest
    from twinserve.traces.transforms import (
        assign_priorities,
        assign_tenants,
        clip_lengths,
        first_n,
        repeat,
        scale_time,
        time_window,
    )
