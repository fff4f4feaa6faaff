"""A replica set and a sink for data-parallel front tests: the front is driven by the messages a
test hands it, with no replica process behind it."""

from __future__ import annotations

import time
from typing import Any

from twinserve.gpu.engine.dp_client import ReplicaEvent


class FakeReplicas:
    """Two replicas that report ready at once and then only what the test hands the front; the
    commands the front sends are kept in ``sent``. Their engines' clocks started ``ORIGINS``
    (``time.monotonic()``) ago, on the front's host."""

    size = 2
    shares_clock = True
    ORIGINS = (5.0, 2.0)  # seconds before the set was made

    def __init__(self, *args: Any) -> None:
        self.sent: list[tuple[int, tuple]] = []
        now = time.monotonic()
        self.origins = [now - ago for ago in self.ORIGINS]
        self._ready = [ReplicaEvent(i, "message", ("ready", self.origins[i], {}))
                       for i in range(self.size)]

    def start(self, index: int) -> None:
        pass

    def pid(self, index: int) -> int | None:
        return None

    def send(self, index: int, command: tuple) -> None:
        self.sent.append((index, command))

    def poll(self, timeout_s: float) -> list[ReplicaEvent]:
        ready, self._ready = self._ready, []
        if not ready:
            time.sleep(min(timeout_s, 0.01))
        return ready

    def shutdown(self) -> None:
        pass


class NullSink:
    """A request's output sink that drops what it is given."""

    def put(self, item: Any) -> None:
        pass


def inbox_reader(spec: Any, inbox: Any, outbox: Any) -> None:
    """A replica process that only reads its inbox until ``("stop",)`` (``replica_main``'s
    place, for tests of the replica set itself)."""
    while inbox.get(timeout=30) != ("stop",):
        pass
