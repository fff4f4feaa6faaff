"""The step seam, written once: the real engine, the twin's SimPy process, validate's replay,
calibration and the profiler all drive their scheduler through a ``StepDriver``::

    out     = driver.schedule(now)                     # Scheduler.schedule
    result  = driver.execute(backend, out)             # the backend: forward pass, or the twin's
                                                       #   synthetic tokens (it times the call)
    outputs = driver.complete(out, result, now, end)   # Scheduler.update_from_output, then one
                                                       #   routine records the step, one each
                                                       #   finished request
    driver.end_step(out, seconds)                      # observers: timing, profiling

The twin yields to SimPy between ``schedule`` and ``complete`` (its step takes the cost model's
time); the real engine runs its output processing (detokenizer, stop strings) between
``complete`` and ``end_step`` and hands requests it stopped to ``finish``. Nowhere else is
``update_from_output`` called.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from twinserve.core.decode_run import DecodeRun
from twinserve.core.metrics import RequestRecord, StepLog, StepRecord
from twinserve.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler

Completer = Callable[[SchedulerOutput, ModelRunnerOutput, float, float], list[EngineCoreOutput]]


class StepBackend(Protocol):
    """Who produces a step's sampled tokens: the model runner, or the twin's synthetic tokens."""

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class StepObserver(Protocol):
    """Attached to a driver to watch its steps (timing, profiling): ``seconds`` is the whole
    step, ``execute_seconds`` the backend's part (``nan`` where the backend was not called)."""

    def on_step(self, out: SchedulerOutput, seconds: float, execute_seconds: float) -> None: ...


@dataclass(slots=True)
class RunRecorder:
    """Finished requests and steps of a run, for run folders (``core.run_dir``). A long-running
    server turns step rows off and drains the request records (``take_requests``)."""

    steps: StepLog = field(default_factory=StepLog)
    requests: list[RequestRecord] = field(default_factory=list)
    record_steps: bool = True
    record_requests: bool = True
    record_tenants: bool = True
    on_finish: Callable[[int], None] | None = None  # a progress bar's update(n)

    def take_requests(self) -> list[RequestRecord]:
        """The finished-request records since the last call."""
        taken, self.requests = self.requests, []
        return taken

    def take_steps(self) -> list[StepRecord]:
        """The step rows since the last call; the log is emptied in place (a driver's
        ``completer`` keeps recording into it)."""
        taken = list(self.steps)
        self.steps.clear()
        return taken


class StepDriver:
    """Drives one scheduler (one replica) through the step seam and records what it did."""

    __slots__ = ("scheduler", "recorder", "replica", "observers", "on_release", "_live",
                 "_execute_s")

    def __init__(self, scheduler: Scheduler, recorder: RunRecorder | None = None,
                 replica: int = 0) -> None:
        self.scheduler = scheduler
        self.recorder = recorder if recorder is not None else RunRecorder()
        self.replica = replica
        self.observers: list[StepObserver] = []
        # Called with each request id that left the engine (finished or aborted).
        self.on_release: Callable[[str], None] | None = None
        self._live: dict[str, Request] = {}  # top-level requests admitted and not yet done
        self._execute_s = float("nan")

    # ---- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request; raises ValueError for one that can never run."""
        self.scheduler.add_request(request)
        self._live[request.request_id] = request

    def abort(self, request_ids: list[str], now: float) -> list[EngineCoreOutput]:
        outs = self.scheduler.abort_requests(request_ids, now)
        for rid in request_ids:
            if self._live.pop(rid, None) is not None and self.on_release is not None:
                self.on_release(rid)
        return outs

    def finish(self, request_ids: list[str], now: float) -> None:
        """Ends requests the front end found done (a stop string); records them."""
        self.scheduler.finish_requests(request_ids, now)
        self._record_finished(request_ids)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        return self.scheduler.schedule(now)

    def execute(self, backend: StepBackend, out: SchedulerOutput) -> ModelRunnerOutput:
        """The backend's part of a step, timed for the observers; a step with nothing for the
        backend (no tokens, no block copies or adapter loads, no finished ids to forget) skips it."""
        if not (out.scheduled or out.finished_request_ids or out.blocks_to_swap_out
                or out.lora_loads):
            self._execute_s = float("nan")
            return ModelRunnerOutput()
        t0 = time.perf_counter()
        result = backend.execute(out)
        self._execute_s = time.perf_counter() - t0
        return result

    def complete(self, out: SchedulerOutput, result: ModelRunnerOutput, start: float,
                 end: float) -> list[EngineCoreOutput]:
        """Applies the step's results at ``end`` and records the step and finished requests."""
        return self.completer()(out, result, start, end)

    def completer(self) -> Completer:
        """``complete`` with its lookups done once, for a loop that calls it every step (the
        twin's engine process: a simulated step costs microseconds). The recorder's settings
        are read now."""
        sched, rec, replica, record_finished = (self.scheduler, self.recorder, self.replica,
                                                self._record_finished)
        update = sched.update_from_output
        record_step = rec.steps.record_step if rec.record_steps else None
        tenants = rec.record_tenants
        # the speculation policy learns the step-time curve from the steps it sees
        on_spec_step = sched.speculation.on_step if sched.speculation is not None else None

        def complete(out: SchedulerOutput, result: ModelRunnerOutput, start: float,
                     end: float) -> list[EngineCoreOutput]:
            outputs = update(out, result, end)
            if on_spec_step is not None and out.scheduled:
                on_spec_step(out, start, end)
            if record_step is not None and out.scheduled:
                record_step(out, sched, start, end - start, replica, tenants)
            if outputs:
                finished = [o.request_id for o in outputs if o.finished]
                if finished:
                    record_finished(finished)
            return outputs

        return complete

    def complete_decode_run(self, run: DecodeRun, start: float, ends: list[float]) -> None:
        """Applies a run of decode-only steps from ``start`` to ``ends[-1]`` and records its
        steps, segment by segment, and the requests it finished (the twin's fast path,
        ``core.decode_run``)."""
        free_after = run.apply(ends)
        rec, sched = self.recorder, self.scheduler
        if rec.record_steps:
            k = len(ends)
            for first, end, requests, num_finished in run.segments(k):
                rec.steps.record_decode_run(
                    requests, sched, ends[first - 1] if first else start, ends[first:end],
                    free_after[first:end], len(sched.policy) if end == k else 0,
                    self.replica, rec.record_tenants, num_finished)
        if run.finished:
            self._record_finished([r.request_id for r in run.finished])

    def complete_closing_run(self, run: DecodeRun, out: SchedulerOutput, result: ModelRunnerOutput,
                             start: float, ends: list[float], free_after: list[int],
                             waiting: int) -> None:
        """Applies a run whose last step also admitted prompts (``DecodeRun.open_closing`` done,
        ``out`` that step's ``Scheduler.schedule_beside_run``): the decodes' tokens and that
        step's finishes, then its prompts' update (``result``: the backend's tokens), and
        records the run's rows as ``complete_decode_run`` does (``free_after`` and ``waiting``:
        after the steps before the last), then the last step's own row."""
        run.close(ends)
        sched, rec = self.scheduler, self.recorder
        prompts = SchedulerOutput()
        prompts.scheduled = out.scheduled[out.num_decode_seqs:]
        outputs = sched.update_from_output(prompts, result, ends[-1])
        k = len(ends) - 1
        if rec.record_steps:
            for first, end, requests, num_finished in run.segments(k):
                rec.steps.record_decode_run(
                    requests, sched, ends[first - 1] if first else start, ends[first:end],
                    free_after[first:end], waiting if end == k else 0,
                    self.replica, rec.record_tenants, num_finished)
        finished = [r.request_id for r in run.finished]
        finished += [o.request_id for o in outputs if o.finished]
        if finished:
            self._record_finished(finished)
        if rec.record_steps:
            rec.steps.record_step(out, sched, ends[-2], ends[-1] - ends[-2], self.replica,
                                  rec.record_tenants)

    def end_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Tells the observers about a step that scheduled work."""
        if out.scheduled:
            for observer in self.observers:
                observer.on_step(out, seconds, self._execute_s)

    def _record_finished(self, request_ids: Iterable[str]) -> None:
        rec, live, release = self.recorder, self._live, self.on_release
        n = 0
        for rid in request_ids:
            request = live.pop(rid, None)
            if request is None:  # an n > 1 sample (recorded with its parent) or unknown
                continue
            n += 1
            if rec.record_requests:
                rec.requests.append(RequestRecord.from_request(request, 0.0, self.replica))
            if release is not None:
                release(rid)
        if n and rec.on_finish is not None:
            rec.on_finish(n)
