"""One data-parallel replica: an ``LLMEngine`` in its own (spawned) process.

The front sends commands on the replica's inbox (a bounded ``multiprocessing`` queue):
``("add", request_id, prompt, params, kwargs)``, ``("abort", request_id)``, ``("stop",)``. The
replica answers on its end of a pipe, one message per loop turn that did something:
``("ready", time_origin, engine_config)`` once its engine is built (the ``time.monotonic()`` its
records' times count from; its resolved ``EngineConfig.to_dict()``), ``("failed", reason)`` if
it could not be built, and ``("step", outputs, accepted, refused, stats, kv_events, records,
steps, step_tokens)`` after each step (or after commands when idle; ``records``: the finished
requests' ``RequestRecord``s, for the server's latency histograms; ``steps``: each step's
``StepRecord`` and measured ``StepSample`` where the front asked for them,
``ReplicaSpec.record_steps``, else none; ``step_tokens``: the tokens each step since the last
message computed, for ``vllm:iteration_tokens_total``). ``refused`` holds ``Refusal`` rows:
exceptions travel as plain fields, so their classes need not pickle. Commands are read only
between steps, as the in-process engine thread reads them.

A replica whose parent died exits at its next idle poll (no orphan serves nobody), and ignores
SIGINT: Ctrl-C reaches the whole process group, and the front ends its replicas itself.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from twinserve.core.engine_args import EngineArgs
from twinserve.core.errors import EngineOverloaded
from twinserve.core.kv_events import KVEventBuffer
from twinserve.core.metrics import StepRecord
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.step_sample import StepSample

IDLE_POLL_S = 0.5


@dataclass(slots=True, frozen=True)
class ReplicaSpec:
    """What a replica process is built from. ``gpus``: the CUDA devices it owns, one per worker
    rank (none on a CPU); ``num_threads``: its torch threads (its share of the cores), on
    ``cores`` where given."""

    index: int
    args: EngineArgs
    usage_context: str
    num_threads: int
    gpus: tuple[int, ...]
    parent_pid: int
    kv_events: bool = False  # record the prefix cache's block-hash events for the router
    cores: tuple[int, ...] = ()  # the CPU cores it is pinned to (empty: not pinned)
    record_steps: bool = False  # send each step's row (a replay's run folder: validate)

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}.")
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}.")


@dataclass(slots=True, frozen=True)
class Refusal:
    """A request the replica's engine refused: ``reason``/``retry_after_s`` set when it was
    overloaded (``EngineOverloaded``), None for a ValueError."""

    request_id: str
    message: str
    reason: str | None = None
    retry_after_s: float | None = None

    def to_exception(self) -> ValueError | EngineOverloaded:
        if self.reason is None:
            return ValueError(self.message)
        return EngineOverloaded(self.message, self.reason, self.retry_after_s or 0.0)


def replica_main(spec: ReplicaSpec, inbox: Any, outbox: Connection) -> None:
    """The replica process's entry point (a module-level function: spawn pickles it by name)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if spec.gpus:  # before torch initialises CUDA: this process (and its workers) see its GPUs only
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, spec.gpus))
    if spec.cores:
        os.sched_setaffinity(0, spec.cores)
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.worker.threads import set_torch_threads
    set_torch_threads(spec.num_threads)
    try:
        engine = LLMEngine(spec.args, usage_context=spec.usage_context)
    except BaseException as exc:  # the front reports it and does not restart a replica that never ran
        outbox.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    engine.metrics.record_steps = False  # a replica runs for days: keep no per-step rows
    if spec.kv_events:  # as Scheduler.__init__ does for SchedulerConfig.kv_events, before any step
        engine.scheduler.kv.pool.events = KVEventBuffer()
    tokens = StepTokens(engine)
    outbox.send(("ready", engine.time_origin, engine.engine_config.to_dict()))
    try:
        _serve(engine, spec, inbox, outbox, tokens)
    except (BrokenPipeError, EOFError):
        pass  # the front is gone
    finally:
        engine.shutdown()


def _serve(engine: Any, spec: ReplicaSpec, inbox: Any, outbox: Connection,
           tokens: StepTokens) -> None:
    rows = StepRows(engine) if spec.record_steps else None
    while True:
        accepted: list[str] = []
        refused: list[Refusal] = []
        idle = not engine.has_unfinished_requests()
        commands = _take_commands(inbox, block=idle)
        if commands is None:
            return
        if idle and not commands and os.getppid() != spec.parent_pid:
            return  # orphaned
        for command in commands:
            if command[0] == "stop":
                return
            apply_command(engine, command, accepted, refused)
        transfers = _num_transfers(engine)
        outputs = engine.step() if engine.has_unfinished_requests() else []
        # a transfer that ended changes the stats (a producer's freed blocks): the front hears
        if outputs or accepted or refused or commands or transfers != _num_transfers(engine):
            outbox.send(("step", outputs, accepted, refused, engine.scheduler.stats(),
                         kv_events(engine), engine.metrics.take_requests(),
                         rows.take() if rows is not None else [], tokens.take()))


def _num_transfers(engine: Any) -> int:
    """KV transfers pending in the engine's scheduler (a producer's sends, a consumer's loads)."""
    scheduler = engine.scheduler
    return len(scheduler.sending) + len(scheduler.waiting_for_remote)


def _take_commands(inbox: Any, block: bool) -> list[tuple] | None:
    """Every queued command (waiting up to IDLE_POLL_S for the first when ``block``); None when
    the inbox is closed."""
    commands: list[tuple] = []
    try:
        commands.append(inbox.get(timeout=IDLE_POLL_S) if block else inbox.get_nowait())
        while True:
            commands.append(inbox.get_nowait())
    except queue.Empty:
        return commands
    except (EOFError, OSError):
        return None


def apply_command(engine: Any, command: tuple, accepted: list[str], refused: list[Refusal]) -> None:
    kind = command[0]
    if kind == "add":
        _, request_id, prompt, params, kwargs = command
        try:
            engine.add_request(prompt, params, request_id=request_id, **kwargs)
        except EngineOverloaded as exc:
            refused.append(Refusal(request_id, str(exc), exc.reason, exc.retry_after_s))
        except ValueError as exc:
            refused.append(Refusal(request_id, str(exc)))
        else:
            accepted.append(request_id)
    elif kind == "abort":
        engine.abort_request(command[1])
    else:
        raise ValueError(f"unknown replica command {kind!r}")


def kv_events(engine: Any) -> list[Any]:
    """The scheduler's block-hash events since the last step (none when it records none)."""
    return engine.scheduler.take_kv_events()


class StepTokens:
    """A replica's step observer: the tokens each step computed (its scheduled tokens, as the
    single-engine server's ``vllm:iteration_tokens_total`` counts them), taken with each step
    message."""

    __slots__ = ("_tokens",)

    def __init__(self, engine: Any) -> None:
        self._tokens: list[int] = []
        engine.driver.observers.append(self)

    def on_step(self, out: SchedulerOutput, seconds: float, execute_seconds: float) -> None:
        self._tokens.append(out.total_num_scheduled_tokens)

    def take(self) -> list[int]:
        """The steps' token counts since the last call."""
        taken, self._tokens = self._tokens, []
        return taken


class StepRows:
    """A replica's steps for its front (``ReplicaSpec.record_steps``): each step's row (the
    engine's, on its clock) and its measured sample (``StepRecorder``'s), the row timed as the
    whole step, as a replay's run folder has them (``gpu.engine.replay``)."""

    __slots__ = ("_engine", "_recorder")

    def __init__(self, engine: Any) -> None:
        from twinserve.gpu.engine.engine_loop import StepRecorder
        engine.metrics.record_steps = True
        self._engine = engine
        self._recorder = StepRecorder(engine)

    def take(self) -> list[tuple[StepRecord, StepSample]]:
        """The steps since the last call."""
        rows, timed = self._engine.metrics.take_steps(), self._recorder.steps
        if len(rows) != len(timed):
            raise RuntimeError(f"recorded {len(timed)} timed steps for {len(rows)} engine "
                               "steps: the step recorder lost track.")
        self._recorder.steps = []
        return [(dataclasses.replace(row, duration=sample.seconds), sample)
                for row, sample in zip(rows, timed)]
