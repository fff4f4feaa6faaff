"""What constrained decoding (JSON mode, JSON schemas, forced tool calls) adds to a simulated
step: the real engine fills one grammar mask per constrained row on the host and applies it to
the logits before sampling, inside the step, so a step with ``r`` constrained rows takes

    mask_s = structured_mask_s_per_step + structured_mask_s_per_row * r        (r > 0; else 0)

longer. ``r`` counts the step's scheduled entries that sample (``sample``) and whose request
carries ``structured_outputs``. The two coefficients are fields of the hardware profile;
``twinserve calibrate`` measures them on the real engine (``gpu/measurement/structured_mask_profile.py``).
Their defaults are what that measurement gave on a 2-core CPU with the bundled model's
49,152-token vocabulary (figures and command in docs/structured-outputs.md); a vocabulary of
another size scales the per-row cost roughly in proportion.

Which requests are constrained: a trace row marked so, or ``structured_fraction`` of the
requests, drawn by a seeded hash of the request id (the same requests in every run and policy).
A constrained twin request carries ``STRUCTURED_MARK`` (JSON mode); the twin compiles nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.structured_outputs import StructuredOutputsParams
from twinserve.simulator.step_time import StepTimeModel
from twinserve.traces.trace_request import stable_seed

if TYPE_CHECKING:  # hardware.py takes its defaults from here
    from twinserve.simulator.hardware import HardwareProfile

DEFAULT_MASK_S_PER_ROW = 1.02e-3
DEFAULT_MASK_S_PER_STEP = 1.7e-3
STRUCTURED_MARK = StructuredOutputsParams(json_object=True)
_HASH_SPAN = float(1 << 64)


def constrained_rows(out: SchedulerOutput) -> int:
    """The step's sampling entries whose request decodes under a grammar."""
    return sum(1 for s in out.scheduled
               if s.sample and s.request.sampling_params.structured_outputs is not None)


@dataclass(frozen=True, slots=True)
class StructuredCost:
    """The mask time of a step (see the module doc)."""

    mask_s_per_row: float = DEFAULT_MASK_S_PER_ROW
    mask_s_per_step: float = DEFAULT_MASK_S_PER_STEP

    def __post_init__(self) -> None:
        for name in ("mask_s_per_row", "mask_s_per_step"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}.")

    def mask_time(self, out: SchedulerOutput) -> float:
        rows = constrained_rows(out)
        return self.mask_s_per_step + self.mask_s_per_row * rows if rows else 0.0

    def wrap(self, inner: StepTimeModel) -> WithMasks:
        """``inner``'s step time plus this mask time."""
        return WithMasks(inner, self)


@dataclass(frozen=True, slots=True)
class WithMasks:
    """A step-time model (``inner``) whose steps also fill their constrained rows' masks."""

    inner: StepTimeModel
    masks: StructuredCost

    def step_time(self, out: SchedulerOutput) -> float:
        return self.inner.step_time(out) + self.masks.mask_time(out)

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        """None: the mask time rides on each step, so runs are timed step by step."""
        return None


@dataclass(frozen=True, slots=True)
class StructuredWorkload:
    """Which requests of a replay are constrained: ``fraction`` of them, by a seeded hash."""

    fraction: float
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.fraction, bool) or not isinstance(self.fraction, (int, float)) \
                or not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"structured_fraction must be in [0, 1], got {self.fraction!r}.")

    def is_constrained(self, request_id: str) -> bool:
        if self.fraction <= 0.0:
            return False
        return stable_seed(f"{self.seed}:{request_id}") / _HASH_SPAN < self.fraction

    def params(self, params: SamplingParams, request_id: str) -> SamplingParams:
        """``params``, or a copy with ``STRUCTURED_MARK`` when the request is constrained."""
        if not self.is_constrained(request_id):
            return params
        return SamplingParams(max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                              structured_outputs=STRUCTURED_MARK)


def structured_cost_of(hardware: HardwareProfile) -> StructuredCost:
    """The profile's mask coefficients (a profile file without them reads as the defaults)."""
    return StructuredCost(hardware.structured_mask_s_per_row,
                          hardware.structured_mask_s_per_step)
