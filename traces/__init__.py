"""Request workloads: the bundled public traces, trace files, synthetic workloads and their transforms."""

from twinserve.traces.cli_args import add_trace_args, trace_desc, trace_from_args
from twinserve.traces.errors import TraceError
from twinserve.traces.loaders import BUNDLED_TRACES, load_trace
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
    "BUNDLED_TRACES", "LOWEST_TOKEN_ID", "SyntheticConfig", "TraceError", "TraceRequest",
    "add_trace_args", "assign_priorities", "assign_tenants", "clip_lengths", "first_n", "load_trace",
    "repeat", "scale_time", "synthetic_trace", "time_window", "trace_desc", "trace_from_args",
]
