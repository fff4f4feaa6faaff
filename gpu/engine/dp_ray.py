"""Data-parallel replicas as Ray actors (``--data-parallel-backend ray``), with ``ReplicaSet``'s
surface (``start``, ``send``, ``poll``, ``pid``, ``shutdown``) so the front drives either.

An actor holds one ``LLMEngine`` and serves ``turn(commands)``: it applies the commands, runs one
step if it has work, and returns the same ``("step", ...)`` message a replica process sends.
The set keeps at most one turn in flight per actor and starts the next at once while the actor
has work, or as soon as a command is queued for it; an idle actor costs nothing. A turn that
fails with a Ray error means the actor died. The driver joins a running cluster (``RAY_ADDRESS``
or ``ray start``) or starts a local one, as the tensor-parallel Ray executor does. A replica's
death is seen at its next turn: an idle actor's, when a request is sent to it (which then ends
with the error at once).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.gpu.engine.dp_client import ReplicaEvent, replica_threads, replica_world
from twinserve.gpu.engine.engine_process import (
    Refusal,
    ReplicaSpec,
    StepRows,
    StepTokens,
    apply_command,
    kv_events,
)

WAIT_SLICE_S = 0.005


class RayReplica:
    """The actor (made remote by ``RayReplicaSet``)."""

    def __init__(self, spec: ReplicaSpec) -> None:
        from twinserve.core.kv_events import KVEventBuffer
        from twinserve.gpu.engine.llm_engine import LLMEngine
        from twinserve.gpu.worker.threads import set_torch_threads
        set_torch_threads(spec.num_threads)
        self.engine = LLMEngine(spec.args, usage_context=spec.usage_context)
        self.engine.metrics.record_steps = False
        if spec.kv_events:
            self.engine.scheduler.kv.pool.events = KVEventBuffer()
        self._rows = StepRows(self.engine) if spec.record_steps else None
        self._tokens = StepTokens(self.engine)

    def ready(self) -> tuple[int, float, dict[str, Any]]:
        """Its pid and what a replica process reports when ready (``engine_process``)."""
        return os.getpid(), self.engine.time_origin, self.engine.engine_config.to_dict()

    def turn(self, commands: list[tuple]) -> tuple[tuple, bool]:
        """The step message and whether work remains."""
        engine = self.engine
        accepted: list[str] = []
        refused: list[Refusal] = []
        for command in commands:
            apply_command(engine, command, accepted, refused)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        message = ("step", outputs, accepted, refused, engine.scheduler.stats(), kv_events(engine),
                   engine.metrics.take_requests(),
                   self._rows.take() if self._rows is not None else [], self._tokens.take())
        return message, engine.has_unfinished_requests()


@dataclass(slots=True)
class _Actor:
    handle: Any
    ready: Any  # the ready call's reference until it answered, then None
    pid: int | None = None
    turn: Any = None  # the turn in flight
    has_work: bool = False
    pending: list[tuple] = field(default_factory=list)


class RayReplicaSet:
    def __init__(self, args: EngineArgs, usage_context: str, on_cuda: bool,
                 kv_events: bool = False, record_steps: bool = False) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError("data_parallel_backend='ray' needs Ray: pip install ray==2.60.0") \
                from None
        self._ray = ray
        self._threads = replica_threads(args, on_cuda)
        self._owns_cluster = not ray.is_initialized()
        if self._owns_cluster:
            ray.init(include_dashboard=False, log_to_driver=True)
        self._args = args.replace(data_parallel_size=1, data_parallel_backend="mp")
        self._size = args.data_parallel_size
        self._usage_context, self._on_cuda, self._kv_events = usage_context, on_cuda, kv_events
        self._record_steps = record_steps
        self._cls = ray.remote(RayReplica)
        self._actors: list[_Actor | None] = [None] * self._size
        self._lock = threading.Lock()

    @property
    def size(self) -> int:
        return self._size

    @property
    def shares_clock(self) -> bool:
        """False: an actor may run on another host, whose monotonic clock is its own."""
        return False

    def start(self, index: int) -> None:
        self._kill(index)
        spec = ReplicaSpec(index, self._args, self._usage_context, self._threads, (),
                           os.getpid(), self._kv_events, record_steps=self._record_steps)
        # (Ray hands the actor its GPUs: one per worker rank of its tensor x pipeline world)
        options = {"num_gpus": replica_world(self._args)} if self._on_cuda else \
            {"num_cpus": self._threads}
        handle = self._cls.options(**options).remote(spec)  # type: ignore[attr-defined]
        with self._lock:
            self._actors[index] = _Actor(handle, handle.ready.remote())  # type: ignore[attr-defined]

    def pid(self, index: int) -> int | None:
        actor = self._actors[index]
        return None if actor is None else actor.pid

    def send(self, index: int, command: tuple) -> None:
        with self._lock:
            actor = self._actors[index]
            if actor is None or actor.pid is None:
                raise RuntimeError(f"replica {index} is not running")
            actor.pending.append(command)

    def poll(self, timeout_s: float) -> list[ReplicaEvent]:
        deadline = time.monotonic() + timeout_s
        while True:
            self._launch_turns()
            refs = self._in_flight()
            if refs:
                done, _ = self._ray.wait(list(refs), num_returns=1, timeout=WAIT_SLICE_S)
                events = [self._finish(refs[ref], ref) for ref in done]
                if events:
                    return [e for e in events if e is not None]
            else:
                time.sleep(WAIT_SLICE_S)
            if time.monotonic() >= deadline:
                return []

    def _launch_turns(self) -> None:
        with self._lock:
            for actor in self._actors:
                if actor is None or actor.pid is None or actor.turn is not None:
                    continue
                if actor.has_work or actor.pending:
                    commands, actor.pending = actor.pending, []
                    actor.turn = actor.handle.turn.remote(commands)

    def _in_flight(self) -> dict[Any, int]:
        refs: dict[Any, int] = {}
        for i, actor in enumerate(self._actors):
            if actor is not None:
                ref = actor.ready if actor.pid is None else actor.turn
                if ref is not None:
                    refs[ref] = i
        return refs

    def _finish(self, index: int, ref: Any) -> ReplicaEvent | None:
        actor = self._actors[index]
        if actor is None:
            return None
        try:
            result = self._ray.get(ref)
        except self._ray.exceptions.RayError as exc:
            starting = actor.pid is None
            self._kill(index)
            if starting:
                return ReplicaEvent(index, "message", ("failed", str(exc).strip()[:300]))
            return ReplicaEvent(index, "died", None)
        if actor.pid is None:
            (actor.pid, *reported), actor.ready = result, None
            return ReplicaEvent(index, "message", ("ready", *reported))
        message, actor.has_work = result
        actor.turn = None
        return ReplicaEvent(index, "message", message)

    def _kill(self, index: int) -> None:
        with self._lock:
            actor, self._actors[index] = self._actors[index], None
        if actor is not None:
            try:
                self._ray.kill(actor.handle, no_restart=True)
            except Exception:  # noqa: BLE001 (already gone)
                pass

    def shutdown(self) -> None:
        """Kills every actor; a local cluster this set started goes down with them."""
        for i in range(self._size):
            self._kill(i)
        if self._owns_cluster:
            self._ray.shutdown()
