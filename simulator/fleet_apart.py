"""A fleet behind a router that reads nothing of the replicas, each replica in a SimPy
environment of its own.

Behind such a router (round robin) the replicas act on one another through nothing: where a
request goes is decided without them. In one environment their steps still interleave at every
arrival, so each replica's state (its running requests, its KV blocks, which cycle through the
free queue) is touched again only after the other replicas' states have been: the same
instructions as lone replicas', with more cache misses (``docs/performance.md``). Apart, each
replica runs through many of its arrivals in a row.

What each replica sees stays exactly as in the shared environment (``engine._routed_ahead``),
so its event order does, ties included: ``RoutedAhead`` replays the shared arrival process's
routing ahead, and each replica's own arrival process (``own_arrivals``) waits for every
request's arrival, its own or not, as that process does, which makes its arrival events at the
same times, from the same times. The replicas' horizons (``ArrivalHorizons``) hold the same
values at the same times. The environments run in turns up to the arrival times of every
``_TURN``-th request per replica, which bounds what is routed and not yet released.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field

import simpy

from twinserve.core.request import Request
from twinserve.core.step_driver import RunRecorder
from twinserve.routers import ReplicaLoad, Router
from twinserve.simulator.engine import _ROUTE_AHEAD, ArrivalHorizons, Replica, _release

# Requests per replica between two turns of the environments.
_TURN = 256


@dataclass(slots=True)
class RoutedAhead:
    """``engine._routed_ahead``'s routing, replayed without SimPy: each routed request's arrival
    time and replica (``arrival``), each replica's requests in order (``take``), and, at the
    ``k``-th release, how many were routed by then and the latest routed one's arrival time
    (``step``). The replicas read the routed requests through compact columns, not the
    requests: a replica touches only its own. Entries every replica passed are dropped
    (``forget_before``)."""

    source: Iterator[Request]
    router: Router
    num_replicas: int
    # the columns, from the ``_first``-th routed request and release on
    _times: array = field(default_factory=lambda: array("d"))
    _replicas: array = field(default_factory=lambda: array("l"))
    _first: int = 0
    _own: list[deque[Request]] = field(default_factory=list)  # routed, not taken, per replica
    _pending: list[int] = field(default_factory=list)  # routed and not released, per replica
    _steps: list[tuple[int, float]] = field(default_factory=list)  # (routed, read_until) per release
    _read_until: float = 0.0
    _loads: list[ReplicaLoad] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}.")
        self._own = [deque() for _ in range(self.num_replicas)]
        self._pending = [0] * self.num_replicas
        self._loads = [ReplicaLoad(0, 0, 0.0) for _ in range(self.num_replicas)]  # never read

    def step(self, k: int) -> tuple[int, float] | None:
        """At the ``k``-th release (counted from 0): the requests routed by then and the
        horizon of a replica with none pending (``ArrivalHorizons.read_until``); None when
        every request was released before it (the horizon is then infinite)."""
        at, steps = k - self._first, self._steps
        if at < 0:
            raise IndexError(f"release {k} was forgotten (kept from {self._first}).")
        while len(steps) <= at:
            if not self._route_next():
                return None
        return steps[at]

    def _route_next(self) -> bool:
        """One turn of ``_routed_ahead``'s loop: route while some replica has none pending
        (at most ``_ROUTE_AHEAD`` per replica ahead), then release the oldest routed."""
        k, pending = self._first + len(self._steps), self._pending
        routed = self._first + len(self._times)
        while routed - k < _ROUTE_AHEAD * self.num_replicas and not all(pending):
            request = next(self.source, None)
            if request is None:
                self._read_until = math.inf
                break
            index = self.router.route(request, self._loads)
            pending[index] += 1
            self._own[index].append(request)
            self._times.append(request.arrival_time)
            self._replicas.append(index)
            routed += 1
            self._read_until = request.arrival_time
        if routed == k:
            return False
        self._steps.append((routed, self._read_until))
        pending[self._replicas[k - self._first]] -= 1
        return True

    def arrival(self, i: int) -> tuple[float, int]:
        """The ``i``-th routed request's arrival time and replica."""
        at = i - self._first
        if at < 0:
            raise IndexError(f"routed request {i} was forgotten (kept from {self._first}).")
        return self._times[at], self._replicas[at]

    def take(self, replica: int) -> Request:
        """The replica's next routed request, handed over."""
        return self._own[replica].popleft()

    def forget_before(self, i: int) -> None:
        """Drops the entries before the ``i``-th request and release (every replica passed
        them)."""
        n = min(i - self._first, len(self._steps))
        if n > 0:
            del self._times[:n], self._replicas[:n], self._steps[:n]
            self._first += n


def own_arrivals(env: simpy.Environment, routed: RoutedAhead, replica: Replica,
                 horizons: ArrivalHorizons, recorder: RunRecorder, cursor: list[int]):
    """The shared arrival process as one replica sees it: it waits for every request's arrival
    as that process does, releases its own, and keeps the replica's horizons as that process
    keeps them. ``cursor[replica.index]``: the next release it waits for."""
    me, arrival = replica.index, routed.arrival
    mine, seen, k = horizons.pending[me], 0, 0
    while True:
        got = routed.step(k)
        if got is None:
            horizons.read_until = math.inf
            return
        upto, horizons.read_until = got
        for i in range(seen, upto):  # (the requests routed at this turn)
            time, index = arrival(i)
            if index == me:
                mine.append(time)
        seen = upto
        time, index = arrival(k)
        delay = time - env.now
        if delay > 0:
            yield env.timeout(delay)
        if index == me:
            mine.popleft()
            _release(routed.take(me), replica, recorder)
        k += 1
        cursor[me] = k


def run_apart(replicas: Sequence[Replica], requests: Iterator[Request], router: Router,
              recorder: RunRecorder, arrival_times: Sequence[float],
              engine_loop: Callable[[simpy.Environment, Replica], Generator]) -> None:
    """Runs a fleet behind a router that reads nothing of the replicas (``routers.reads_loads``),
    each replica in its own environment (``engine_loop`` makes its engine process, which takes
    its horizon from ``replica.horizons``), in turns until every request was served."""
    routed = RoutedAhead(requests, router, len(replicas))
    cursor = [0] * len(replicas)
    envs = []
    for replica in replicas:
        env = simpy.Environment()
        replica.horizons = horizons = ArrivalHorizons([deque() for _ in replicas],
                                                      arrival_times=arrival_times)
        env.process(own_arrivals(env, routed, replica, horizons, recorder, cursor))
        env.process(engine_loop(env, replica))
        envs.append(env)
    turn = _TURN * len(replicas)
    for until in _turn_ends(arrival_times, turn):
        for env in envs:
            env.run(until=until)
        routed.forget_before(min(cursor))
    for env in envs:
        env.run()


def _turn_ends(arrival_times: Sequence[float], every: int) -> list[float]:
    """The arrival times of every ``every``-th request, from the ``every``-th, increasing."""
    ends: list[float] = []
    for t in arrival_times[every::every]:
        if t > 0 and (not ends or t > ends[-1]):
            ends.append(t)
    return ends
