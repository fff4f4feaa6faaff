"""The speculation policy's seam: how many drafts each running decode gets, step by step.

The scheduler asks ``num_drafts`` for every running decode at schedule time (the answer
becomes the entry's ``num_draft_next``: the drafts the backend proposes after sampling), reports
each verification to ``on_verified`` and each step's timing to ``on_step``. Plugins live in
``policies/speculation/``; core only declares the protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from twinserve.core.outputs import SchedulerOutput
    from twinserve.core.request import Request


@runtime_checkable
class SpeculationPolicy(Protocol):
    k_max: int

    def num_drafts(self, request: Request, num_running: int, budget: int) -> int:
        """Drafts to propose for ``request`` after this step, in 0..k_max."""
        ...

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """``num_accepted`` of ``num_drafts`` verified drafts of ``request`` were accepted."""
        ...

    def on_step(self, out: SchedulerOutput, start: float, end: float) -> None:
        """A step ran from ``start`` to ``end`` (seconds)."""
        ...
