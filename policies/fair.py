"""Virtual Token Counter fairness (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024).

Each tenant has a virtual counter of the service it received, weighted per tenant. Admitting a
request adds ``w_in * input_tokens / weight``; every generated token adds ``w_out / weight``. The
backlogged tenant with the smallest counter is served next. A tenant whose queue goes from empty
to non-empty is lifted to the minimum counter among backlogged tenants (or, when none is, to the
counter of the last tenant served), so idling cannot bank credit: this is what bounds the service
difference between backlogged tenants.

State is kept for active tenants only (a waiting or running request), so clients that invent
tenant names cannot grow it without bound:

- ``_heap`` holds ``(counter, seq, tenant, episode)`` for backlogged tenants, a min-heap with
  lazy deletion. Counters only grow, so an entry's key is at most its tenant's counter; ``peek``
  re-keys a stale top and drops entries of tenants no longer backlogged (or of an older backlog
  episode), so the first current entry is the minimum. add/peek/pop/remove are O(log tenants)
  amortised; the heap is rebuilt when stale entries outnumber live ones.
- A tenant with no waiting or running request is forgotten. When it returns it is lifted to the
  floor (the backlogged minimum, or the last served counter), as a new tenant is. This is exactly
  what VTC does when the tenant's old counter was at most the floor by then; otherwise VTC would
  have kept the higher counter, and forgetting it credits the tenant with at most the service it
  got after its last request was admitted (the cost of its in-flight requests, which is what
  VTC's bound on the service gap already allows for), so the bounded-gap property holds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from twinserve.core.policy import FifoQueue, SchedulingPolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register

_COMPACT_SLACK = 64  # heap entries allowed beyond twice the backlogged tenants before a rebuild


@dataclass(slots=True)
class _Tenant:
    """One active tenant: its waiting queue, how many of its requests are alive (waiting or
    running, forked samples included) and its backlog episode (heap entries of older ones are
    stale)."""

    seq: int  # arrival order of the tenant: ties between equal counters go to the older one
    queue: FifoQueue = field(default_factory=FifoQueue)
    live: int = 0
    episode: int = 0


@register("fair")
class VTCPolicy(SchedulingPolicy):
    accounts_tokens = True

    def __init__(self, w_in: float = 1.0, w_out: float = 2.0,
                 tenant_weights: dict[str, float] | None = None) -> None:
        if w_in < 0 or w_out < 0:
            raise ValueError(f"w_in and w_out must be non-negative, got {w_in}, {w_out}")
        for tenant, w in (tenant_weights or {}).items():
            if w <= 0:
                raise ValueError(f"tenant_weights[{tenant!r}] must be positive, got {w}")
        self.w_in = w_in
        self.w_out = w_out
        self.tenant_weights = dict(tenant_weights or {})
        self.counters: dict[str, float] = {}  # active tenants only
        self._tenants: dict[str, _Tenant] = {}
        self._heap: list[tuple[float, int, str, int]] = []
        self._seq = itertools.count()
        self._num_waiting = 0
        self._num_backlogged = 0
        self._last_served = 0.0

    # ---- what the tests and reports read -------------------------------------------------
    @property
    def num_tenants(self) -> int:
        """Tenants with state (an active request)."""
        return len(self._tenants)

    @property
    def heap_size(self) -> int:
        return len(self._heap)

    def _weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    # ---- the backlog heap ------------------------------------------------------------------
    def _top(self) -> tuple[str, _Tenant] | None:
        """The backlogged tenant with the smallest counter (stale entries dropped on the way)."""
        heap, tenants, counters = self._heap, self._tenants, self.counters
        while heap:
            key, seq, name, episode = heap[0]
            state = tenants.get(name)
            if state is None or state.episode != episode or state.queue.num_live == 0:
                heapq.heappop(heap)
                continue
            current = counters[name]
            if current != key:  # served since it was pushed: re-key, look again
                heapq.heapreplace(heap, (current, seq, name, episode))
                continue
            return name, state
        return None

    def _floor(self) -> float:
        top = self._top()
        return self._last_served if top is None else self.counters[top[0]]

    def _push(self, name: str, state: _Tenant) -> None:
        state.episode += 1
        heapq.heappush(self._heap, (self.counters[name], state.seq, name, state.episode))
        self._num_backlogged += 1
        if len(self._heap) > 2 * self._num_backlogged + _COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        self._heap = [(self.counters[name], s.seq, name, s.episode)
                      for name, s in self._tenants.items() if s.queue.num_live > 0]
        heapq.heapify(self._heap)

    def _left_backlog(self, name: str, state: _Tenant) -> None:
        """``state``'s queue just emptied (its heap entry goes stale)."""
        self._num_backlogged -= 1
        self._maybe_forget(name, state)

    def _maybe_forget(self, name: str, state: _Tenant) -> None:
        if state.live <= 0 and state.queue.num_live == 0:
            del self._tenants[name]
            del self.counters[name]

    # ---- waiting queue -------------------------------------------------------------------
    def _enqueue(self, request: Request, front: bool, arrival: bool) -> None:
        name = request.tenant
        state = self._tenants.get(name)
        if state is None:
            state = self._tenants[name] = _Tenant(next(self._seq))
        if arrival:
            state.live += request.sampling_params.n  # the request and the samples it will fork
        queue = state.queue
        if queue.num_live == 0:  # from empty to non-empty: lift, then enter the heap
            floor = self._floor()
            self.counters[name] = max(self.counters.get(name, floor), floor)
            (queue.add_front if front else queue.add)(request)
            self._push(name, state)
        else:
            (queue.add_front if front else queue.add)(request)
        self._num_waiting += 1

    def add(self, request: Request) -> None:
        self._enqueue(request, front=False, arrival=True)

    def requeue(self, request: Request) -> None:
        self._enqueue(request, front=True, arrival=False)

    def peek(self) -> Request | None:
        top = self._top()
        return None if top is None else top[1].queue.peek()

    def pop(self) -> Request:
        top = self._top()
        if top is None:
            raise IndexError("pop from an empty queue")
        name, state = top
        self._last_served = self.counters[name]
        request = state.queue.pop()
        self._num_waiting -= 1
        if state.queue.num_live == 0:
            self._left_backlog(name, state)
        return request

    def remove(self, request: Request) -> None:
        name = request.tenant
        state = self._tenants.get(name)
        if state is None:
            return
        state.queue.remove(request)
        self._num_waiting -= 1
        if state.queue.num_live == 0:
            self._left_backlog(name, state)

    def __len__(self) -> int:
        return self._num_waiting

    # ---- accounting ----------------------------------------------------------------------
    def on_admit(self, request: Request, now: float, first_time: bool) -> None:
        if first_time:
            self._charge(request.tenant, self.w_in * request.num_prompt_tokens)

    def on_output_tokens(self, request: Request, num_tokens: int) -> None:
        self._charge(request.tenant, self.w_out * num_tokens)

    def _charge(self, tenant: str, service: float) -> None:
        try:  # every active tenant has a counter (set by the lift when it was queued)
            self.counters[tenant] += service / self._weight(tenant)
        except KeyError:  # a tenant the policy was never told of: nothing to account
            pass

    def on_finish(self, request: Request) -> None:
        name = request.tenant
        state = self._tenants.get(name)
        if state is None:
            return
        n = request.sampling_params.n
        if request.parent_id is None and n > 1 and request.num_output_tokens == 0:
            state.live -= n  # ended before its samples were forked: they never will be
        else:
            state.live -= 1
        self._maybe_forget(name, state)

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The latest-admitted request of the most-served tenant."""
        top = max(self.counters.get(r.tenant, 0.0) for r in running)
        for request in reversed(running):
            if self.counters.get(request.tenant, 0.0) == top:
                return request
        return running[-1]
