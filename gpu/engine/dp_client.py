"""The replica processes of data parallelism, seen from the front: start, send, receive, end.

Each replica is a spawned process (``engine_process.replica_main``) with a bounded inbox queue
and its own pipe back; ``poll`` waits on every pipe and every process sentinel at once, so a
replica's death is seen as soon as its process ends, not at the next request. A replica's
inbox and pipe are made anew at each (re)start: a process killed while holding a queue's lock
leaves that queue unusable, and it is not reused.

A replica with tensor or pipeline parallelism starts worker processes of its own, which a daemonic
process may not: such replicas are not daemons (as vLLM's engine cores are not). Interpreter exit
does not end them: ``multiprocessing``'s exit hook joins them without a limit, so their owner ends
them first, from an exit hook registered after that one (``dp_front.DataParallelFront``; this
module imports ``multiprocessing.util``, which registers it).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util  # noqa: F401  (its exit hook registered now: see the module doc)
import os
import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.gpu.engine.engine_process import ReplicaSpec, replica_main
from twinserve.gpu.executor.spawn import start_spawned
from twinserve.gpu.worker.cpu_cores import usable_cores

INBOX_SIZE = 4096  # commands queued for one replica before the front refuses new requests
STOP_GRACE_S = 5.0
FEEDER_JOIN_S = 2.0


class ReplicaInboxFull(RuntimeError):
    """A replica's inbox is full: the front answers "overloaded"."""


@dataclass(slots=True)
class _Replica:
    process: Any
    inbox: Any
    conn: Connection
    stopping: bool = False


@dataclass(slots=True)
class ReplicaEvent:
    """What ``poll`` saw: ``kind`` is ``message`` (``message`` holds it) or ``died`` (the
    process ended; ``message`` holds its exit code)."""

    replica: int
    kind: str
    message: Any = field(default=None)


def replica_cores(index: int, size: int, on_cuda: bool) -> tuple[int, ...]:
    """The cores replica ``index`` of ``size`` is pinned to on a CPU: its own contiguous share of
    the process's affinity mask (none where there are fewer cores than replicas, or on CUDA)."""
    if on_cuda or not hasattr(os, "sched_getaffinity"):
        return ()
    mask = sorted(os.sched_getaffinity(0))
    share = len(mask) // size
    return tuple(mask[index * share:(index + 1) * share]) if share else ()


def replica_world(args: EngineArgs) -> int:
    """A replica's worker ranks: its tensor x pipeline world (one GPU each on CUDA)."""
    return args.tensor_parallel_size * args.pipeline_parallel_size


def replica_gpus(index: int, replica_args: Sequence[EngineArgs], on_cuda: bool) -> tuple[int, ...]:
    """The CUDA devices replica ``index`` owns: the next ``replica_world`` after those of the
    replicas before it (none on a CPU)."""
    if not on_cuda:
        return ()
    first = sum(map(replica_world, replica_args[:index]))
    return tuple(range(first, first + replica_world(replica_args[index])))


# On a CPU, a fleet's processes (its replicas' worker ranks) per usable core, at most: beyond,
# each gets a sliver of a core and its own copy of the model, and a start takes minutes
RANKS_PER_CORE = 2


def check_cpu_ranks(replica_args: Sequence[EngineArgs], cores: int) -> None:
    """Refuses (ValueError) a fleet on a CPU whose replicas' worker ranks exceed
    ``RANKS_PER_CORE`` per usable core."""
    ranks = sum(map(replica_world, replica_args))
    if ranks > RANKS_PER_CORE * cores:
        raise ValueError(
            f"{len(replica_args)} replicas (data_parallel_size, or prefill + decode instances) "
            f"with {ranks} worker ranks in all on {cores} usable cores: a CPU runs at most "
            f"{RANKS_PER_CORE} ranks a core ({RANKS_PER_CORE * cores} here).")


def replica_threads(args: EngineArgs, on_cuda: bool) -> int:
    """Each replica's torch threads: its share of the usable cores (at least one)."""
    cores = usable_cores()
    return cores if on_cuda else max(1, cores // args.data_parallel_size)


class ReplicaSet:
    """``data_parallel_size`` engine processes. Only one thread calls ``poll`` (the front's
    reader); ``send`` may be called from any thread."""

    def __init__(self, args: EngineArgs, usage_context: str, on_cuda: bool,
                 kv_events: bool = False, replica_args: Sequence[EngineArgs] = (),
                 record_steps: bool = False) -> None:
        self._ctx = mp.get_context("spawn")
        self._args = args.replace(data_parallel_size=1)
        self._size = args.data_parallel_size
        if replica_args and len(replica_args) != self._size:
            raise ValueError(f"replica_args: {len(replica_args)} for {self._size} replicas.")
        # each replica's own arguments (P/D: its role and side-channel port), else all alike
        self._replica_args = [a.replace(data_parallel_size=1) for a in replica_args] or \
            [self._args] * self._size
        if not on_cuda:
            check_cpu_ranks(self._replica_args, usable_cores())
        self._usage_context = usage_context
        self._on_cuda = on_cuda
        self._kv_events = kv_events
        self._record_steps = record_steps
        self._threads = replica_threads(args, on_cuda)
        self._replicas: list[_Replica | None] = [None] * self._size
        self._daemons = [replica_world(a) == 1 for a in self._replica_args]
        self._closed = False

    @property
    def size(self) -> int:
        return self._size

    @property
    def shares_clock(self) -> bool:
        """Whether the replicas' ``time.monotonic()`` is the front's: local processes, on one
        host's clock."""
        return True

    def start(self, index: int) -> None:
        """Starts (or restarts) replica ``index``; it reports ``("ready", ...)`` once loaded. Refused
        (RuntimeError) once the set is shut down."""
        if self._closed:
            raise RuntimeError("the replica set is shut down: no replica starts again")
        self._reap(index)
        spec = ReplicaSpec(index, self._replica_args[index], self._usage_context, self._threads,
                           replica_gpus(index, self._replica_args, self._on_cuda), os.getpid(),
                           self._kv_events, replica_cores(index, self._size, self._on_cuda),
                           self._record_steps)
        inbox = self._ctx.Queue(maxsize=INBOX_SIZE)
        ours, theirs = self._ctx.Pipe(duplex=False)
        process = self._ctx.Process(target=replica_main, args=(spec, inbox, theirs),
                                    name=f"twinserve-replica-{index}",
                                    daemon=self._daemons[index])
        start_spawned(process)  # (from any script, one read from standard input included)
        theirs.close()  # our copy: EOF on ``ours`` then means the replica is gone
        self._replicas[index] = _Replica(process, inbox, ours)

    def pid(self, index: int) -> int | None:
        replica = self._replicas[index]
        return None if replica is None else replica.process.pid

    def send(self, index: int, command: tuple) -> None:
        """Queues a command; raises ReplicaInboxFull, or RuntimeError when the replica is not
        running."""
        replica = self._replicas[index]
        if replica is None or replica.stopping:
            raise RuntimeError(f"replica {index} is not running")
        try:
            replica.inbox.put_nowait(command)
        except queue.Full as exc:
            raise ReplicaInboxFull(f"replica {index} has {INBOX_SIZE} commands queued") from exc
        except (ValueError, OSError) as exc:  # its queue was closed: the replica just died
            raise RuntimeError(f"replica {index} is not running") from exc

    def poll(self, timeout_s: float) -> list[ReplicaEvent]:
        """Messages from replicas and deaths of replicas, waiting up to ``timeout_s``."""
        handles: dict[Any, tuple[int, str]] = {}
        for i, replica in enumerate(self._replicas):
            if replica is not None:
                handles[replica.conn] = (i, "message")
                handles[replica.process.sentinel] = (i, "died")
        if not handles:
            return []
        events: list[ReplicaEvent] = []
        died: set[int] = set()
        for ready in wait(list(handles), timeout_s):
            index, kind = handles[ready]
            if kind == "message":
                try:
                    events.append(ReplicaEvent(index, "message", ready.recv()))  # type: ignore[union-attr,call-arg]
                    continue
                except (EOFError, OSError):
                    pass  # its pipe closed: the process is ending
            died.add(index)
        for index in sorted(died):
            events.append(ReplicaEvent(index, "died", self._reap(index)))
        return events

    def _reap(self, index: int) -> int | None:
        """Ends replica ``index``'s process (if any) and frees its queue and pipe; returns its
        exit code."""
        replica = self._replicas[index]
        if replica is None:
            return None
        self._replicas[index] = None
        replica.stopping = True
        process = replica.process
        process.join(timeout=0.2 if process.exitcode is None else None)
        if process.exitcode is None:
            process.kill()
            process.join()
        replica.conn.close()
        replica.inbox.cancel_join_thread()  # commands it never read are dropped, not waited on
        replica.inbox.close()
        _join_feeder(replica.inbox)
        return process.exitcode

    def shutdown(self) -> None:
        """Asks every replica to stop, waits up to STOP_GRACE_S, then kills the rest."""
        self._closed = True
        live = [(i, r) for i, r in enumerate(self._replicas) if r is not None]
        for _, replica in live:
            try:
                replica.inbox.put_nowait(("stop",))
            except (queue.Full, ValueError, OSError):
                pass
        for _, replica in live:
            replica.process.join(timeout=STOP_GRACE_S)
        for i, _ in live:
            self._reap(i)


def _join_feeder(inbox: Any) -> None:
    """Waits, briefly, for a closed queue's feeder thread to end. Once the queue is dropped that
    thread holds the last references to its semaphores, so their finalizer (unlink the name,
    then unregister it with the resource tracker) runs in it as it ends; a front exiting right
    after ``shutdown`` froze it in between, and the tracker reported the name, already
    unlinked, as a leaked semaphore. (``_thread``: the stdlib's own join at exit, which
    ``cancel_join_thread`` turns off, waits on it without a limit.)"""
    feeder = getattr(inbox, "_thread", None)
    if feeder is not None:
        feeder.join(timeout=FEEDER_JOIN_S)


def make_replica_set(args: EngineArgs, usage_context: str, on_cuda: bool,
                     kv_events: bool = False, replica_args: Sequence[EngineArgs] = (),
                     record_steps: bool = False) -> Any:
    """The replicas on ``args.data_parallel_backend``: local processes (mp) or Ray actors.
    ``replica_args``: per-replica arguments (local processes only); ``record_steps``: each
    step's row sent with its message (``ReplicaSpec.record_steps``)."""
    if args.data_parallel_backend == "ray":
        if replica_args:
            raise ValueError("data_parallel_backend ray with per-instance arguments (prefill and "
                             "decode instances) is not implemented.")
        from twinserve.gpu.engine.dp_ray import RayReplicaSet
        return RayReplicaSet(args, usage_context, on_cuda, kv_events, record_steps)
    return ReplicaSet(args, usage_context, on_cuda, kv_events, replica_args, record_steps)
