"""Priority scheduling as in vLLM: lower ``priority`` first, ties by arrival."""

from __future__ import annotations

from collections.abc import Sequence

from twinserve.core.policy import HeapQueue, QueuePolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register


def _rank(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)


@register("priority")
class PriorityPolicy(QueuePolicy):
    """Heap by ``(priority, arrival_time)``; victim = max ``(priority, arrival_time)`` among
    running. With ``preempt_running`` (default on) a waiting request that outranks the victim
    takes its place when blocks or ``max_num_seqs`` run out."""

    uses_priority = True

    def __init__(self, preempt_running: bool = True) -> None:
        self.preempt_running = preempt_running
        self._queue = HeapQueue(_rank)

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_rank)

    def should_preempt(self, waiting: Request, victim: Request) -> bool:
        return self.preempt_running and _rank(waiting) < _rank(victim)
