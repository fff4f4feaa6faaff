"""Request workloads: the bundled public traces, trace files, synthetic workloads and their transforms."""

from twinserve.traces.cli_args import (
                                       add_lora_args,
                                       add_trace_args,
                                       lora_adapters_from_args,
                                       trace_desc,
                                       trace_from_args,
)
from twinserve.traces.errors import TraceError
from twinserve.traces.loaders import BUNDLED_TRACES, load_trace
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

__all__ = [
    "BUNDLED_TRACES", "LOWEST_TOKEN_ID", "AdapterShape", "LoRAAdapters", "SyntheticConfig",
    "TraceError", "TraceRequest", "adapter_names", "add_lora_args", "add_trace_args",
    "assign_loras", "assign_priorities", "assign_tenants", "clip_lengths", "first_n", "load_trace",
    "lora_adapters_from_args", "repeat", "scale_time", "synthetic_trace", "time_window",
    "trace_desc", "trace_from_args",
]
