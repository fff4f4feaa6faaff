"""A workload: the requests a replay and its twin run, and the description that reruns them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from twinserve.traces import TraceRequest


@dataclass(slots=True, frozen=True)
class Workload:
    """``requests`` (at least one) and ``desc``: what selected them (a run folder records it)."""

    requests: tuple[TraceRequest, ...]
    desc: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.requests:
            raise ValueError("Workload.requests: the workload selects no request.")


@dataclass(slots=True, frozen=True)
class TraceSpec:
    """The workload flags of ``twinserve validate`` as fields (``traces.cli_flags``; the same
    names, the same order of application: ``traces.cli_args.trace_from_args``)."""

    trace: str = "azure-conv"
    num_requests: int | None = None
    time_window: str | None = None
    time_scale: float | None = None
    request_rate: float | None = None
    burstiness: float | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    prefix_len: int | None = None
    prefix_share: float | None = None
    num_apps: int | None = None
    zipf_s: float | None = None
    system_len_min: int | None = None
    system_len_max: int | None = None
    tenants: str | None = None
    priorities: str | None = None
    max_model_len: int | None = None
    max_output_tokens: int | None = None
    seed: int = 0

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> TraceSpec:
        """The spec of parsed workload flags (``traces.add_trace_args``)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes: Any) -> TraceSpec:
        return dataclasses.replace(self, **changes)

    def load(self) -> Workload:
        """The requests the spec selects; a bad field raises ValueError naming its flag."""
        from twinserve.traces import trace_desc, trace_from_args
        args = argparse.Namespace(**{f.name: getattr(self, f.name)
                                     for f in dataclasses.fields(self)})
        return Workload(tuple(trace_from_args(args)), trace_desc(args))
