"""How a backend calibration measures: the settings ``calibrate`` and ``validate`` share."""

from __future__ import annotations

from dataclasses import dataclass

from twinserve.fidelity.threads import measurement_threads


@dataclass(slots=True, frozen=True)
class CalibrationSettings:
    """``quick``: a smaller grid and fewer engine-loop workloads; ``warmup`` / ``repeats``: untimed
    and timed passes of the micro-benchmark grid (each step's median); ``engine_loop``: time the
    synthetic workloads through the engine loop too (the profile's level); ``threads``: torch CPU
    threads (``None``: every core but one, ``measurement_threads``); ``base_hardware``: the
    profile whose roofline numbers the calibrated one keeps (``None``: the device's bundled one);
    ``profile_model``: the name the fit is stored under (``None``: the model directory's)."""

    quick: bool = False
    warmup: int = 1
    repeats: int = 3
    engine_loop: bool = True
    threads: int | None = None
    base_hardware: str | None = None
    profile_model: str | None = None

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}.")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}.")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}.")

    @property
    def num_threads(self) -> int:
        """The threads the measurement runs on (``threads`` or ``measurement_threads()``)."""
        return self.threads or measurement_threads()
