"""Static batching: the baseline continuous batching is measured against (HF ``generate`` with a
fixed batch). A batch is formed from the head of the FIFO queue; once it is closed nobody else is
admitted until every request of that batch has finished, so a short request's slot idles until the
batch's longest request ends.

A batch closes when

- it holds ``batch_size`` requests, or
- the waiting queue runs dry (later arrivals wait for the next batch), or
- with ``batch_size=None`` ("as many as fit"), the engine refuses a candidate (no seat under
  ``max_num_seqs``, no KV blocks, or, without chunked prefill, no room in the step's token budget).
  The refusal is seen as ``peek`` being called again without the ``pop`` of the candidate it
  returned: the scheduler only re-peeks without popping after it gave up on the head of the queue.

A member preempted under memory pressure returns to a queue of its own and is re-admitted before any
new request (it still belongs to the batch). Forked samples of an n > 1 request are not tracked: the
batch ends with their parent.
"""

from __future__ import annotations

from twinserve.core.policy import FifoQueue, SchedulingPolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register


@register("static")
class StaticBatchingPolicy(SchedulingPolicy):
    """FIFO static batching; ``batch_size=None`` admits as many as the engine accepts."""

    def __init__(self, batch_size: int | None = None) -> None:
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive integer or None, got {batch_size!r}.")
        self.batch_size = batch_size
        self._queue = FifoQueue()  # new requests, arrival order
        self._requeued = FifoQueue()  # preempted members of the current batch
        self._members: set[str] = set()  # admitted, unfinished members of the current batch
        self._num_admitted = 0  # members admitted into the current batch so far
        self._closed = False
        self._pending: Request | None = None  # head returned by peek and not popped yet

    # ---- batch state ---------------------------------------------------------------------
    def _close(self) -> None:
        self._closed = True
        self._pending = None

    def _start_batch_if_drained(self) -> None:
        """Once every member has finished (closed or not), the next admission starts a batch."""
        if not self._members and (self._closed or self._num_admitted):
            self._closed = False
            self._num_admitted = 0

    # ---- waiting queue -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._queue.add(request)

    def requeue(self, request: Request) -> None:
        self._requeued.add_front(request)

    def unpop(self, request: Request) -> None:
        admitted_before = request.first_scheduled_time is not None
        (self._requeued if admitted_before else self._queue).add_front(request)

    def peek(self) -> Request | None:
        member = self._requeued.peek()
        if member is not None:
            return member
        self._start_batch_if_drained()
        if self._closed:
            return None
        if self._pending is not None and self.batch_size is None:
            self._close()  # the scheduler gave up on the last candidate: the batch is full
            return None
        head = self._queue.peek()
        if head is None:
            if self._members:
                self._close()  # the queue ran dry: later arrivals wait for the next batch
            return None
        self._pending = head
        return head

    def pop(self) -> Request:
        if self._requeued.peek() is not None:
            return self._requeued.pop()
        self._pending = None
        return self._queue.pop()

    def remove(self, request: Request) -> None:
        admitted_before = request.first_scheduled_time is not None
        (self._requeued if admitted_before else self._queue).remove(request)
        if request is self._pending:
            self._pending = None

    def __len__(self) -> int:
        return len(self._queue) + len(self._requeued)

    # ---- accounting ----------------------------------------------------------------------
    def on_admit(self, request: Request, now: float, first_time: bool) -> None:
        if not first_time:
            return
        self._members.add(request.request_id)
        self._num_admitted += 1
        if self.batch_size is not None and self._num_admitted >= self.batch_size:
            self._close()

    def on_finish(self, request: Request) -> None:
        self._members.discard(request.request_id)
