"""First come, first served: vLLM's default."""

from __future__ import annotations

from twinserve.core.policy import FifoQueue, QueuePolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register


@register("fcfs")
class FCFSPolicy(QueuePolicy):
    """Arrival order; victim = most recently admitted; a preempted request goes back to the
    front of the queue so it resumes before later arrivals."""

    def __init__(self) -> None:
        self._queue: FifoQueue = FifoQueue()

    def requeue(self, request: Request) -> None:
        self._queue.add_front(request)
