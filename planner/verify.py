"""What ``plan --verify-top`` reads of the twin, and the verdict it gives a configuration replayed
for real.

A configuration's capacity is the grid rate ``k`` that passed in the twin with ``k + 1`` failing
(the bracket the search closed): ``rate(k + 1)`` is ``capacity x (1 + tolerance)``. Verifying it
replays it for real at both, and the pair of real verdicts says how the twin's capacity stands:

    real at capacity   real above   verdict
    fail               (any)        optimistic   the twin over-rates it
    pass               fail         tight        the capacity is right within the tolerance
    pass               pass         pessimistic  the twin under-rates it

The real replay above is left out when the one at capacity fails: its verdict is decided (the
search's own assumption, attainment falls as the rate rises), and an overloaded real replay is the
slowest there is. The twin's side is read the same way at both rates, from its replay at that rate:
the search's point file where it ran to its end, else a full replay made now (the search stops a
failing replay early, and an early-stopped replay's attainment counts only the requests it saw).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinserve.planner.plan import _fingerprint, plan_trace, rate_grid
from twinserve.planner.search import RateGrid, SearchTask, _read_point, replay_point, replay_requests
from twinserve.planner.slo import FAIL, PASS
from twinserve.planner.spec import PlanSpec
from twinserve.simulator.acceptance_merge import load_profiles
from twinserve.simulator.run import SimConfig
from twinserve.traces import TraceRequest

TIGHT, PESSIMISTIC, OPTIMISTIC = "tight", "pessimistic", "optimistic"


def capacity_verdict(at_capacity: str, above: str | None) -> str:
    """The verdict of the table above from the real verdicts at capacity and one step above
    (``None``: not replayed, allowed only where the one at capacity failed)."""
    if at_capacity == FAIL:
        return OPTIMISTIC
    if at_capacity != PASS:
        raise ValueError(f"at_capacity: expected {PASS!r} or {FAIL!r}, got {at_capacity!r}.")
    if above not in (PASS, FAIL):
        raise ValueError(f"above: expected {PASS!r} or {FAIL!r} where the replay at capacity "
                         f"passes, got {above!r}.")
    return TIGHT if above == FAIL else PESSIMISTIC


@dataclass(frozen=True, slots=True)
class VerifyRates:
    """The two rates a configuration is verified at: its capacity (grid index ``capacity_index``)
    and the next rate of the grid above it."""

    capacity_index: int
    capacity_rps: float
    above_rps: float

    @classmethod
    def of(cls, capacity_rps: float, grid: RateGrid) -> VerifyRates:
        k = grid.index_near(capacity_rps)
        if abs(grid.rate(k) - capacity_rps) > 1e-9 * capacity_rps:
            raise ValueError(f"capacity_rps: {capacity_rps!r} is not a rate of the plan's grid.")
        return cls(k, grid.rate(k), grid.rate(k + 1))


class TwinSide:
    """The twin's replays of one plan's configurations at the verified rates."""

    def __init__(self, spec: PlanSpec, out: Path) -> None:
        self.spec, self.out = spec, out
        self.trace: list[TraceRequest] = plan_trace(spec)
        self.grid = rate_grid(spec, len(self.trace))
        self._fingerprint = _fingerprint(spec, len(self.trace))
        self._acceptance = (load_profiles(spec.acceptance_profile)
                            if spec.acceptance_profile else None)

    def requests(self, rate: float) -> list[TraceRequest]:
        """The requests of a replay at ``rate``: the twin's and the real engine's alike."""
        return replay_requests(self.trace, rate, self.spec.duration_s)

    def point(self, row: Mapping[str, Any], sim: dict[str, Any], k: int) -> dict[str, Any]:
        """The twin's replay of ``row`` at rate index ``k``, run to its end: the search's point
        file where it ran to its end, else replayed now (without early stopping)."""
        task = SearchTask(str(self.out / row["folder"]), f"{self._fingerprint}:{row['candidate_id']}",
                          sim, self.trace, self.spec.slos, self.grid, early_stop=False,
                          acceptance=None if sim.get("prefill_instances") else self._acceptance,
                          duration_s=self.spec.duration_s)
        point = _read_point(Path(task.folder) / f"r{k}.json", task)
        if point is not None and not point["stopped_early"]:
            return point
        return replay_point(SimConfig.from_flat(sim), task, k)
