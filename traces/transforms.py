"""Pure transforms of a request list (each returns a new list; requests are immutable).

Inputs are expected sorted by arrival, as the loaders and ``synthetic_trace`` return them; outputs are too.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from twinserve.traces.proportions import draw_labels
from twinserve.traces.trace_request import TraceRequest


def scale_time(reqs: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """Replays ``factor`` times as fast: every arrival is divided by ``factor`` (2.0 = twice the rate)."""
    if not (0 < factor < math.inf):
        raise ValueError(f"factor must be a finite number > 0, got {factor}.")
    return [dataclasses.replace(r, arrival_time=r.arrival_time / factor) for r in reqs]


def first_n(reqs: list[TraceRequest], n: int) -> list[TraceRequest]:
    """The first ``n`` requests (all of them when there are fewer)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}.")
    return list(reqs[:n])


def time_window(reqs: list[TraceRequest], start_s: float, end_s: float) -> list[TraceRequest]:
    """Requests arriving in ``[start_s, end_s)``, re-based so that the first of them arrives at 0.0."""
    if not (0 <= start_s < end_s):
        raise ValueError(f"time window needs 0 <= start_s < end_s, got start_s={start_s}, end_s={end_s}.")
    kept = [r for r in reqs if start_s <= r.arrival_time < end_s]
    if not kept:
        return []
    t0 = min(r.arrival_time for r in kept)
    return [dataclasses.replace(r, arrival_time=r.arrival_time - t0) for r in kept]


def clip_lengths(reqs: list[TraceRequest], max_model_len: int,
                 max_output_tokens: int | None = None) -> list[TraceRequest]:
    """Makes every request fit: ``input_tokens + output_tokens <= max_model_len``.

    Rule: first ``output_tokens = min(output_tokens, max_output_tokens)``; then the prompt is shortened
    (down to 1 token) to leave room for the whole output, since the output length is what drives the
    decode work a trace records; only an output that alone does not fit is cut, to ``max_model_len - 1``.
    Prefix blocks that no longer cover any prompt token are dropped.
    """
    _check_positive("max_model_len", max_model_len, 2)
    if max_output_tokens is not None:
        _check_positive("max_output_tokens", max_output_tokens, 1)
    return [_clip(r, max_model_len, max_output_tokens) for r in reqs]


def _clip(r: TraceRequest, max_model_len: int, max_output_tokens: int | None) -> TraceRequest:
    output = r.output_tokens if max_output_tokens is None else min(r.output_tokens, max_output_tokens)
    output = min(output, max_model_len - 1)
    prompt = min(r.input_tokens, max_model_len - output)
    if (prompt, output) == (r.input_tokens, r.output_tokens):
        return r
    blocks = r.prefix_blocks[:math.ceil(prompt / r.prefix_block_tokens)]
    return dataclasses.replace(r, input_tokens=prompt, output_tokens=output, prefix_blocks=blocks)


def _check_positive(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def assign_tenants(reqs: list[TraceRequest], proportions: dict[str, float],
                   seed: int = 0) -> list[TraceRequest]:
    """Each request's tenant drawn independently with the given weights (seeded)."""
    if any(not isinstance(t, str) or not t for t in proportions):
        raise ValueError(f"tenant names must be non-empty strings, got {list(proportions)}.")
    tenants = draw_labels(np.random.default_rng(seed), proportions, len(reqs), "tenant proportions")
    return [dataclasses.replace(r, tenant=t) for r, t in zip(reqs, tenants)]


def assign_priorities(reqs: list[TraceRequest], proportions: dict[int, float],
                      seed: int = 0) -> list[TraceRequest]:
    """Each request's priority drawn independently with the given weights (seeded)."""
    if any(isinstance(p, bool) or not isinstance(p, int) for p in proportions):
        raise ValueError(f"priorities must be integers, got {list(proportions)}.")
    priorities = draw_labels(np.random.default_rng(seed), proportions, len(reqs), "priority proportions")
    return [dataclasses.replace(r, priority=p) for r, p in zip(reqs, priorities)]


def repeat(reqs: list[TraceRequest], times: int) -> list[TraceRequest]:
    """``times`` copies back to back, each shifted by the trace's span plus its mean gap (so the rate
    stays the same). Copy ``k >= 1`` gets ids ``<id>~<k>``; copies keep their prefix blocks, so a copy
    shares prompts with the original as a replayed conversation would.
    """
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ValueError(f"times must be an integer >= 1, got {times!r}.")
    if not reqs:
        return []
    start = min(r.arrival_time for r in reqs)
    span = max(r.arrival_time for r in reqs) - start
    period = span + (span / (len(reqs) - 1) if len(reqs) > 1 else 0.0)
    out = list(reqs)
    for k in range(1, times):
        out.extend(dataclasses.replace(r, request_id=f"{r.request_id}~{k}",
                                       arrival_time=r.arrival_time + k * period) for r in reqs)
    return out
