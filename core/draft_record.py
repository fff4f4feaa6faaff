"""Each request's speculation, step by step: what the proposer found and what the target accepted.

vLLM's counters (``spec_num_*``) hold totals; the twin's acceptance model also needs the order of
a request's steps, since lookup proposers are bursty (a request that starts copying text keeps
copying). ``DraftRecorder`` watches a step driver (``core.step_driver.StepObserver``) and keeps
one ``DraftStep`` per sampling entry that verified drafts or asked for them; a run folder holds
them as ``drafts.csv``, one row each, in step order::

    request_id, position, num_drafts, num_accepted, num_asked, num_found

Decisions:

- Read after the step is applied (the observer runs at ``end_step``): the accepted count is the
  change in the request's ``spec_num_accepted_tokens``, the proposals found are the request's
  ``spec_token_ids`` (the scheduler keeps at most the ``num_draft_next`` it asked for).
- A request that finished in the step asked for nothing that mattered: ``num_asked`` and
  ``num_found`` are 0 there.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from twinserve.core.outputs import SchedulerOutput

DRAFTS_FILE = "drafts.csv"
DRAFT_COLUMNS = ("request_id", "position", "num_drafts", "num_accepted", "num_asked", "num_found")


@dataclass(frozen=True, slots=True)
class DraftStep:
    """One request's step: ``num_drafts`` verified (``num_accepted`` of them accepted), then
    ``num_found`` proposals of the ``num_asked`` wanted after its newest token, at
    ``position`` (the rejected drafts rolled back)."""

    request_id: str
    position: int
    num_drafts: int
    num_accepted: int
    num_asked: int
    num_found: int

    def __post_init__(self) -> None:
        for name in DRAFT_COLUMNS[1:]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DraftStep.{name} must be an integer >= 0, got {value!r}.")
        if self.num_accepted > self.num_drafts:
            raise ValueError(f"DraftStep.num_accepted ({self.num_accepted}) exceeds num_drafts "
                             f"({self.num_drafts}).")
        if self.num_found > self.num_asked:
            raise ValueError(f"DraftStep.num_found ({self.num_found}) exceeds num_asked "
                             f"({self.num_asked}).")


class DraftRecorder:
    """A step observer that records every speculating entry as a ``DraftStep`` (module doc)."""

    __slots__ = ("steps", "_accepted")

    def __init__(self) -> None:
        self.steps: list[DraftStep] = []
        self._accepted: dict[str, int] = {}  # request id -> its accepted count so far

    def on_step(self, out: SchedulerOutput, seconds: float, execute_seconds: float) -> None:
        for sr in out.scheduled:
            k, asked = len(sr.spec_token_ids), sr.num_draft_next
            if not sr.sample or not (k or asked):
                continue
            request = sr.request
            rid, total = request.request_id, request.spec_num_accepted_tokens
            accepted = total - self._accepted.get(rid, 0)
            if request.is_finished:
                self._accepted.pop(rid, None)
                asked = found = 0
            else:
                self._accepted[rid] = total
                found = min(asked, len(request.spec_token_ids))
            accepted = accepted if k else 0
            newest = sr.start + sr.num_new_tokens - (k - accepted)  # after the rollback
            self.steps.append(DraftStep(rid, newest, k, accepted, asked, found))


def write_drafts(path: Path, steps: Iterable[DraftStep]) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(DRAFT_COLUMNS)
        for s in steps:
            writer.writerow((s.request_id, s.position, s.num_drafts, s.num_accepted, s.num_asked,
                             s.num_found))
    return path


def read_drafts(path: Path) -> list[DraftStep]:
    """The steps of a ``drafts.csv`` (``ValueError`` naming the file for a malformed one)."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if tuple(reader.fieldnames or ()) != DRAFT_COLUMNS:
            raise ValueError(f"{str(path)!r} is not a drafts file: columns {reader.fieldnames}, "
                             f"expected {list(DRAFT_COLUMNS)}.")
        try:
            return [DraftStep(row["request_id"], *(int(row[c]) for c in DRAFT_COLUMNS[1:]))
                    for row in reader]
        except ValueError as exc:
            raise ValueError(f"{str(path)!r}: {exc}") from None
