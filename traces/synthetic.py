"""Synthetic workloads under vLLM's benchmark conventions (``vllm bench serve --dataset-name random``).

- Arrivals: ``request_rate`` requests/s (``inf``: all at t=0); gaps are gamma-distributed with
  ``shape=burstiness`` and ``scale=1/(request_rate*burstiness)``, so the mean rate is ``request_rate`` and
  the gaps' coefficient of variation is ``1/sqrt(burstiness)`` (1.0 = Poisson, < 1 burstier).
- Lengths: uniform integers in ``[floor(len*(1-range_ratio)), ceil(len*(1+range_ratio))]``, at least 1
  (``range_ratio=0``: fixed lengths).
- Shared system prompt: every prompt is ``prefix_len`` + its sampled ``input_len`` tokens; for a fraction
  ``prefix_share`` of requests (drawn independently) the first ``prefix_len`` tokens are one shared
  prefix, for the others they are unique. Lengths do not depend on ``prefix_share``, only cache hits do.
- Tenants: ``tenant_rates`` ({name: req/s}) gives each tenant an independent arrival stream (same
  burstiness), merged in time; it replaces ``request_rate``.
- Priorities: ``priorities`` ({priority: weight}) draws each request's class independently.

Each aspect draws from its own seeded stream (and each tenant from its own), so changing one setting
leaves the others' draws unchanged. The first request arrives at 0.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from twinserve.traces.plain_format import group_block_id
from twinserve.traces.proportions import check_proportions, draw_labels
from twinserve.traces.trace_request import TraceRequest, stable_seed

SYSTEM_PROMPT_GROUP = "synthetic-system-prompt"


@dataclass(slots=True)
class SyntheticConfig:
    num_requests: int = 1000
    request_rate: float = math.inf
    burstiness: float = 1.0
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0
    prefix_share: float = 1.0
    tenant_rates: dict[str, float] | None = None
    priorities: dict[int, float] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "input_len", "output_len"):
            _check_int(name, getattr(self, name), 1)
        _check_int("prefix_len", self.prefix_len, 0)
        _check_int("seed", self.seed, 0)
        if not self.request_rate > 0:  # also rejects nan
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}.")
        if not (0 < self.burstiness < math.inf):
            raise ValueError(f"burstiness must be a finite number > 0, got {self.burstiness}.")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}.")
        if not 0 <= self.prefix_share <= 1:
            raise ValueError(f"prefix_share must be in [0, 1], got {self.prefix_share}.")
        if self.tenant_rates is not None:
            self._check_tenant_rates(self.tenant_rates)
        if self.priorities is not None:
            check_proportions(self.priorities, "priorities")

    def _check_tenant_rates(self, rates: dict[str, float]) -> None:
        if self.request_rate != math.inf:
            raise ValueError("give request_rate or tenant_rates, not both.")
        if not rates:
            raise ValueError("tenant_rates must not be empty.")
        for tenant, rate in rates.items():
            if not isinstance(tenant, str) or not tenant:
                raise ValueError(f"tenant_rates: tenant names must be non-empty strings, got {tenant!r}.")
            if not (0 < rate < math.inf):
                raise ValueError(f"tenant_rates: rate of {tenant!r} must be finite and > 0, got {rate}.")


def _check_int(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}.")


def arrival_times(rng: np.random.Generator, n: int, rate: float, burstiness: float) -> np.ndarray:
    """``n`` arrival times of one gamma-renewal stream, the first after one gap (inf rate: all 0)."""
    if rate == math.inf:
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.cumsum(gaps)


def _merged_arrivals(cfg: SyntheticConfig) -> tuple[np.ndarray, list[str]]:
    """The first ``num_requests`` arrivals of all tenants' streams merged, and whose each is."""
    rates = cfg.tenant_rates or {"default": cfg.request_rate}
    n = cfg.num_requests
    times, owners = [], []
    # The first n merged arrivals lie within each stream's first n, so n per stream is enough.
    for index, (tenant, rate) in enumerate(rates.items()):
        rng = np.random.default_rng([cfg.seed, stable_seed(f"tenant:{tenant}")])
        times.append(arrival_times(rng, n, rate, cfg.burstiness))
        owners.append(np.full(n, index))
    all_times, all_owners = np.concatenate(times), np.concatenate(owners)
    order = np.argsort(all_times, kind="stable")[:n]
    names = list(rates)
    return all_times[order] - all_times[order[0]], [names[i] for i in all_owners[order].tolist()]


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """vLLM's random-dataset lengths: uniform integers around ``length``, at least 1."""
    low = math.floor(length * (1 - range_ratio))
    high = math.ceil(length * (1 + range_ratio))
    return np.maximum(rng.integers(low, high + 1, size=n), 1)


def synthetic_trace(cfg: SyntheticConfig) -> list[TraceRequest]:
    """A seeded synthetic workload; the same config always gives the same requests."""
    n = cfg.num_requests
    lengths_rng, outputs_rng, prefix_rng, priority_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(4))
    times, tenants = _merged_arrivals(cfg)
    inputs = (sample_lengths(lengths_rng, n, cfg.input_len, cfg.range_ratio) + cfg.prefix_len).tolist()
    outputs = sample_lengths(outputs_rng, n, cfg.output_len, cfg.range_ratio).tolist()
    shares = (prefix_rng.random(n) < cfg.prefix_share).tolist() if cfg.prefix_len else [False] * n
    priorities = draw_labels(priority_rng, cfg.priorities, n, "priorities") if cfg.priorities else [0] * n
    prefix = (group_block_id(SYSTEM_PROMPT_GROUP),)
    return [
        TraceRequest(request_id=f"synthetic-{i}", arrival_time=t, input_tokens=inputs[i],
                     output_tokens=outputs[i], tenant=tenants[i], priority=int(priorities[i]),
                     prefix_blocks=prefix if shares[i] else (),
                     prefix_block_tokens=cfg.prefix_len if shares[i] else 16)
        for i, t in enumerate(times.tolist())
    ]
