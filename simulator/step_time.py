"""The seam between the twin's engine loop and its GPU: a step-time model.

The engine loop (``simulator/engine.py``) asks a model for one step's seconds and, for a run of
decode-only steps (``core.decode_run``), for all of the run's step ends in one call. A model
declares that shortcut itself: ``decode_run_ends`` returns ``None`` wherever it has none (a
fitted model, a wrapper that adds terms per step), and the loop then calls ``step_time`` step
by step, the reference. A model that answers must give exactly the ends that loop would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from twinserve.core.outputs import SchedulerOutput


class StepTimeModel(Protocol):
    """What the twin's engine loop needs of a GPU."""

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds the step ``out`` takes."""
        ...

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        """The end times of a decode run's steps from ``now`` (``out`` holds the first; each
        later step's contexts are one token longer), while a step ends before ``horizon`` and
        where SimPy would put it (``base + (end - base) == end``), at most ``max_steps``; equal
        to ``now + step_time(out)`` step by step. ``None``: no shortcut for this step."""
        ...


@dataclass(frozen=True, slots=True)
class StepTimeFunction:
    """A plain function of the step as a ``StepTimeModel`` (no decode-run shortcut)."""

    function: Callable[[SchedulerOutput], float]

    def step_time(self, out: SchedulerOutput) -> float:
        return self.function(out)

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        return None
