"""The result table vLLM's serving benchmark prints, from a ``metrics.summarize`` dict.

Same labels and ``{:<40} {:<10}`` layout as ``vllm bench serve`` so results read (and grep) alike.
Optional lines appear when the summary holds their key: ``failed``, ``max_concurrency``,
``request_rate``, ``request_goodput``, ``max_output_tokens_per_s``, ``max_concurrent_requests``; a
latency section appears when its ``mean_<metric>_ms`` key does. ``None`` (a NaN read back from
``summary.json``) prints as ``n/a``. Shared by ``bench serve`` and the simulator.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

WIDTH = 50
LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)
STATS = (("mean", "Mean"), ("median", "Median"), ("p99", "P99"))


def format_result(summary: Mapping[str, Any], title: str = "Serving Benchmark Result") -> str:
    """The printout, one line per metric, without a trailing newline."""
    lines = ["{s:{c}^{n}}".format(s=f" {title} ", n=WIDTH, c="=")]
    lines += _totals(summary)
    for key, name, header in LATENCY_SECTIONS:
        if f"mean_{key}_ms" in summary:
            lines.append("{s:-^{n}}".format(s=header, n=WIDTH))
            lines += [_row(f"{label} {name} (ms):", summary.get(f"{stat}_{key}_ms"), ".2f")
                      for stat, label in STATS]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def _totals(s: Mapping[str, Any]) -> list[str]:
    rows: list[tuple[str, str, str, bool]] = [  # (label, key, format, always shown)
        ("Successful requests:", "completed", "", True),
        ("Failed requests:", "failed", "", False),
        ("Maximum request concurrency:", "max_concurrency", "", False),
        ("Request rate configured (RPS):", "request_rate", ".2f", False),
        ("Benchmark duration (s):", "duration", ".2f", True),
        ("Total input tokens:", "total_input_tokens", "", True),
        ("Total generated tokens:", "total_output_tokens", "", True),
        ("Request throughput (req/s):", "request_throughput", ".2f", True),
        ("Request goodput (req/s):", "request_goodput", ".2f", False),
        ("Output token throughput (tok/s):", "output_throughput", ".2f", True),
        ("Peak output token throughput (tok/s):", "max_output_tokens_per_s", ".2f", False),
        ("Peak concurrent requests:", "max_concurrent_requests", "", False),
        ("Total Token throughput (tok/s):", "total_token_throughput", ".2f", True),
    ]
    return [_row(label, s.get(key), fmt) for label, key, fmt, always in rows if always or key in s]


def _row(label: str, value: Any, fmt: str) -> str:
    return f"{label:<40} {_value(value, fmt):<10}"


def _value(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if fmt and isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, fmt)
    return str(value)
