"""LoRA affinity: admit first the waiting requests whose adapter is already on the device, so a
batch keeps to its resident adapters and needs fewer loads, while a request that has waited
``max_wait_s`` goes first and gets the next adapter slot that frees.

Order of ``peek``; the arrival queue holds the waiting requests in arrival order, preempted ones
back at its front (as in fcfs):

1. LoRA disabled (no slots attached): the arrival queue's head, i.e. fcfs.
2. The arrival queue's head once it has waited more than ``max_wait_s`` (at the step's clock,
   ``on_schedule``).
3. Else the earliest request that needs no load: one without an adapter, or whose adapter is
   resident (``LoRASlots.is_resident``; running adapters are).
4. Else the arrival queue's head, whose adapter will be loaded into a free slot; ``None`` when no
   slot is free (the scheduler would pass over every request left).

Rule 2 alone does not bound the wait: an overdue request whose adapter finds all ``max_loras``
slots pinned by running adapters is passed over, and new requests of those adapters would keep
them pinned. So when the scheduler pops an overdue request it cannot admit for want of a slot,
one running adapter is *closed*: none of its waiting requests is admitted until it has drained and
its slot is free. It is the one with the fewest waiting requests (closing it turns away the least
work), then the one closest to done (fewest tokens left to the ``max_tokens`` of its running
requests: exact in the twin, an upper bound on a real engine). For the rest of that step rule 2
is off (the overdue requests behind it would be passed over as well).

Structure: one FIFO of entries per adapter (``None``: the base model) and the arrival FIFO, both
holding the same entry objects in sequence order; an entry popped through one is marked dead and
skipped lazily by the other. ``peek`` reads the heads of the resident adapters' queues:
O(max_loras) per call, amortised O(1) in the number of waiting requests; choosing the adapter to
close reads the running requests of the running adapters (at most once a step).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from typing import TYPE_CHECKING, ClassVar

from twinserve.core.policy import SchedulingPolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register

if TYPE_CHECKING:
    from twinserve.core.lora import LoRASlots


class _Entry:
    """A waiting request's place: ``seq`` orders entries (front insertions get negative ones)."""

    __slots__ = ("request", "seq", "live")

    def __init__(self, request: Request, seq: int) -> None:
        self.request = request
        self.seq = seq
        self.live = True


def _head(queue: deque[_Entry]) -> _Entry | None:
    """The first live entry of a queue whose request still waits; drops the ones before it."""
    while queue:
        entry = queue[0]
        if entry.live and not entry.request.is_finished:
            return entry
        queue.popleft()
    return None


@register("lora_affinity")
class LoRAAffinityPolicy(SchedulingPolicy):
    """Resident adapters first, in arrival order, within a ``max_wait_s`` bound (see module)."""

    wants_clock: ClassVar[bool] = True

    def __init__(self, max_wait_s: float = 2.0) -> None:
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) \
                or math.isnan(max_wait_s) or max_wait_s < 0:
            raise ValueError(f"max_wait_s must be a number >= 0 (inf: no bound), got "
                             f"{max_wait_s!r}.")
        self.max_wait_s = float(max_wait_s)
        self._arrivals: deque[_Entry] = deque()
        self._by_lora: dict[str | None, deque[_Entry]] = {}
        self._running: dict[str, set[Request]] = {}  # admitted requests by adapter
        self._waiting: dict[str | None, int] = {}  # live waiting requests by adapter
        self._slots: LoRASlots | None = None
        self._seq = itertools.count()
        self._front_seq = itertools.count(-1, -1)
        self._num_live = 0
        self._now = -math.inf
        self._blocked = False  # this step passed over an overdue request (no slot for it)
        self._closing: str | None = None  # the adapter admitting no one until it drains
        self._peeked: _Entry | None = None  # what peek returned, until the queue changes

    # ---- LoRA and the clock ----------------------------------------------------------------
    def attach_lora_slots(self, slots: LoRASlots) -> None:
        self._slots = slots

    def on_schedule(self, now: float) -> None:
        self._now = now
        self._blocked = False
        self._peeked = None

    # ---- waiting queue -------------------------------------------------------------------
    def add(self, request: Request) -> None:
        self._insert(_Entry(request, next(self._seq)), front=False)

    def requeue(self, request: Request) -> None:
        """A preempted request resumes before later arrivals (as in fcfs)."""
        self._left_batch(request)
        self._insert(_Entry(request, next(self._front_seq)), front=True)

    def unpop(self, request: Request) -> None:
        """Passed-over requests needed a slot, so they came from the arrival queue's head; put
        back at its front in reverse pop order, they are where they were."""
        self._insert(_Entry(request, next(self._front_seq)), front=True)

    def remove(self, request: Request) -> None:
        self._num_live -= 1  # already marked finished: dropped where it is reached
        self._waiting[request.lora] -= 1
        self._peeked = None

    def __len__(self) -> int:
        return self._num_live

    def peek(self) -> Request | None:
        entry = self._choose()
        self._peeked = entry
        return entry.request if entry is not None else None

    def pop(self) -> Request:
        entry = self._peeked if self._peeked is not None else self._choose()
        if entry is None:
            raise IndexError("pop from an empty queue")
        self._peeked = None
        entry.live = False
        self._num_live -= 1
        lora = entry.request.lora
        self._waiting[lora] -= 1
        queue = self._by_lora[lora]
        if queue[0] is entry:  # the usual case; otherwise dropped lazily
            queue.popleft()
        self._note_pass_over(entry.request)
        return entry.request

    # ---- accounting ----------------------------------------------------------------------
    def on_admit(self, request: Request, now: float, first_time: bool) -> None:
        if request.lora is not None:
            self._running.setdefault(request.lora, set()).add(request)

    def on_finish(self, request: Request) -> None:
        self._left_batch(request)

    def _left_batch(self, request: Request) -> None:
        if request.lora is not None:
            self._running.get(request.lora, set()).discard(request)

    # ---- the order -----------------------------------------------------------------------
    def _insert(self, entry: _Entry, front: bool) -> None:
        lora = entry.request.lora
        queue = self._by_lora.get(lora)
        if queue is None:
            queue = self._by_lora[lora] = deque()
        if front:
            self._arrivals.appendleft(entry)
            queue.appendleft(entry)
        else:
            self._arrivals.append(entry)
            queue.append(entry)
        self._num_live += 1
        self._waiting[lora] = self._waiting.get(lora, 0) + 1
        self._peeked = None

    def _choose(self) -> _Entry | None:
        head = _head(self._arrivals)
        slots = self._slots
        if head is None or slots is None:
            return head
        closing = self._closing
        if closing is not None and closing not in slots.users:  # drained: its slot is free
            closing = self._closing = None
        lora = head.request.lora
        if not self._blocked and lora != closing and self._overdue(head.request):
            return head
        best = self._queue_head(None)
        for name in slots.slot_of:  # the resident adapters: at most max_loras
            entry = self._queue_head(name) if name != closing else None
            if entry is not None and (best is None or entry.seq < best.seq):
                best = entry
        if best is not None:
            return best
        if lora is not None and (lora == closing or not slots.can_acquire(lora)):
            return None  # it would be passed over, and so would every request left
        return head

    def _queue_head(self, lora: str | None) -> _Entry | None:
        queue = self._by_lora.get(lora)
        return _head(queue) if queue else None

    def _overdue(self, request: Request) -> bool:
        return self._now - request.arrival_time > self.max_wait_s

    def _note_pass_over(self, request: Request) -> None:
        """``request`` was popped: if it is overdue and finds no slot it will be passed over,
        so close a running adapter (unless one is closing already)."""
        slots = self._slots
        if slots is None or request.lora is None or slots.can_acquire(request.lora) \
                or not self._overdue(request):
            return
        self._blocked = True
        if self._closing is None and slots.users:
            self._closing = min(slots.users, key=self._closing_cost)

    def _closing_cost(self, lora: str) -> tuple[int, int]:
        """Waiting requests turned away by closing ``lora``, then how long it takes to drain."""
        return self._waiting.get(lora, 0), self._tokens_left(lora)

    def _tokens_left(self, lora: str) -> int:
        """The most output tokens any running request of ``lora`` may still generate."""
        return max((r.max_output_tokens - r.num_output_tokens
                    for r in self._running.get(lora, ())), default=0)
