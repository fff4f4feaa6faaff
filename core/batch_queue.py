"""vLLM's batch queue: up to ``depth`` scheduled batches in flight through a pipeline.

Under pipeline parallelism the first stage can start batch ``i + 1`` while the last one still
computes batch ``i``. The engine (``gpu.engine.llm_engine``) and the twin
(``simulator.pipeline``) keep their in-flight batches here, oldest first; while a batch is in
flight its requests' ids sit in ``Scheduler.in_flight``, so the scheduler neither schedules them
again (a request is never in two batches) nor preempts them. A request aborted or stopped
meanwhile leaves the scheduler at once (its blocks freed: each stage runs its batches in order,
so a later batch reusing them writes after the earlier one read), and ``update_from_output``
skips its entry when its batch returns::

    step:  schedule -> push(out, handle)          queue not full, something was scheduled: return
           pop() -> (out, handle) -> finish -> update_from_output    (queue full, or nothing new)

As in vLLM V1, requests that were scheduled together stay together: a batch of every running
request leaves nothing for a second one until it returns, and batches overlap where requests
arrive (or chunk their prompts) while others are in flight. With ``balance`` (vLLM V0's virtual
engines split requests likewise) ``schedule`` spreads the running requests evenly over the
batches the queue has room for, so even requests admitted together fill ``depth`` batches: that
buys overlap where a stage's time grows with its batch (compute-bound steps), and costs where it
does not (memory-bound decodes read every weight once per batch, so two half batches read them
twice: measured slower on the 2-core CPU, docs/pipeline-parallel.md).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.scheduler import Scheduler

H = TypeVar("H")  # what the backend returns for a batch it runs: a pending result, a finish time


@dataclass(slots=True)
class InFlightBatch(Generic[H]):
    """A batch in the pipeline: its scheduler output, the backend's handle, when it started."""

    out: SchedulerOutput
    handle: H
    start: float


class BatchQueue(Generic[H]):
    """At most ``depth`` batches in flight for ``scheduler``, oldest first; ``balance``: spread
    the running requests over them (see the module doc). ``max_in_flight``: the most there
    ever were at once."""

    __slots__ = ("scheduler", "depth", "balance", "_batches", "max_in_flight")

    def __init__(self, scheduler: Scheduler, depth: int, balance: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"depth (batches in flight) must be >= 1, got {depth}.")
        self.scheduler = scheduler
        self.depth = depth
        self.balance = balance
        self._batches: deque[InFlightBatch[H]] = deque()
        self.max_in_flight = 0

    def __len__(self) -> int:
        return len(self._batches)

    @property
    def full(self) -> bool:
        return len(self._batches) >= self.depth

    def schedule(self, now: float) -> SchedulerOutput:
        """``Scheduler.schedule``; with ``balance``, over this batch's share of the running
        requests not in flight (an even split over the batches there is room for; the rest are
        held back for now)."""
        sched = self.scheduler
        if not self.balance:
            return sched.schedule(now)
        held = sched.in_flight
        free = [r for r in sched.running if r.request_id not in held]
        share = math.ceil(len(free) / max(1, self.depth - len(self._batches)))
        later = [r.request_id for r in free[share:]]
        held.update(later)
        try:
            return sched.schedule(now)
        finally:
            held.difference_update(later)

    def push(self, out: SchedulerOutput, handle: H, start: float) -> None:
        """Holds ``out``'s requests in flight until ``pop`` hands the batch back."""
        if self.full:
            raise RuntimeError(f"the batch queue is full ({self.depth} in flight).")
        held = self.scheduler.in_flight
        for sr in out.scheduled:
            rid = sr.request.request_id
            if rid in held:  # a cheap invariant: the scheduler skips requests in flight
                raise RuntimeError(f"request {rid!r} is already in a batch in flight.")
            held.add(rid)
        self._batches.append(InFlightBatch(out, handle, start))
        self.max_in_flight = max(self.max_in_flight, len(self._batches))

    def oldest(self) -> InFlightBatch[H]:
        return self._batches[0]

    def pop(self) -> InFlightBatch[H]:
        """The oldest batch; its requests may be scheduled again."""
        batch = self._batches.popleft()
        self.scheduler.in_flight.difference_update(sr.request.request_id for sr in batch.out.scheduled)
        return batch
