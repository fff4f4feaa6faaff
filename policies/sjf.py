"""Shortest job first on a length hint, with aging so long jobs are not starved forever."""

from __future__ import annotations

from collections.abc import Sequence

from twinserve.core.policy import HeapQueue, QueuePolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register

HINT_KEY = "output_len_hint"


def expected_output_len(request: Request) -> float:
    """``hints["output_len_hint"]`` (a predictor's or a trace's value), else ``max_tokens``."""
    hint = request.hints.get(HINT_KEY)
    if hint is not None:
        return float(hint)
    max_tokens = request.sampling_params.max_tokens
    return float(max_tokens) if max_tokens is not None else 1e9


@register("sjf")
class SJFPolicy(QueuePolicy):
    """Admits the request with the least expected work first: prompt tokens * ``prefill_weight``
    + expected output tokens, minus ``aging_tokens_per_s`` * arrival-time credit (a request that
    arrived earlier gets a head start, bounding starvation). Victim = the running request with
    the most expected remaining output."""

    def __init__(self, prefill_weight: float = 0.0, aging_tokens_per_s: float = 0.0) -> None:
        if prefill_weight < 0:
            raise ValueError(f"prefill_weight must be non-negative, got {prefill_weight}")
        if aging_tokens_per_s < 0:
            raise ValueError(f"aging_tokens_per_s must be non-negative, got {aging_tokens_per_s}")
        self.prefill_weight = prefill_weight
        self.aging = aging_tokens_per_s
        self._queue = HeapQueue(self._key)

    def _key(self, request: Request) -> tuple[float, float]:
        work = expected_output_len(request) - request.num_output_tokens
        work += self.prefill_weight * request.num_prompt_tokens
        return (work + self.aging * request.arrival_time, request.arrival_time)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=lambda r: (expected_output_len(r) - r.num_output_tokens,
                                           r.arrival_time))
