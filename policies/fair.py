"""Virtual Token Counter fairness (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024).

Each tenant has a virtual counter of the service it received, weighted per tenant. Admitting a
request adds ``w_in * input_tokens / weight``; every generated token adds ``w_out / weight``. The
backlogged tenant with the smallest counter is served next. A tenant whose queue goes from empty
to non-empty is lifted to the minimum counter among backlogged tenants (or, when none is, to the
counter of the last tenant served), so idling cannot bank credit: this is what bounds the service
difference between backlogged tenants.
"""

from __future__ import annotations

from collections.abc import Sequence

from twinserve.core.policy import FifoQueue, SchedulingPolicy
from twinserve.core.request import Request
from twinserve.policies.registry import register


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
        self.counters: dict[str, float] = {}
        self._queues: dict[str, FifoQueue] = {}
        self._last_served = 0.0

    def _weight(self, tenant: str) -> float:
        return self.tenant_weights.get(tenant, 1.0)

    def _backlogged(self) -> list[str]:
        return [t for t, q in self._queues.items() if len(q) > 0]

    def _lift(self, tenant: str) -> None:
        others = [self.counters[t] for t in self._backlogged() if t != tenant]
        floor = min(others) if others else self._last_served
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def _enqueue(self, request: Request, front: bool) -> None:
        queue = self._queues.get(request.tenant)
        if queue is None:
            queue = self._queues[request.tenant] = FifoQueue()
        if len(queue) == 0:
            self._lift(request.tenant)
        (queue.add_front if front else queue.add)(request)

    def add(self, request: Request) -> None:
        self._enqueue(request, front=False)

    def requeue(self, request: Request) -> None:
        self._enqueue(request, front=True)

    def _next_tenant(self) -> str | None:
        best = None
        for tenant, queue in self._queues.items():
            if queue.peek() is not None and (best is None or self.counters[tenant] < self.counters[best]):
                best = tenant
        return best

    def peek(self) -> Request | None:
        tenant = self._next_tenant()
        return None if tenant is None else self._queues[tenant].peek()

    def pop(self) -> Request:
        tenant = self._next_tenant()
        if tenant is None:
            raise IndexError("pop from an empty queue")
        self._last_served = self.counters[tenant]
        return self._queues[tenant].pop()

    def remove(self, request: Request) -> None:
        self._queues[request.tenant].remove(request)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def on_admit(self, request: Request, now: float, first_time: bool) -> None:
        if first_time:
            self.counters[request.tenant] += (
                self.w_in * request.num_prompt_tokens / self._weight(request.tenant))

    def on_output_tokens(self, request: Request, num_tokens: int) -> None:
        # Every tenant with a request has a counter (set by _lift when it was queued).
        self.counters[request.tenant] += self.w_out * num_tokens / self._weight(request.tenant)

    def select_victim(self, running: Sequence[Request]) -> Request:
        """The latest-admitted request of the most-served tenant."""
        top = max(self.counters.get(r.tenant, 0.0) for r in running)
        for request in reversed(running):
            if self.counters.get(request.tenant, 0.0) == top:
                return request
        return running[-1]
