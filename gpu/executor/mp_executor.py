"""Worker ranks as local processes (``--distributed-executor-backend mp``, the default).

Processes are spawned (never forked: the driver may hold OpenMP or CUDA state), each with its own
OpenMP pool of ``ShardSpec.num_threads`` threads, and are daemons of the engine process. One pipe per
worker carries the driver's messages, written by one sender thread so that a worker that stopped
reading cannot block the engine; the worker answers only while starting (``joining``, ``ready``)
and with ``error`` before it exits on an exception. Ctrl-C reaches the whole terminal group: the
workers ignore it and the driver ends them; a worker whose driver is gone reads end-of-file and
exits; a ``weakref.finalize`` (also run at interpreter exit) ends workers a dropped engine held.

Workers start from any script, one read from standard input included (``executor.spawn``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from twinserve.gpu.executor.executor_base import Executor, WorkerFailure
from twinserve.gpu.executor.shard_worker import ShardSpec, ShardStep, ShardWorker
from twinserve.gpu.executor.spawn import start_spawned


class MultiprocExecutor(Executor):
    """``worker_type``: what each worker process runs (a ``ShardWorker``; the fault tests pass
    subclasses that fail or hang: ``tests/tp_faults.py``). Spawned workers import it by name."""

    def __init__(self, spec: ShardSpec, worker_type: type[ShardWorker] = ShardWorker) -> None:
        super().__init__(spec)
        ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess] = []
        self._conns: list[Connection] = []
        self._errors: dict[int, str] = {}
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        for rank in range(1, self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(spec, rank, child, worker_type),
                               daemon=True, name=f"twinserve-tp-rank{rank}")
            start_spawned(proc)
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._sender = threading.Thread(target=_send_loop, args=(self._outbox, self._conns),
                                        daemon=True, name="twinserve-tp-sender")
        self._sender.start()
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns,
                                           self._outbox, self._sender)

    def wait_joining(self, timeout_s: float) -> None:
        self._await("joining", timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        self._await("ready", timeout_s)

    def _await(self, tag: str, timeout_s: float) -> None:
        """Every worker's ``tag`` message, or a WorkerFailure naming the first that failed."""
        pending = dict(enumerate(self._conns, start=1))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = wait([*pending.values(), *(self._procs[r - 1].sentinel for r in pending)],
                         timeout=max(0.0, left))
            if not ready:
                ranks = ", ".join(map(str, pending))
                raise WorkerFailure(f"tensor-parallel rank(s) {ranks} did not start within "
                                    f"{timeout_s:.0f} s.")
            for rank, conn in list(pending.items()):
                message = _try_recv(conn)
                if message is not None and message[0] == tag:
                    del pending[rank]
                elif message is not None:
                    raise WorkerFailure(f"tensor-parallel rank {rank} failed to start: "
                                        f"{message[1]}")
                elif not self._procs[rank - 1].is_alive():
                    raise WorkerFailure(f"tensor-parallel rank {rank} failed to start: "
                                        f"{_exit_reason(self._procs[rank - 1])}.")

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._outbox.put(pickle.dumps(("kv", (num_gpu_blocks, num_cpu_blocks))))

    def send_step(self, step: ShardStep) -> None:
        self._outbox.put(pickle.dumps(("step", step), protocol=pickle.HIGHEST_PROTOCOL))

    def failure(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            for rank, (proc, conn) in enumerate(zip(self._procs, self._conns), start=1):
                message = _try_recv(conn)
                if message is not None and message[0] == "error":
                    return f"tensor-parallel rank {rank} failed: {message[1]}"
                if not proc.is_alive():
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) died: " \
                           f"{_exit_reason(proc)}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs if p.pid is not None]

    def shutdown(self) -> None:
        self._finalizer()


def _send_loop(outbox: queue.Queue[bytes | None], conns: list[Connection]) -> None:
    while (data := outbox.get()) is not None:
        for conn in conns:
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):  # that worker is gone: the step's collective says so
                pass


def _shutdown(procs: list[BaseProcess], conns: list[Connection],
              outbox: queue.Queue[bytes | None], sender: threading.Thread) -> None:
    outbox.put(pickle.dumps(("stop", None)))
    outbox.put(None)
    sender.join(timeout=2)
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=5)
    for conn in conns:
        conn.close()


def _try_recv(conn: Connection) -> tuple[str, Any] | None:
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


def _exit_reason(proc: BaseProcess) -> str:
    proc.join(timeout=1)
    code = proc.exitcode
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _worker_main(spec: ShardSpec, rank: int, conn: Connection,
                 worker_type: type[ShardWorker] = ShardWorker) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver ends the workers on Ctrl-C
    worker = None
    try:
        conn.send(("joining", None))
        worker = worker_type(spec, rank)
        conn.send(("ready", None))
        while True:
            kind, payload = pickle.loads(conn.recv_bytes())
            if kind == "stop":
                break
            if kind == "kv":
                worker.allocate_kv_cache(*payload)
                continue
            worker.execute(payload)
    except (EOFError, KeyboardInterrupt):  # the driver is gone
        pass
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=4)}"))
        except OSError:
            pass
        os._exit(1)
    finally:
        if worker is not None:
            worker.close()
