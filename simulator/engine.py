"""The SimPy twin of the GPU: an arrival process and one engine process per replica.

Each engine process runs the very same step as the real engine::

    out = driver.schedule(env.now)                     # core.step_driver: the one step seam
    yield env.timeout(cost.step_time(out))             # the GPU, modelled (step_time.StepTimeModel)
    driver.complete(out, tokens, start, env.now)       # tokens end each request at its trace length

(The engine's clock runs ahead of SimPy's while no other process could act: see ``engine_process``.)

Requests carry ``max_tokens = output_tokens`` and ``ignore_eos``, so every request ends exactly at
its trace output length whatever token the twin "samples".
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import simpy

from twinserve.core.decode_run import DecodeRun
from twinserve.core.decode_run import plan_decode_run as plan
from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_events import KVCacheEvent
from twinserve.core.metrics import RequestRecord
from twinserve.core.outputs import ModelRunnerOutput, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler
from twinserve.core.step_driver import RunRecorder, StepDriver
from twinserve.routers import ReplicaLoad, Router, reads_kv_usage, reads_loads, uses_kv_events
from twinserve.simulator.acceptance import AcceptanceModel
from twinserve.simulator.fleet import LazyFits, PendingRun, strike
from twinserve.simulator.step_time import StepTimeModel

SIMULATED_TOKEN = 17
# What the twin "samples" for every request, every step: one immutable, shared token list (the
# scheduler only reads it).
_SAMPLED: Sequence[int] = (SIMULATED_TOKEN,)
# StepTimeModel.decode_run_ends, bound: (out, now, horizon, base, max_steps) -> ends or None
RunEnds = Callable[[SchedulerOutput, float, float, float, int], list[float] | None]


class SyntheticTokens:
    """The twin's backend of the step seam: every live request samples ``SIMULATED_TOKEN``.

    The output is one ``ModelRunnerOutput`` kept across steps, holding ``_SAMPLED`` for every
    live request id (a plain dict, so the scheduler's per-request lookup stays in C rather than
    a Python ``get``). With speculation (an ``AcceptanceModel``) each step gets its own output:
    a verification's accepted count is drawn (``simulator/acceptance.py``: per position, seeded
    per request and token), and every request asking for drafts gets
    ``num_draft_next`` synthetic ones, so the scheduler runs speculation as in the engine."""

    __slots__ = ("output", "acceptance")

    def __init__(self, acceptance: AcceptanceModel | None = None) -> None:
        self.output = ModelRunnerOutput({})
        self.acceptance = acceptance

    def admit(self, request_id: str) -> None:
        self.output.sampled_token_ids[request_id] = _SAMPLED  # type: ignore[assignment]

    def release(self, request_id: str) -> None:
        del self.output.sampled_token_ids[request_id]
        if self.acceptance is not None:
            self.acceptance.release(request_id)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.acceptance is None:
            return self.output
        return self._speculate(scheduler_output)

    def _speculate(self, out: SchedulerOutput) -> ModelRunnerOutput:
        num_accepted = self.acceptance.num_accepted  # type: ignore[union-attr]
        proposed = self.acceptance.num_proposed  # type: ignore[union-attr]
        sampled: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            rid = sr.request.request_id
            k = len(sr.spec_token_ids)
            newest = sr.start + sr.num_new_tokens  # the newest token's position after this step
            if k:
                # the first draft stands at token start + 1 (the entry's own token is at start)
                accepted = num_accepted(rid, sr.start + 1, k)
                sampled[rid] = [SIMULATED_TOKEN] * (accepted + 1)
                newest -= k - accepted  # rejected drafts leave no token behind
            else:
                sampled[rid] = _SAMPLED  # type: ignore[assignment]
            if sr.num_draft_next:
                # proposals follow the newest token: keyed by its position, each asked once
                found = proposed(rid, newest, sr.num_draft_next)
                if found:
                    drafts[rid] = [SIMULATED_TOKEN] * found
        return ModelRunnerOutput(sampled, spec_token_ids=drafts)


# Requests a reads-nothing router routes ahead of their release (ArrivalHorizons), per replica.
_ROUTE_AHEAD = 64


@dataclass(slots=True)
class ArrivalHorizons:
    """Lower bounds on when each replica of a fleet may next receive a request: its horizon.

    A router that reads the replicas' loads routes each request at its arrival, so every
    replica's bound is the next arrival (``read_until``). One that reads nothing (round robin)
    is asked ahead, so each replica's bound is its own next request (``pending``), or, when it
    has none among those routed ahead, the latest routed: later ones come no earlier.
    ``arrival_times``: every request's, sorted (None: unknown)."""

    pending: list[deque[float]]
    read_until: float = 0.0
    arrival_times: Sequence[float] | None = None

    def of(self, replica: int) -> float:
        queue = self.pending[replica]
        return queue[0] if queue else self.read_until

    def fewer_than(self, room: int, start: float, end: float) -> bool:
        """Whether fewer than ``room`` requests arrive within ``[start, end]`` (False when the
        arrival times are unknown)."""
        times = self.arrival_times
        return times is not None and bisect_right(times, end) - bisect_left(times, start) < room


@dataclass(slots=True)
class Replica:
    """One simulated engine: its step driver, its step-time model and its tokens."""

    index: int
    driver: StepDriver
    cost: StepTimeModel
    tokens: SyntheticTokens = field(default_factory=SyntheticTokens)
    wakeup: simpy.Event | None = None
    # Advance runs of decode-only steps at once (core.decode_run); False: step by step, the
    # reference. Only for step times that read the step's aggregates, not its entries' contexts.
    decode_runs: bool = True
    # Nothing that acts while a step runs reads what a decode run changes before its last
    # update: the only replica (the arrival process alone acts, reading running and waiting
    # counts), or replicas behind a router that reads only those counts. A run may then take in
    # the step during which the next arrival comes (see ``engine_process``).
    alone: bool = False
    # A fleet's horizons (None: the next event of any process). Replicas act on one another only
    # through the router, so each runs ahead up to its horizon, past the other replicas' events
    # (a fleet's run then sorts its step rows by time, as the step-by-step path interleaves them).
    horizons: ArrivalHorizons | None = None
    # Behind a router that reads the replicas (a fleet's replica, not ``alone``): its decode run
    # in progress, computed ahead and not applied, which the arrivals read (``simulator.fleet``),
    # and the KV events made since the last arrival read them, less those reported ahead.
    pending: PendingRun | None = None
    held_events: list[KVCacheEvent] = field(default_factory=list)
    # When its step in progress started (None: idle) and how long its last finished step took,
    # as a front sees them (``ReplicaLoad.step_elapsed_s``, ``last_step_s``). Set where the
    # loop waits on a step: a step run ahead ends before the next arrival, which never sees it.
    step_start: float | None = None
    last_step: float = 0.0

    def __post_init__(self) -> None:
        self.driver.on_release = self.tokens.release

    @property
    def lazy(self) -> bool:
        """Whether its decode runs go on through arrivals released elsewhere (``_lazy_run``)."""
        return self.horizons is not None and not self.alone and self.decode_runs

    @property
    def scheduler(self) -> Scheduler:
        return self.driver.scheduler


def arrival_process(env: simpy.Environment, requests: Iterable[Request], replicas: Sequence[Replica],
                    router: Router, recorder: RunRecorder, horizons: ArrivalHorizons | None = None):
    """Releases each request at its arrival time to the replica the router picks, which sees
    each replica as a real front would (``routers.ReplicaLoad``, and the replicas' KV events
    when it reads them). ``horizons``: kept up to date for a fleet's replicas; a router that
    reads nothing of the replicas (``routers.reads_loads``) is then asked ahead of time."""
    if horizons is not None and not reads_loads(router):
        yield from _routed_ahead(env, requests, replicas, router, recorder, horizons)
        return
    events, usage = uses_kv_events(router), reads_kv_usage(router)
    reads = reads_loads(router)  # (one that reads nothing gets the same unread loads)
    loads = [ReplicaLoad(0, 0, 0.0) for _ in replicas]
    for request in requests:
        delay = request.arrival_time - env.now
        if horizons is not None:
            horizons.read_until = request.arrival_time
        if delay > 0:
            yield env.timeout(delay)
        if reads:
            _read(replicas, router, env.now, usage, events, loads)
        _release(request, replicas[router.route(request, loads)], recorder)
    if horizons is not None:
        horizons.read_until = math.inf


def _read(replicas: Sequence[Replica], router: Router, now: float, usage: bool,
          events: bool, loads: list[ReplicaLoad]) -> None:
    """Every replica read once for an arrival: its KV events since the last read handed to the
    router where ``events`` (none to hand over: no call, as the DP front does), oldest first,
    its run in progress's evictions so far included; then its load as a front reads it (from
    its run in progress, if it has one), ``kv_usage`` 0.0 unless ``usage``
    (``routers.reads_kv_usage``), written into ``loads`` (the same objects every arrival:
    values the twin computed need no validation, and a router reads them only in ``route``)."""
    for i, replica in enumerate(replicas):
        sched, pending, start = replica.driver.scheduler, replica.pending, replica.step_start
        if events:
            found = sched.take_kv_events()
            if replica.held_events:
                found, replica.held_events = replica.held_events + found, []
            if pending is not None:
                found += pending.evictions()
            if found:
                router.on_kv_events(i, found)
        load = loads[i]
        load.step_elapsed_s = None if start is None else now - start
        load.last_step_s = replica.last_step
        if pending is not None:
            pending.refresh(load, usage)
        else:
            load.num_running, load.num_waiting = len(sched.running), sched.num_waiting
            load.kv_usage = sched.kv.usage if usage else 0.0
            load.num_prefill_tokens = sched.num_prefill_tokens


def _routed_ahead(env: simpy.Environment, requests: Iterable[Request], replicas: Sequence[Replica],
                  router: Router, recorder: RunRecorder, horizons: ArrivalHorizons):
    """``arrival_process`` for a router that reads nothing of the replicas: it routes requests
    ahead of their release until every replica has one coming (at most ``_ROUTE_AHEAD`` per
    replica), in the same order, so it picks as it would at their arrivals. (A replay runs the
    replicas apart instead, ``simulator.fleet_apart``, which replays this process exactly.)"""
    ahead: deque[tuple[Request, int]] = deque()
    pending = horizons.pending
    cap = _ROUTE_AHEAD * len(replicas)
    loads = [ReplicaLoad(0, 0, 0.0) for _ in replicas]  # never read
    source = iter(requests)
    while True:
        while len(ahead) < cap and not all(pending):
            request = next(source, None)
            if request is None:
                horizons.read_until = math.inf
                break
            index = router.route(request, loads)
            pending[index].append(request.arrival_time)
            ahead.append((request, index))
            horizons.read_until = request.arrival_time
        if not ahead:
            return
        request, index = ahead.popleft()
        delay = request.arrival_time - env.now
        if delay > 0:
            yield env.timeout(delay)
        pending[index].popleft()
        _release(request, replicas[index], recorder)


def _release(request: Request, replica: Replica, recorder: RunRecorder) -> None:
    """Adds the request to the replica's engine, waking it, or records its rejection."""
    try:
        replica.driver.add_request(request)
    except (ValueError, EngineOverloaded) as exc:  # can never run (400) or not now (503):
        # recorded as failed, as a server's client would see it
        recorder.requests.append(rejected_record(request, str(exc), replica.index))
        if recorder.on_finish:
            recorder.on_finish(1)
        return
    replica.tokens.admit(request.request_id)
    if replica.wakeup is not None and not replica.wakeup.triggered:
        replica.wakeup.succeed()


def engine_process(env: simpy.Environment, replica: Replica):
    """One replica's engine loop: schedule, let the modelled GPU take its time, update.

    SimPy's clock is moved only when another process could act. A step that ends before every
    other pending event (the next arrival, the other replicas' steps) runs without an event of
    its own: the loop keeps the time in ``now`` and yields once something else is due. The times
    are the very floats SimPy would have produced (``start + duration`` each step; a step is only
    run ahead when one addition brings SimPy's clock exactly to its end), so only the number of
    events differs, not the results. A lone replica's decode run also takes in the step during
    which the next event comes: the run yields for it before it applies its steps, as the
    step-by-step path yields between that step's schedule and its update (a fleet's replicas
    too, behind a router that reads nothing of them). The step after, which admits what
    arrived, then closes the run (``_closing_step``) where the scheduler allows it. A fleet's
    replica takes its horizon from ``ArrivalHorizons`` instead of the next event of any process.
    """
    driver = replica.driver
    sched = driver.scheduler
    sampled = replica.tokens.output  # the backend's output: read-only token lists
    # with speculation each step draws its own output (acceptance, drafts)
    speculate = replica.tokens.execute if replica.tokens.acceptance is not None else None
    cost, timeout, peek = replica.cost, env.timeout, env.peek
    step_time = cost.step_time
    # driver.schedule and driver.complete with their lookups done once (this runs every step)
    schedule, complete = sched.schedule, driver.completer()
    complete_run, decode_runs = driver.complete_decode_run, replica.decode_runs
    alone, lazy = replica.alone, replica.lazy
    # A policy that hears each token (fair's counters) is read by an arrival's ``add``: a
    # run then applies its steps before the next arrival and leaves the step it comes
    # during to the step-by-step path, as the reference updates it after the arrival.
    if sched.policy.accounts_tokens:
        alone = lazy = False
    lazy_fits = LazyFits()  # (whether a run may go on through arrivals: ``_lazy_run``)
    horizons, index = replica.horizons, replica.index
    if horizons is not None:  # the horizon: its next arrival, not the other replicas' steps
        def peek() -> float:
            return horizons.of(index)
    # a model may compute a run's step ends in one call (_segment_ends has the reference)
    run_ends = cost.decode_run_ends
    merge = horizons is None  # (the horizon: the next event of any process)
    base = now = env.now  # SimPy's clock, and the engine's (ahead of it between events)
    # Only other processes schedule events, and they run only while this one waits: the next
    # event's time is read once per resumption.
    horizon = peek()
    while True:
        if not sched.running and not sched.has_unfinished_requests():
            replica.wakeup = env.event()
            replica.step_start = None
            yield replica.wakeup
            replica.wakeup = None
            base = now = env.now
            horizon = peek()
        out = schedule(now)
        # (a step that only preempted is the engine's too: nothing runs, the next one goes on)
        if not out.scheduled and not out.preempted_request_ids:
            raise RuntimeError(f"replica {replica.index}: scheduler made no progress at t={now}")
        duration = step_time(out)
        end = now + duration
        if end >= horizon or base + (end - base) != end:
            replica.step_start = now
            yield from _wait_for_step(timeout, base, now, duration, end, merge)
            base = end
            horizon = peek()
        complete(out, sampled if speculate is None else speculate(out), now, end)
        replica.last_step = end - now
        now = end
        # runs of decode-only steps follow one another while each reaches its last step (its
        # last request's finish, or the last step its free blocks cover) before anything else
        # is due, or takes in the step that crosses it
        run = plan(sched, SIMULATED_TOKEN) if decode_runs else None
        while run is not None:
            if lazy and lazy_fits(run):  # a fleet's: on through the arrivals released elsewhere
                now, base, horizon = yield from _lazy_run(replica, run, now, base, horizon,
                                                          timeout, peek)
                run = plan(sched, SIMULATED_TOKEN)
                continue
            ends = _decode_run_ends(run, step_time, run_ends, now, horizon, base)
            crossing = alone and len(ends) < run.max_steps
            if crossing:  # the next step ends at or past the horizon: SimPy catches up first
                start = ends[-1] if ends else now
                duration = step_time(run.out)
                replica.last_step = _last_step(ends, now, replica.last_step)
                replica.step_start = start
                yield from _wait_for_step(timeout, base, start, duration, start + duration,
                                          merge)
                base = start + duration
                ends.append(base)
                horizon = peek()
                if len(ends) < run.max_steps and len(sched.policy) and sched.admits_beside_runs:
                    free_after = run.open_closing(ends)
                    if free_after is not None:  # the arrival's step closes the run
                        now, base, horizon = yield from _closing_step(
                            replica, run, now, ends, free_after, base, horizon, peek, timeout)
                        run = plan(sched, SIMULATED_TOKEN)
                        continue
            elif not ends:
                break
            complete_run(run, now, ends)
            replica.last_step = _last_step(ends, now, replica.last_step)
            now = ends[-1]
            run = plan(sched, SIMULATED_TOKEN) if crossing or len(ends) == run.max_steps \
                else None


def _wait_for_step(timeout: Callable[[float], simpy.Event], base: float, start: float,
                   duration: float, end: float, merge: bool):
    """Waits in SimPy for a step from ``start`` to ``end`` (``start + duration``), SimPy's
    clock being at ``base`` (the engine's ran ahead to ``start``; no event falls between):
    caught up to ``start``, then ``duration`` on, so SimPy resumes the engine at exactly ``end``.

    ``merge``: the horizon was the next event of any process, so nothing acts at ``base`` after
    this (else the horizon would have been ``base``, and ``start`` too), and nothing before
    ``end``: one event to ``end`` then, where one addition lands exactly on it. It orders
    among the events due at ``end`` as the second of the two would: after every one made
    before ``start``, as none is made between. Fleet replicas (horizons: their own next
    arrival) take the two events: another replica's process may act at ``base``."""
    if start != base:
        if merge and base + (end - base) == end:
            yield timeout(end - base)
            return
        yield timeout(start - base)
    yield timeout(duration)


def _closing_step(replica: Replica, run: DecodeRun, now: float, ends: list[float],
                  free_after: list[int], base: float, horizon: float,
                  peek: Callable[[], float], timeout: Callable[[float], simpy.Event]):
    """The step after ``ends`` of a run, which takes in the requests that arrived meanwhile
    beside the run's decodes (``DecodeRun.open_closing`` done): scheduled, timed (SimPy
    catches up first where it ends at or past the horizon, as for a full step), then the run
    applied with it. Returns the engine loop's clocks after it (now, base, horizon)."""
    sched = replica.driver.scheduler
    waiting = len(sched.policy)  # the queue after the step before (the run's last row)
    start = ends[-1]
    run.next_step()  # ``out`` from the step before to this one
    if run.taken == run.stops[run.segment]:
        run.next_segment()
    out = sched.schedule_beside_run(run.out, start)
    duration = replica.cost.step_time(out)
    end = start + duration
    if end >= horizon or base + (end - base) != end:
        replica.last_step = _last_step(ends, now, replica.last_step)
        replica.step_start = start
        yield from _wait_for_step(timeout, base, start, duration, end,
                                  replica.horizons is None)
        base = end
        horizon = peek()
    replica.driver.complete_closing_run(run, out, replica.tokens.output, now, [*ends, end],
                                        free_after, waiting)
    replica.last_step = end - start
    return end, base, horizon


def _lazy_run(replica: Replica, run: DecodeRun, now: float, base: float, horizon: float,
              timeout: Callable[[float], simpy.Timeout], peek: Callable[[], float]):
    """A fleet replica's decode run behind a router that reads the replicas: the run goes on
    through every arrival that is not released to this replica.

    Each step that ends at or past the horizon (the next arrival) is taken in, as a lone
    replica's run takes it in: SimPy is caught up to its start and waits for its end, while the
    arrival reads the replica from the run (``replica.pending``, ``simulator.fleet``). After it,
    the run goes on if nothing was released to the replica, else the next step, which admits
    the request (it waits for that step, as in the reference), closes the run as a lone
    replica's admission step does (``_closing_step``), or the run is applied where it cannot.

    With ``max_waiting_requests``, an admission counts the running requests (its free seats),
    which the unapplied run still holds after their ends: a step taken in after a finish could
    then refuse a request the reference takes. It cannot while fewer requests are queued than
    the bound, so such a step is taken in only where fewer arrive during it (of any replica's)
    than the room left in the queue; else the run is applied before it (the step is then the
    engine loop's, as a run that stops at the horizon leaves it). Returns the engine's clock,
    SimPy's and the horizon after it."""
    cost, sched = replica.cost, replica.scheduler
    step_time, run_ends = cost.step_time, cost.decode_run_ends
    pending = replica.pending = PendingRun(run)
    last, bound, horizons = run.max_steps, sched.config.max_waiting_requests, replica.horizons
    start, ends = now, []
    while True:
        limit = min(run.segment_steps(), last - run.taken)
        got = _segment_ends(run, step_time, run_ends, now, horizon, base, limit)
        ends += got
        if got:
            now = got[-1]
        if run.taken == last:
            break
        if len(got) == limit:  # a segment ended before the horizon: its finishes leave
            run.next_segment()
            continue
        duration = step_time(run.out)
        if bound is not None and run.stops[0] <= run.taken and not _room_for_arrivals(
                horizons, bound - sched.num_queued + 1, now, now + duration):
            break  # (past a finish: ``ends`` holds it)
        pending.crossing = len(ends)
        replica.last_step = _last_step(ends, start, replica.last_step)
        replica.step_start = now
        yield from _wait_crossing(timeout, base, now, duration)
        now = base = now + duration
        ends.append(base)
        horizon = peek()
        if run.taken + 1 == last or len(sched.policy):
            break
        run.next_step()
        if run.taken == run.stops[run.segment]:
            run.next_segment()
    replica.pending = None
    # a request released to it: the step after, which admits it, closes the run, as a lone
    # replica's does (the crossing step not yet moved past: ``_closing_step`` does it)
    free_after = (run.open_closing(ends) if len(sched.policy) and len(ends) < run.max_steps
                  and sched.admits_beside_runs else None)
    if free_after is None:
        replica.driver.complete_decode_run(run, start, ends)
        replica.last_step = _last_step(ends, start, replica.last_step)
    if pending.reported:  # the router heard these evictions at the arrivals
        replica.held_events += strike(sched.take_kv_events(), pending.reported)
    if free_after is None:
        return ends[-1], base, horizon
    return (yield from _closing_step(replica, run, start, ends, free_after, base, horizon, peek,
                                     timeout))


def _wait_crossing(timeout: Callable[[float], simpy.Timeout], base: float, start: float,
                   duration: float):
    """Waits in SimPy for a lazy run's crossing step, from ``start`` to ``start + duration``,
    SimPy's clock being at ``base``: one event where one addition lands exactly on its end
    (``_wait_for_step``'s merge), else caught up to ``start`` first.

    The merged event is made at ``base`` rather than ``start``, which moves it only among the
    events due at the step's end made in between. None is the arrival process's: the horizon,
    the next arrival, was read at ``base`` and falls after ``start``, and its event was made
    before. Only another replica's step may end at that very time, and replicas act on one
    another only through the arrivals' reads, so their order there changes nothing."""
    end = start + duration
    if start != base and base + (end - base) == end:
        yield timeout(end - base)
        return
    yield from _wait_crossing_plain(timeout, base, start, duration)


def _wait_crossing_plain(timeout: Callable[[float], simpy.Timeout], base: float, start: float,
                         duration: float):
    """``_wait_crossing`` as the step-by-step path waits: to ``start``, then for the step (the
    reference)."""
    if start != base:
        yield timeout(start - base)
    yield timeout(duration)


def _room_for_arrivals(horizons: ArrivalHorizons | None, room: int, start: float,
                       end: float) -> bool:
    """Whether fewer than ``room`` requests arrive within ``[start, end]``."""
    return horizons is not None and horizons.fewer_than(room, start, end)


def _last_step(ends: list[float], start: float, before: float) -> float:
    """The duration of the last of the run steps ``ends`` (the run started at ``start``);
    ``before`` when there is none."""
    if not ends:
        return before
    return ends[-1] - (ends[-2] if len(ends) > 1 else start)


def _decode_run_ends(run: DecodeRun, step_time: Callable[[SchedulerOutput], float],
                     run_ends: RunEnds, now: float, horizon: float, base: float) -> list[float]:
    """The end times of the run's steps that end before anything else is due (``horizon``)
    and where SimPy would put them, ``run.out`` moved past them, segment after segment."""
    ends: list[float] = []
    while True:
        limit = run.segment_steps()
        got = _segment_ends(run, step_time, run_ends, now, horizon, base, limit)
        ends += got
        if len(got) < limit or run.taken == run.max_steps:
            return ends
        now = got[-1]
        run.next_segment()


def _segment_ends(run: DecodeRun, step_time: Callable[[SchedulerOutput], float],
                  run_ends: RunEnds, now: float, horizon: float, base: float,
                  limit: int) -> list[float]:
    """At most ``limit`` step ends of the run's current batch: the model's closed loop
    (``run_ends``) where it has one, else ``step_time`` step by step, the reference."""
    closed = run_ends(run.out, now, horizon, base, limit)
    if closed is not None:
        run.next_steps(len(closed))
        return closed
    ends: list[float] = []
    for _ in range(limit):
        end = now + step_time(run.out)
        if end >= horizon or base + (end - base) != end:
            break
        ends.append(end)
        now = end
        run.next_step()
    return ends


def rejected_record(request: Request, error: str, replica: int = 0) -> RequestRecord:
    """The record of a request an engine (``replica``) refused (400 or 503), failed, as a
    client saw it."""
    nan = float("nan")
    return RequestRecord(request.request_id, request.arrival_time, nan, nan, nan,
                         request.num_prompt_tokens, 0, tenant=request.tenant,
                         priority=request.priority, lora=request.lora or "", finish_reason="",
                         success=False, error=error, replica=replica)
