"""``TraceSpec`` carries every workload flag (``traces.add_trace_args``) into the workload."""

from __future__ import annotations

import argparse
import dataclasses

from twinserve.fidelity.workload import TraceSpec
from twinserve.traces import add_trace_args


def _parsed(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_trace_args(parser)
    return parser.parse_args(argv)


def test_every_trace_flag_is_a_field() -> None:
    """A flag without a field would be dropped silently by ``from_namespace``."""
    flags = set(vars(_parsed([])))
    fields = {f.name for f in dataclasses.fields(TraceSpec)}
    assert flags - fields == set()


def test_multi_app_flags_shape_the_workload() -> None:
    args = _parsed(["--trace", "multi-app", "--num-apps", "3", "--system-len-min", "48",
                    "--system-len-max", "80", "--num-requests", "40", "--input-len", "8"])
    requests = TraceSpec.from_namespace(args).load().requests
    apps = {r.tenant for r in requests}
    assert apps <= {"app-0", "app-1", "app-2"} and len(apps) > 1
    assert all(48 <= r.prefix_block_tokens <= 80 for r in requests)
