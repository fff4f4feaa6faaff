"""The scheduling-policy contract, and the waiting queues policies are built from.

A policy decides three things: the order in which waiting requests are admitted, which running
request is the victim under memory pressure, and (optionally) accounting after each step. The
scheduler calls it identically in the real engine and the simulator.

Aborted requests are dropped lazily: the scheduler marks them finished and calls ``remove``; queues
skip finished entries when they reach them, so no operation is O(n) in the queue length.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

from twinserve.core.request import Request

if TYPE_CHECKING:
    from twinserve.core.lora import LoRASlots


class SchedulingPolicy(ABC):
    """Owns the waiting queue. Subclasses are registered by name in ``twinserve.policies``."""

    name: ClassVar[str] = ""
    # Whether the policy reads ``Request.priority`` (the server rejects ``priority`` otherwise).
    uses_priority: ClassVar[bool] = False
    # Whether ``on_output_tokens`` must be called (skipped otherwise, to save time per step).
    accounts_tokens: ClassVar[bool] = False
    # Whether ``on_schedule(now)`` must be called at the start of every step.
    wants_clock: ClassVar[bool] = False

    # ---- waiting queue -------------------------------------------------------------------
    @abstractmethod
    def add(self, request: Request) -> None:
        """A new request arrives."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The next request to admit, or None."""

    @abstractmethod
    def pop(self) -> Request:
        """Removes the request ``peek`` returned."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """A waiting request was aborted (already marked finished)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of live waiting requests."""

    def requeue(self, request: Request) -> None:
        """A preempted request returns to the waiting queue (default: like an arrival)."""
        self.add(request)

    def unpop(self, request: Request) -> None:
        """Puts back a request ``pop`` returned that the scheduler passed over this step (its
        LoRA adapter would have exceeded ``max_loras``); it should be where it was. Called in
        reverse pop order. Default: ``requeue``."""
        self.requeue(request)

    # ---- preemption ----------------------------------------------------------------------
    def select_victim(self, running: Sequence[Request]) -> Request:
        """Victim under memory pressure among ``running`` (admission order). Default: the most
        recently admitted, as in vLLM's FCFS."""
        return running[-1]

    def should_preempt(self, waiting: Request, victim: Request) -> bool:
        """May ``waiting`` take the place of running ``victim``? Default: never."""
        return False

    # ---- LoRA and the clock ----------------------------------------------------------------
    def attach_lora_slots(self, slots: LoRASlots) -> None:
        """With LoRA enabled, the scheduler's device slots (read-only for the policy): which
        adapters are resident (``is_resident``) and which can be admitted (``can_acquire``)."""

    def on_schedule(self, now: float) -> None:
        """A step is being scheduled at ``now`` (only if ``wants_clock``)."""

    # ---- accounting ----------------------------------------------------------------------
    def on_admit(self, request: Request, now: float, first_time: bool) -> None:
        """A waiting request was admitted into the running batch."""

    def on_output_tokens(self, request: Request, num_tokens: int) -> None:
        """``num_tokens`` were generated for ``request`` this step (if ``accounts_tokens``)."""

    def on_finish(self, request: Request) -> None:
        """``request`` ended (finished, stopped or aborted), wherever it was."""


class QueuePolicy(SchedulingPolicy):
    """A policy whose whole waiting queue is one ``FifoQueue`` or ``HeapQueue``: subclasses set
    ``self._queue`` and override only what differs (victim, requeue, ...)."""

    _queue: FifoQueue | HeapQueue

    def add(self, request: Request) -> None:
        self._queue.add(request)

    def peek(self) -> Request | None:
        return self._queue.peek()

    def pop(self) -> Request:
        return self._queue.pop()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def unpop(self, request: Request) -> None:
        self._queue.add_front(request)

    def __len__(self) -> int:
        return self._queue.num_live  # not len(): one Python call instead of two, every step


class _LazyQueue:
    """What both queues share: a live count, lazy removal, and ``pop`` as ``peek`` + drop head."""

    __slots__ = ("num_live",)

    def __init__(self) -> None:
        self.num_live = 0  # requests queued and not yet removed (``len``)

    def peek(self) -> Request | None:
        raise NotImplementedError

    def _drop_head(self) -> None:
        raise NotImplementedError

    def pop(self) -> Request:
        request = self.peek()
        if request is None:
            raise IndexError("pop from an empty queue")
        self._drop_head()
        self.num_live -= 1
        return request

    def remove(self, request: Request) -> None:
        self.num_live -= 1

    def __len__(self) -> int:
        return self.num_live


class FifoQueue(_LazyQueue):
    """Arrival-order queue with O(1) add, requeue-at-front, peek, pop and lazy removal."""

    __slots__ = ("_items",)

    def __init__(self) -> None:
        super().__init__()
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._items.append(request)
        self.num_live += 1

    def add_front(self, request: Request) -> None:
        self._items.appendleft(request)
        self.num_live += 1

    def peek(self) -> Request | None:
        items = self._items
        while items and items[0].is_finished:
            items.popleft()
        return items[0] if items else None

    def _drop_head(self) -> None:
        self._items.popleft()


class HeapQueue(_LazyQueue):
    """Queue ordered by ``key(request)`` (ties by insertion), lazy removal."""

    __slots__ = ("_heap", "_key", "_counter", "_front")

    def __init__(self, key: Callable[[Request], tuple]) -> None:
        super().__init__()
        self._heap: list[tuple[tuple, int, Request]] = []
        self._key = key
        self._counter = itertools.count()
        self._front = itertools.count(-1, -1)  # add_front's tie-breaks: ahead of every add

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), next(self._counter), request))
        self.num_live += 1

    def add_front(self, request: Request) -> None:
        """In key order, but ahead of the requests with an equal key (a popped head put back)."""
        heapq.heappush(self._heap, (self._key(request), next(self._front), request))
        self.num_live += 1

    def peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][2].is_finished:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def _drop_head(self) -> None:
        heapq.heappop(self._heap)
