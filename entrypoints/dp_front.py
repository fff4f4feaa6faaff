"""The data-parallel front: one router over ``data_parallel_size`` engine processes.

Both the server (``openai/dp_async_engine.py``) and ``LLM(data_parallel_size=N)`` drive it. A
request is routed when it is submitted; its replica's outputs come back on the front's reader
thread and go to the request's ``Sink`` (an output, ``None`` once accepted, or the exception that
ends it). The reader also refreshes each replica's ``ReplicaLoad`` from the scheduler stats that
come with every step, hands the replica's KV events to the router, and sees a replica die:
its in-flight requests end with ``ReplicaDied``, the router marks it unhealthy and forgets
what it held, and it is restarted unless ``restart_dead_replicas`` is off.

The front's state is bounded: one entry per request in flight (bounded by the replicas'
queues) and one per replica.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from twinserve.core.engine_args import EngineArgs
from twinserve.core.errors import EngineOverloaded
from twinserve.core.metrics import RequestRecord, StepRecord
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import ADMISSION_RETRY_AFTER_S, SchedulerStats
from twinserve.core.step_sample import StepSample
from twinserve.gpu.engine.dp_client import ReplicaEvent, ReplicaInboxFull, make_replica_set
from twinserve.gpu.engine.engine_process import Refusal
from twinserve.routers import NoHealthyReplica, ReplicaLoad, Router, make_router, uses_kv_events

START_TIMEOUT_S = 600.0
POLL_S = 0.2
MAX_PENDING_RECORDS = 10_000  # finished-request records kept for the next metrics scrape
MAX_PENDING_STEPS = 100_000  # steps kept for the next ``take_steps`` (``record_steps``)
REPLICA_STATES = ("starting", "ready", "dead")


class ReplicaDied(RuntimeError):
    """The replica serving a request died; the request ended with it."""


class Sink(Protocol):
    def put(self, item: Any) -> None: ...


@dataclass(slots=True)
class ReplicaState:
    """One replica as the front sees it (``/health``, metrics)."""

    state: str = "starting"
    stats: SchedulerStats | None = None
    restarts: int = 0
    served: int = 0  # requests it accepted
    was_ready: bool = False
    config: dict[str, Any] | None = None  # its resolved configuration, as it reported when ready
    time_origin: float | None = None  # the ``time.monotonic()`` its engine's clock counts from


class DataParallelFront:
    def __init__(self, args: EngineArgs, usage_context: str, on_cuda: bool,
                 tokenize: Callable[[str], list[int]] | None = None,
                 router: Router | None = None, replica_args: Sequence[EngineArgs] = (),
                 record_steps: bool = False) -> None:
        if args.enable_lora:
            raise ValueError("enable_lora with data_parallel_size > 1 is not implemented.")
        self.args = args
        self.router = router if router is not None else make_router(args.router, args.block_size)
        self._tokenize = tokenize
        self._set = make_replica_set(args, usage_context, on_cuda, uses_kv_events(self.router),
                                     replica_args, record_steps)
        n = self._set.size
        self.loads = [ReplicaLoad(0, 0, 0.0, healthy=False) for _ in range(n)]
        self.replicas = [ReplicaState() for _ in range(n)]
        # when each replica's step in progress started, by the front's clock (None: idle): the
        # replica steps again as soon as its last step's message is out, or as an add reaches
        # it idle; the loads' step times (``ReplicaLoad.step_elapsed_s``) are read off these
        self._step_started: list[float | None] = [None] * n
        # per replica, the requests sent and not yet accepted, with their prompt tokens: a step
        # message's stats were taken before the replica read them, so they are added to its
        # load until a message accepts (or refuses) them (``_on_step``)
        self._unaccepted: list[dict[str, int]] = [{} for _ in range(n)]
        self._owner: dict[str, tuple[int, Sink]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Condition(self._lock)
        self.error: str | None = None
        self._refused_args = False  # a replica failed to start on a ValueError (bad arguments)
        self._records: deque[RequestRecord] = deque(maxlen=MAX_PENDING_RECORDS)
        self._steps: deque[tuple[StepRecord, StepSample]] = deque(maxlen=MAX_PENDING_STEPS)
        self._step_tokens: deque[tuple[int, int]] = deque(maxlen=MAX_PENDING_STEPS)
        # the ``time.monotonic()`` the records' times count from (``take_records``)
        self.time_origin = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="twinserve-dp-front", daemon=True)
        # (an LLM left without shutdown: replicas with workers are no daemons, see dp_client)
        atexit.register(self.shutdown)
        for i in range(n):
            self._set.start(i)
        self._reader.start()
        self._wait_ready(START_TIMEOUT_S)

    @property
    def size(self) -> int:
        return self._set.size

    @property
    def shares_clock(self) -> bool:
        """Whether the replicas run on the front's clock: arrivals are then stamped as the
        front takes them, and the records' times count from ``time_origin``."""
        return bool(self._set.shares_clock)

    @property
    def is_alive(self) -> bool:
        return not self._stop.is_set() and self.error is None and self._reader.is_alive()

    def pid(self, index: int) -> int | None:
        return self._set.pid(index)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not all(r.state == "ready" for r in self.replicas):
                failed = [i for i, r in enumerate(self.replicas) if r.state == "dead"]
                left = deadline - time.monotonic()
                if failed or left <= 0 or self.error is not None:
                    break
                self._ready.wait(left)
            failed = [i for i, r in enumerate(self.replicas) if r.state != "ready"]
        if failed:
            self.shutdown()
            reason = f"replicas {failed} did not start: {self.error or 'timed out'}"
            # (a replica's engine refusing its arguments: the caller's bad input, by name)
            raise (ValueError if self._refused_args else RuntimeError)(reason)

    # ---- requests ------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               kwargs: dict[str, Any], sink: Sink) -> int:
        """Routes the request and queues it on its replica; returns the replica. Its sink gets
        ``None`` when accepted, then outputs, or an exception (a refusal, ``ReplicaDied``)."""
        tokens = prompt if isinstance(prompt, list) else (
            self._tokenize(prompt) if self._tokenize is not None else [])
        routed = Request(request_id, list(tokens) or [0], params, 0.0)
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request_id {request_id!r} is already in flight.")
            now = time.monotonic()
            for load, started in zip(self.loads, self._step_started):
                load.step_elapsed_s = None if started is None else max(0.0, now - started)
            try:
                index = self.router.route(routed, self.loads)
            except NoHealthyReplica as exc:
                raise EngineOverloaded(f"no replica can serve now: {exc}", "no_healthy_replica",
                                       ADMISSION_RETRY_AFTER_S) from exc
            origin = self.replicas[index].time_origin
            if origin is not None and self.shares_clock and "arrival_time" not in kwargs:
                # arrived now, at the front (as vLLM's API server stamps it), not when the
                # replica reads the add after its step in progress: its TTFT counts that wait
                kwargs = {**kwargs, "arrival_time": now - origin}
            self._queue(index, ("add", request_id, prompt, params, kwargs), request_id, sink,
                        len(routed.prompt_token_ids))
        return index

    def _queue(self, index: int, command: tuple, request_id: str, sink: Sink,
               num_prompt_tokens: int = 0) -> None:
        """Sends an add to replica ``index`` and records its owner (the lock held); raises
        EngineOverloaded when the replica cannot take it. The load the next route reads counts
        the request before the replica's stats do (``num_prompt_tokens``: its prefill work)."""
        try:
            self._set.send(index, command)
        except ReplicaInboxFull as exc:
            raise EngineOverloaded(str(exc), "max_waiting_requests",
                                   ADMISSION_RETRY_AFTER_S) from exc
        except RuntimeError as exc:  # it died after its last load was read: not routed
            raise EngineOverloaded(f"{exc}; retry later", "replica_down",
                                   ADMISSION_RETRY_AFTER_S) from exc
        self._owner[request_id] = (index, sink)
        self._unaccepted[index][request_id] = num_prompt_tokens
        if self._step_started[index] is None:  # an idle replica steps as the add reaches it
            self._step_started[index] = time.monotonic()
        load = self.loads[index]
        load.num_waiting += 1
        load.num_prefill_tokens += num_prompt_tokens

    def abort(self, request_id: str) -> None:
        with self._lock:
            owner = self._owner.pop(request_id, None)
            if owner is not None:
                self._unaccepted[owner[0]].pop(request_id, None)
            if owner is not None and self.replicas[owner[0]].state == "ready":
                try:
                    self._set.send(owner[0], ("abort", request_id))
                except RuntimeError:
                    pass  # the replica died meanwhile: its requests are gone with it

    # ---- the reader thread ---------------------------------------------------------------
    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                for event in self._set.poll(POLL_S):
                    self._handle(event)
        except BaseException as exc:  # the front is broken: every waiter learns why
            self.error = f"{type(exc).__name__}: {exc}"
            with self._lock:
                owners, self._owner = self._owner, {}
                self._ready.notify_all()
            for _, sink in owners.values():
                sink.put(ReplicaDied(f"the data-parallel front failed: {self.error}"))

    def _handle(self, event: ReplicaEvent) -> None:
        if event.kind == "died":
            self._on_death(event.replica, event.message)
            return
        message = event.message
        if message[0] == "step":
            self._on_step(event.replica, *message[1:])
        elif message[0] == "ready":
            with self._lock:
                replica = self.replicas[event.replica]
                replica.state, replica.was_ready = "ready", True
                replica.config = message[2] if len(message) > 2 else None
                replica.time_origin = message[1] if len(message) > 1 else None
                # a replica that has not stepped yet holds nothing: zero gauges, as vLLM's show
                replica.stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
                self.loads[event.replica] = ReplicaLoad(0, 0, 0.0, healthy=True)
                self._ready.notify_all()
        elif message[0] == "failed":
            with self._lock:
                self.error = f"replica {event.replica}: {message[1]}"
                self._refused_args = message[1].startswith("ValueError: ")
                self.replicas[event.replica].state = "dead"
                self._ready.notify_all()

    def _on_step(self, index: int, outputs: list[Any], accepted: list[str],
                 refused: list[Refusal], stats: SchedulerStats, kv_events: list[Any],
                 records: list[RequestRecord],
                 steps: Sequence[tuple[StepRecord, StepSample]] = (),
                 step_tokens: Sequence[int] = ()) -> None:
        deliveries: list[tuple[Sink, Any]] = []
        origin = self.replicas[index].time_origin
        shift = 0.0 if origin is None or not self.shares_clock else origin - self.time_origin
        for record in records:  # (each replica's engine numbers itself 0, on its own clock)
            record.replica = index
            if shift:
                record.shift(shift)
        for row, _ in steps:
            row.replica = index
            row.time += shift
        with self._lock:
            self._records.extend(records)
            self._steps.extend(steps)
            self._step_tokens.extend((index, n) for n in step_tokens)
            replica = self.replicas[index]
            replica.stats = stats
            replica.served += len(accepted)
            now, started = time.monotonic(), self._step_started[index]
            last_step = self.loads[index].last_step_s if started is None else now - started
            unaccepted = self._unaccepted[index]
            for rid in accepted:
                unaccepted.pop(rid, None)
            for refusal in refused:
                unaccepted.pop(refusal.request_id, None)
            self.loads[index] = ReplicaLoad(stats.num_running, stats.num_waiting + len(unaccepted),
                                            min(1.0, max(0.0, stats.kv_cache_usage)), True,
                                            stats.num_prefill_tokens + sum(unaccepted.values()),
                                            None, max(0.0, last_step))
            busy = stats.num_running > 0 or stats.num_waiting > 0 or bool(unaccepted)
            self._step_started[index] = now if busy else None
            for rid in accepted:
                owner = self._owner.get(rid)
                if owner is not None:
                    deliveries.append((owner[1], None))
            for refusal in refused:
                owner = self._owner.pop(refusal.request_id, None)
                if owner is not None:
                    deliveries.append((owner[1], refusal.to_exception()))
            for out in outputs:
                owner = self._owner.get(out.request_id)
                if owner is None:
                    continue
                if out.finished:
                    del self._owner[out.request_id]
                deliveries.append((owner[1], out))
        if kv_events:
            self.router.on_kv_events(index, kv_events)
        for sink, item in deliveries:
            sink.put(item)

    def _on_death(self, index: int, exitcode: int | None) -> None:
        with self._lock:
            replica = self.replicas[index]
            restart = (replica.was_ready and self.args.restart_dead_replicas
                       and not self._stop.is_set())
            replica.state = "starting" if restart else "dead"
            if not replica.was_ready and self.error is None:
                self.error = f"replica {index} exited with code {exitcode} while starting"
            replica.stats = None
            self.loads[index] = ReplicaLoad(0, 0, 0.0, healthy=False)
            self._step_started[index] = None
            self._unaccepted[index].clear()
            lost = [rid for rid, (i, _) in self._owner.items() if i == index]
            sinks = [self._owner.pop(rid)[1] for rid in lost]
            if restart:
                replica.restarts += 1
            self._ready.notify_all()
        self.router.on_replica_reset(index)
        error = ReplicaDied(f"replica {index} died (exit code {exitcode}); its requests ended.")
        for sink in sinks:
            sink.put(error)
        if restart:
            try:
                self._set.start(index)
            except RuntimeError:  # (shut down meanwhile: nothing is to run again)
                pass

    # ---- state ---------------------------------------------------------------------------
    def health(self) -> list[str]:
        """Each replica's state (one of REPLICA_STATES)."""
        with self._lock:
            return [r.state for r in self.replicas]

    def snapshot(self) -> list[ReplicaState]:
        with self._lock:
            return [ReplicaState(r.state, r.stats, r.restarts, r.served, r.was_ready, r.config,
                                 r.time_origin) for r in self.replicas]

    def take_records(self) -> list[RequestRecord]:
        """The finished-request records the replicas sent since the last call (the newest
        MAX_PENDING_RECORDS); their times count from ``time_origin`` where the replicas share
        the front's clock (local processes), else from their own engine's start."""
        with self._lock:
            taken = list(self._records)
            self._records.clear()
        return taken

    def take_steps(self) -> list[tuple[StepRecord, StepSample]]:
        """The replicas' steps since the last call (the newest MAX_PENDING_STEPS): each one's
        row, naming its replica, on the clock of ``take_records``, and its measured sample; none
        unless the front was made with ``record_steps``."""
        with self._lock:
            taken = list(self._steps)
            self._steps.clear()
        return taken

    def take_step_tokens(self) -> list[tuple[int, int]]:
        """``(replica, tokens)`` of each replica step since the last call (the newest
        MAX_PENDING_STEPS): the tokens it computed, for ``vllm:iteration_tokens_total``."""
        with self._lock:
            taken = list(self._step_tokens)
            self._step_tokens.clear()
        return taken

    def shutdown(self) -> None:
        """Ends the reader and every replica; requests in flight end with ``ReplicaDied``."""
        atexit.unregister(self.shutdown)
        self._stop.set()
        if self._reader.is_alive() and threading.current_thread() is not self._reader:
            self._reader.join(timeout=POLL_S * 10)
        self._set.shutdown()
        with self._lock:
            owners, self._owner = self._owner, {}
            for replica in self.replicas:
                replica.state = "dead"
        for _, sink in owners.values():
            sink.put(ReplicaDied("the server is shutting down."))
