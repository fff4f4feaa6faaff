"""First come, first served: vLLM's default."""

from __future__ import annotations

from twinserve.core.policy import FifoQueue, SchedulingPolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register


@register("fcfs")
class FCFSPolicy(SchedulingPolicy):
    """Arrival order; victim = most recently admitted; a preempted request goes back to the
    front of the queue so it resumes before later arrivals."""

    def __init__(self) -> None:
        self._queue = FifoQueue()

    def add(self, request: Request) -> None:
        self._queue.add(request)

    def requeue(self, request: Request) -> None:
        self._queue.add_front(request)

    def peek(self) -> Request | None:
        return self._queue.peek()

    def pop(self) -> Request:
        return self._queue.pop()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)
