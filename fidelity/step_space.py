"""The part of the step space a calibration times (docs/fidelity-api.md, "In proportion").

A step is described by its batch (sequences), its scheduled tokens and the contexts it attends
over. The engine's limits bound all three; a workload reaches only the part its requests can
fill: no more sequences than requests, no longer context than its longest prompt + output, no
more tokens in a step than all its prompts at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from twinserve.traces import TraceRequest


@dataclass(slots=True, frozen=True)
class StepSpace:
    """Upper bounds of the steps timed: ``max_num_seqs`` sequences, ``max_num_batched_tokens``
    tokens, contexts up to ``max_model_len``."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"StepSpace.{name} must be an integer >= 1, got {value!r}.")

    def as_tuple(self) -> tuple[int, int, int]:
        """``(max_num_seqs, max_num_batched_tokens, max_model_len)``, as ``gpu/`` takes it."""
        return self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len

    def covers(self, other: StepSpace) -> bool:
        """Whether every step of ``other`` lies inside this space."""
        return (self.max_num_seqs >= other.max_num_seqs
                and self.max_num_batched_tokens >= other.max_num_batched_tokens
                and self.max_model_len >= other.max_model_len)


def reachable_space(requests: Sequence[TraceRequest], limits: StepSpace) -> StepSpace:
    """The part of ``limits`` (the engine's) that ``requests`` can reach. Each bound is at least
    16 (one block of the smallest size), so the fit keeps a spread of step sizes to stand on."""
    if not requests:
        raise ValueError("reachable_space needs at least one request.")
    longest = max(r.input_tokens + r.output_tokens for r in requests)
    all_prompts = sum(r.input_tokens for r in requests)

    def bound(reach: int, limit: int) -> int:
        return min(limit, max(16, reach))

    return StepSpace(min(limits.max_num_seqs, len(requests)),
                     bound(all_prompts, limits.max_num_batched_tokens),
                     bound(longest, limits.max_model_len))
