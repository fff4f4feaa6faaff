"""A multi-application workload: many applications, each with its own system prompt.

Application ``k`` (of ``num_apps``) has a system prompt of a length drawn once, uniformly within
``[system_len_min, system_len_max]``, shared by all its requests (one prefix group each); its
popularity follows Zipf's law, ``1 / (k + 1) ** zipf_s``; requests arrive as one Poisson stream of
``request_rate``, each an application drawn by popularity, with a user turn and an output sampled
as vLLM's random dataset samples lengths. The same config always gives the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from twinserve.traces.plain_format import group_block_id
from twinserve.traces.synthetic import arrival_times, sample_lengths
from twinserve.traces.trace_request import TraceRequest


@dataclass(slots=True)
class MultiAppConfig:
    num_requests: int = 1000
    request_rate: float = 40.0
    num_apps: int = 24
    zipf_s: float = 1.0
    system_len_min: int = 256
    system_len_max: int = 2048
    input_len: int = 256  # the user turn after the system prompt
    output_len: int = 128
    range_ratio: float = 0.5
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
        if not self.zipf_s >= 0:
            raise ValueError(f"zipf_s must be non-negative, got {self.zipf_s!r}.")
        if not 0 <= self.range_ratio < 1:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio!r}.")

    def popularity(self) -> np.ndarray:
        """Each application's share of the requests (Zipf, summing to 1)."""
        weights = 1.0 / np.arange(1, self.num_apps + 1) ** self.zipf_s
        return weights / weights.sum()


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
    inputs = sample_lengths(input_rng, n, cfg.input_len, cfg.range_ratio).tolist()
    outputs = sample_lengths(output_rng, n, cfg.output_len, cfg.range_ratio).tolist()
    groups = [(group_block_id(f"multi-app:{cfg.seed}:{k}"),) for k in range(cfg.num_apps)]
    return [
        TraceRequest(request_id=f"app{app}-{i}", arrival_time=t,
                     input_tokens=system_lens[app] + inputs[i], output_tokens=outputs[i],
                     tenant=f"app-{app}", prefix_blocks=groups[app],
                     prefix_block_tokens=system_lens[app])
        for i, (app, t) in enumerate(zip(apps, times))
    ]
