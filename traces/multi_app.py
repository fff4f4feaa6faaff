"""A multi-application workload: many applications, each with its own system prompt.

Application ``k`` (of ``num_apps``) has a system prompt of a length drawn once, uniformly within
``[system_len_min, system_len_max]``, shared by all its requests (one prefix group each); its
popularity follows Zipf's law, ``1 / (k + 1) ** zipf_s``; requests arrive as one Poisson stream of
``request_rate``, each an application drawn by popularity, with a user turn and an output of
their own lengths. The same config always gives the same requests.

The lengths spread as a real conversation service's do, since with constant or narrowly uniform
sizes every request costs the same and round robin balances perfectly by construction. By default
(``range_ratio=None``) each is lognormal with median ``input_len`` (user turn) or ``output_len``
(output) and the log-spread of the Azure LLM inference conversation trace (Splitwise, ISCA 2024;
``traces/data/azure_llm_2023``): sigma 0.99 for its prompts, 0.86 for its outputs, cut at
``LENGTH_CAP`` times the median (the trace's own 99th percentiles lie at 4.1x and 4.7x its
medians). A ``range_ratio`` samples vLLM's random-dataset lengths instead, uniform within
``len * (1 +- range_ratio)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from twinserve.traces.plain_format import group_block_id
from twinserve.traces.synthetic import arrival_times, sample_lengths
from twinserve.traces.trace_request import TraceRequest

# The log-spread (standard deviation of the log) of the Azure conversation trace's prompt and
# output lengths, and the cut of a lognormal draw, in medians.
INPUT_SIGMA, OUTPUT_SIGMA, LENGTH_CAP = 0.99, 0.86, 5.0


@dataclass(slots=True)
class MultiAppConfig:
    num_requests: int = 1000
    request_rate: float = 40.0
    num_apps: int = 24
    zipf_s: float = 1.0
    system_len_min: int = 256
    system_len_max: int = 2048
    input_len: int = 256  # the user turn after the system prompt (median)
    output_len: int = 128  # (median)
    range_ratio: float | None = None  # None: lognormal lengths; else vLLM's uniform ones
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "num_apps", "system_len_min", "input_len", "output_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.system_len_max, int) or self.system_len_max < self.system_len_min:
            raise ValueError(f"system_len_max must be an integer >= system_len_min "
                             f"({self.system_len_min}), got {self.system_len_max!r}.")
        if not 0 < self.request_rate < float("inf"):
            raise ValueError(f"request_rate must be positive and finite, got {self.request_rate!r}.")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}.")
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf_s must be non-negative, got {self.zipf_s!r}.")
        if self.range_ratio is not None and not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio!r}.")

    def popularity(self) -> np.ndarray:
        """Each application's share of the requests (Zipf, summing to 1)."""
        weights = 1.0 / np.arange(1, self.num_apps + 1) ** self.zipf_s
        return weights / weights.sum()


def checked_config(num_requests: int, settings: Mapping[str, Any], seed: int = 0,
                   name: Callable[[str], str] = str) -> MultiAppConfig:
    """``MultiAppConfig`` of ``settings`` (its field names), each checked alone first so that a
    ValueError names the one at fault, as ``name(field)`` (a flag, a spec key);
    ``system_len_max`` is judged against the minimum, with the whole."""
    for key, value in {"num_requests": num_requests, **settings}.items():
        if key != "system_len_max":
            try:
                MultiAppConfig(**{key: value})
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{name(key)}: {exc}") from None
    try:
        return MultiAppConfig(**{"num_requests": num_requests, "seed": seed, **settings})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name('system_len_max')}: {exc}") from None


def multi_app_trace(cfg: MultiAppConfig) -> list[TraceRequest]:
    """The seeded workload; each request's tenant names its application (``app-k``)."""
    n = cfg.num_requests
    system_rng, app_rng, arrival_rng, input_rng, output_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(cfg.seed).spawn(5))
    system_lens = system_rng.integers(cfg.system_len_min, cfg.system_len_max + 1,
                                      size=cfg.num_apps).tolist()
    apps = app_rng.choice(cfg.num_apps, size=n, p=cfg.popularity()).tolist()
    times = arrival_times(arrival_rng, n, cfg.request_rate, 1.0)
    times = (times - times[0]).tolist()
    inputs = _lengths(input_rng, n, cfg.input_len, cfg.range_ratio, INPUT_SIGMA)
    outputs = _lengths(output_rng, n, cfg.output_len, cfg.range_ratio, OUTPUT_SIGMA)
    groups = [(group_block_id(f"multi-app:{cfg.seed}:{k}"),) for k in range(cfg.num_apps)]
    return [
        TraceRequest(request_id=f"app{app}-{i}", arrival_time=t,
                     input_tokens=system_lens[app] + inputs[i], output_tokens=outputs[i],
                     tenant=f"app-{app}", prefix_blocks=groups[app],
                     prefix_block_tokens=system_lens[app])
        for i, (app, t) in enumerate(zip(apps, times))
    ]


def _lengths(rng: np.random.Generator, n: int, median: int, range_ratio: float | None,
             sigma: float) -> list[int]:
    """``n`` lengths: lognormal around ``median`` (cut to [1, LENGTH_CAP * median]) without a
    ``range_ratio``, else vLLM's uniform ones."""
    if range_ratio is not None:
        return sample_lengths(rng, n, median, range_ratio).tolist()
    drawn = np.rint(median * rng.lognormal(0.0, sigma, size=n))
    return np.clip(drawn, 1, max(1, round(LENGTH_CAP * median))).astype(int).tolist()
