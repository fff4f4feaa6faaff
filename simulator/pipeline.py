"""Pipeline parallelism in the twin: a ``StepTimeModel`` over the stages of one step, and the
engine loop with vLLM's batch queue (up to ``pp`` batches in flight) that the engine runs.

The base model's step time (the roofline or a fitted model, for the whole model on ``tp``
devices) is split as the engine splits the layers: the LM head goes to the last stage, the
per-step fixed overhead (scheduling, input preparation) to the first, the rest to each stage in
proportion to its layers. Each stage boundary moves the hidden states and the residual
(``2 x tokens x hidden x dtype`` bytes) over the profile's link, and the last stage sends the
sampled rows' float32 logits back to the driver; each transfer costs the link's latency plus its
bytes over the link's bandwidth (``interconnect_bandwidth``/``interconnect_latency_s``, the terms
TP's all-reduce is charged with).

``step_time`` is one batch alone in the pipeline: the stages in turn. ``pipelined_engine_process``
runs the engine's batch queue (``gpu/engine/batch_queue.py``, the same ``core.batch_queue`` and
the same in-flight skip in the scheduler): the driver computes the first stage of a batch, hands
it on (a send completes when the next stage takes it), and schedules the next batch while the
later stages work; with the queue full it waits for the oldest batch's logits. Each stage works
on one batch at a time, in order (``StageClock``). For a steady run of equal batches that gives
``PipelineStepCost.interval(k)`` between steps.

Stages on separate devices (GPUs) run independently. Stages sharing one host (a CPU, where every
stage is a process reading the same memory) slow each other while they compute at once: with a
profile's ``shared_stage_slowdown`` f > 1 the queue runs on ``SharedStageClock``, where a stage
computes at ``1 / (1 + k (f - 1))`` of its speed while ``k`` others compute. Only the overlap is
charged: a batch alone in the pipeline (and every bubble) costs what it does at f = 1.
``interval`` and ``bubble_with`` stay the separate-device figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import simpy

from twinserve.core.batch_queue import BatchQueue
from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.pipeline_stages import stage_layer_counts
from twinserve.simulator.engine import Replica
from twinserve.simulator.hardware import HardwareProfile
from twinserve.simulator.step_time import StepTimeModel

LOGITS_BYTES = 4  # the engine sends float32 logits


def stage_layers(num_layers: int, pp: int,
                 partition: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Layers per stage, as the engine splits them (``core.pipeline_stages``)."""
    if pp < 1 or num_layers < pp:
        raise ValueError(f"pipeline_parallel_size must be in [1, num_hidden_layers={num_layers}], "
                         f"got {pp}.")
    return stage_layer_counts(num_layers, pp, partition)


@dataclass(frozen=True, slots=True)
class PipelineStepCost:
    """One step, stage by stage: ``stage_s`` (compute), ``transfer_s`` (all boundaries),
    ``logits_s`` (last stage to driver), ``total_s`` (one batch in flight: their sum) and the
    share of device time idle in the bubble."""

    stage_s: tuple[float, ...]
    transfer_s: float
    logits_s: float
    total_s: float

    @property
    def bubble_fraction(self) -> float:
        """The idle share with one batch in flight (the engine's)."""
        return self.bubble_with(1)

    def interval(self, batches_in_flight: int) -> float:
        """Seconds between step starts in steady state with ``batches_in_flight`` batches like
        this one in the pipeline (the batch queue): a batch's whole latency shared among them,
        but never shorter than the busiest stage. A stage's sends and receives block it (the
        engine's links are blocking, the driver's receive of the logits aside), so a stage is
        busy for its compute plus its incoming and outgoing transfers."""
        stages = self.stage_s
        pp = len(stages)
        if not 1 <= batches_in_flight <= pp:
            raise ValueError(f"batches_in_flight must be in [1, {pp}], got {batches_in_flight}.")
        if pp == 1:
            return self.total_s
        hop = self.transfer_s / (pp - 1)
        busiest = max(stages[0] + hop, *(hop + s + hop for s in stages[1:-1]),
                      hop + stages[-1] + self.logits_s)
        return max(self.total_s / batches_in_flight, busiest)

    def bubble_with(self, batches_in_flight: int) -> float:
        """The share of device time idle at ``interval(batches_in_flight)``: each interval every
        device computes its stage of one batch."""
        step = self.interval(batches_in_flight)
        return 0.0 if step <= 0 else 1.0 - sum(self.stage_s) / (len(self.stage_s) * step)


@dataclass(frozen=True, slots=True)
class PipelineCost:
    """``base`` (the whole model's step time on ``tp`` devices) run as ``pipeline_parallel_size``
    stages of ``model`` on ``hardware``'s link."""

    base: StepTimeModel
    model: ModelConfig
    hardware: HardwareProfile
    pipeline_parallel_size: int
    tensor_parallel_size: int = 1
    layer_partition: tuple[int, ...] | None = None  # layers per stage (None: the even split)

    def __post_init__(self) -> None:
        self.layers()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")

    def step_time(self, out: SchedulerOutput) -> float:
        return self.breakdown(out).total_s

    def layers(self) -> tuple[int, ...]:
        """Layers per stage, as the engine splits them."""
        return stage_layers(self.model.num_hidden_layers, self.pipeline_parallel_size,
                            self.layer_partition)

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        return None  # step by step (the reference)

    def head_time(self, num_rows: int) -> float:
        """The LM head over ``num_rows`` sampled rows on the last stage (its share per TP rank):
        its weights streamed once, its FLOPs per row, whichever is slower."""
        m, hw, tp = self.model, self.hardware, self.tensor_parallel_size
        flops = m.arch.lm_head_flops_per_seq(m) * num_rows / tp
        nbytes = m.vocab_size * m.hidden_size * m.dtype_bytes / tp
        return max(flops / (hw.eff_compute * hw.peak_flops), nbytes / (hw.eff_memory * hw.mem_bandwidth))

    def clock(self) -> StageTimeline:
        """The stages' clock for the batch queue: independent devices (``StageClock``) unless
        the profile's stages share a host (``shared_stage_slowdown`` > 1)."""
        hw = self.hardware
        return StageClock() if hw.shared_stage_slowdown == 1.0 else SharedStageClock(hw.stage_slowdown)

    def link_time(self, nbytes: float) -> float:
        return self.hardware.interconnect_latency_s + nbytes / self.hardware.interconnect_bandwidth

    def breakdown(self, out: SchedulerOutput) -> PipelineStepCost:
        total = self.base.step_time(out)
        tokens = out.total_num_scheduled_tokens
        layers = self.layers()
        if tokens == 0 or self.pipeline_parallel_size == 1:
            return PipelineStepCost((total,) + (0.0,) * (len(layers) - 1), 0.0, 0.0, total)
        rows = out.num_prefill_seqs + out.num_decode_seqs
        head = min(total, self.head_time(rows))
        fixed = min(total - head, self.hardware.step_overhead_s)
        body = total - head - fixed
        stages = [body * n / self.model.num_hidden_layers for n in layers]
        stages[0] += fixed
        stages[-1] += head
        m = self.model
        transfer = (len(layers) - 1) * self.link_time(2 * tokens * m.hidden_size * m.dtype_bytes)
        logits = self.link_time(rows * m.vocab_size * LOGITS_BYTES)
        return PipelineStepCost(tuple(stages), transfer, logits, sum(stages) + transfer + logits)


class StageTimeline(Protocol):
    """Where the batches of the queue are in the stages: ``enter`` a batch the driver starts at
    ``now`` -> (when the driver is free again, a handle); ``done(handle)``: when its logits
    reach the driver, asked when the driver waits for them."""

    def enter(self, cost: PipelineStepCost, now: float) -> tuple[float, Any]: ...

    def done(self, handle: Any) -> float: ...


@dataclass(slots=True)
class StageClock:
    """When each stage after the driver's is next free. ``enter`` places a batch the driver
    submits at ``now`` (the driver is the first stage, free when it submits)."""

    free: list[float] = field(default_factory=list)

    def enter(self, cost: PipelineStepCost, now: float) -> tuple[float, float]:
        """The batch through every stage: (when the driver's send to stage 1 completes, free
        to schedule again; when the batch's logits reach the driver)."""
        stages = cost.stage_s
        pp = len(stages)
        if len(self.free) != pp:
            self.free = [now] * pp
        hop = cost.transfer_s / (pp - 1) if pp > 1 else 0.0
        t = now + stages[0]
        driver_free = t
        for s in range(1, pp):
            start = max(t, self.free[s]) + hop  # the send waits until stage s takes it
            if s == 1:
                driver_free = start
            else:
                self.free[s - 1] = start
            t = start + stages[s]
        done = t + cost.logits_s
        self.free[-1] = done
        return driver_free, done

    def done(self, handle: float) -> float:
        """When the batch ``enter`` returned ``handle`` for ends: its handle is that time."""
        return handle


# a stage's phase with a batch: computing it, holding it for the next stage, sending it on
# (the last stage: its logits to the driver), receiving it (reserved by the sender)
_COMPUTE, _WAIT, _SEND, _RECV = "compute", "wait", "send", "recv"


@dataclass(slots=True)
class _Job:
    """One batch on one stage: its phase, ``left`` (compute seconds at full speed) and
    ``until`` (when its send ends)."""

    batch: int
    cost: PipelineStepCost
    phase: str = _COMPUTE
    left: float = 0.0
    until: float = 0.0


@dataclass(slots=True)
class SharedStageClock:
    """``StageClock`` for stages that share one host (``HardwareProfile.shared_stage_slowdown``
    > 1): a stage computes at ``1 / slowdown(k)`` of its speed while ``k`` other stages compute,
    so only the time stages overlap costs extra (a bubble costs nothing). Transfers and waits
    are not slowed. A batch's end then depends on what the driver submits after it, so the
    clock is advanced event by event: ``enter`` runs until the driver is free again and
    ``done`` until a batch's logits arrive, both exact since the driver submits nothing
    meanwhile (it computes, or it waits for that batch)."""

    slowdown: Callable[[int], float]
    now: float = 0.0
    stages: list[_Job | None] = field(default_factory=list)
    finished: dict[int, float] = field(default_factory=dict)  # batch -> when its logits arrived
    entered: int = 0

    def enter(self, cost: PipelineStepCost, now: float) -> tuple[float, int]:
        """The driver starts a batch at ``now``: (when its send to stage 1 completes, the
        batch's handle for ``done``)."""
        if not self.stages:
            self.stages = [None] * len(cost.stage_s)
        if now < self.now - 1e-9 * max(1.0, self.now):
            raise ValueError(f"now ({now}) is before the clock's time ({self.now}).")
        now = max(now, self.now)  # (SimPy's now + (t - now) may round below t)
        self._run(lambda: self.now >= now, now)
        self._advance(now)  # (the work done up to now; no job ends)
        if self.stages[0] is not None:
            raise RuntimeError(f"the driver's stage is busy at t={now}.")
        batch, self.entered = self.entered, self.entered + 1
        self.stages[0] = _Job(batch, cost, left=cost.stage_s[0])
        self._run(lambda: self.stages[0] is None)
        return self.now, batch

    def done(self, batch: int) -> float:
        """When ``batch``'s logits reach the driver (the driver submitting nothing meanwhile)."""
        self._run(lambda: batch in self.finished)
        if batch not in self.finished:
            raise ValueError(f"batch {batch} is not in the pipeline.")
        return self.finished.pop(batch)

    def _run(self, stop: Callable[[], bool], limit: float = math.inf) -> None:
        self._start_sends()
        while not stop():
            nxt = self._next_event()
            if nxt is None or nxt > limit:
                return
            self._advance(nxt)
            self._start_sends()

    def _factor(self) -> float:
        """The slowdown of every computing stage now (each has the others computing)."""
        busy = sum(1 for j in self.stages if j is not None and j.phase == _COMPUTE)
        return self.slowdown(max(busy - 1, 0))

    def _next_event(self) -> float | None:
        factor = self._factor()
        ends = [self.now + j.left * factor if j.phase == _COMPUTE else j.until
                for j in self.stages if j is not None and j.phase in (_COMPUTE, _SEND)]
        return min(ends, default=None)

    def _advance(self, t: float) -> None:
        """Every computing stage's work up to ``t``; the jobs ending at ``t`` move on."""
        factor, dt = self._factor(), t - self.now
        self.now = t
        last = len(self.stages) - 1
        for s, job in list(enumerate(self.stages)):  # (the stages as they were before t)
            if job is None:
                continue
            if job.phase == _COMPUTE:
                job.left -= dt / factor
                if job.left * factor > 1e-12 * max(1.0, t):
                    continue
                job.left = 0.0
                if s < last:
                    job.phase = _WAIT
                else:
                    job.phase, job.until = _SEND, t + job.cost.logits_s
            elif job.phase == _SEND and job.until <= t:
                self.stages[s] = None
                if s == last:
                    self.finished[job.batch] = t
                else:
                    self.stages[s + 1] = _Job(job.batch, job.cost, left=job.cost.stage_s[s + 1])

    def _start_sends(self) -> None:
        """A stage waiting to send starts once the next one is free; both are held by the
        transfer (the receiver's compute starts when it ends)."""
        for s in range(len(self.stages) - 2, -1, -1):
            job = self.stages[s]
            if job is not None and job.phase == _WAIT and self.stages[s + 1] is None:
                job.phase = _SEND
                job.until = self.now + job.cost.transfer_s / (len(self.stages) - 1)
                self.stages[s + 1] = _Job(job.batch, job.cost, phase=_RECV)


def pipelined_engine_process(env: simpy.Environment, replica: Replica, pipe: PipelineCost):
    """``simulator.engine.engine_process`` with the engine's batch queue (``pipe``'s
    ``pipeline_parallel_size`` batches in flight): schedule and submit while the queue has room
    and something new is scheduled, else wait for the oldest batch and apply it. Step by step,
    one SimPy event per submit and per finish (no decode runs)."""
    driver = replica.driver
    sched = driver.scheduler
    sampled = replica.tokens.output
    complete = driver.completer()
    clock = pipe.clock()
    queue: BatchQueue[Any] = BatchQueue(sched, pipe.pipeline_parallel_size)  # handle: the clock's
    while True:
        if not len(queue) and not sched.has_unfinished_requests():
            replica.wakeup = env.event()
            yield replica.wakeup
            replica.wakeup = None
        now = env.now
        if not queue.full and sched.has_unfinished_requests():
            out = queue.schedule(now)
            if out.scheduled:
                driver_free, handle = clock.enter(pipe.breakdown(out), now)
                queue.push(out, handle, now)
                yield env.timeout(driver_free - now)  # the driver's stage, then its send
                if not queue.full:
                    continue
            elif out.preempted_request_ids:  # a step that only preempted: the next goes on
                continue
            elif not len(queue):
                raise RuntimeError(f"replica {replica.index}: scheduler made no progress at "
                                   f"t={now}")
        batch = queue.oldest()
        done = clock.done(batch.handle)
        if done > env.now:
            yield env.timeout(done - env.now)
        queue.pop()
        complete(batch.out, sampled, batch.start, env.now)
