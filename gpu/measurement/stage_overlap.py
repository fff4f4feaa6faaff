"""How much slower a pipeline stage computes while another stage of the same host computes: the
twin's ``HardwareProfile.shared_stage_slowdown``.

Measured on the engine's own PP runner, from the driver (stage 0), on hand-built steps
(``profiler.build_step``):

    alone:   submit(S) -> finish          stage 0 computes S while stage 1 waits for it
    shared:  submit(S1); submit(S2) ...   stage 0 computes S2 while stage 1 computes S1

The driver's compute is the time in ``submit`` less its send to stage 1 (a send waits until
stage 1 takes the batch: ``PipelineLinks.send_s``). In ``shared`` stage 1 takes S1 as the driver
starts S2, so the driver's compute overlaps stage 1's whole time where stage 1 is the longer
stage (the last holds the LM head); where it is shorter, the tail of stage 0 runs alone and the
ratio reads low. Each step shape is timed in interleaved rounds (alone, shared, alone, ...) so
that a host whose speed drifts moves both alike; the slowdown is the median over the shapes of
each shape's median ratio. The alone rounds also time the send of the hidden states and
residual while stage 1 waits for them (the transfer per step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from twinserve.gpu.measurement.profiler import StepSpec, build_step, speed_probe_specs

if TYPE_CHECKING:
    from twinserve.core.outputs import SchedulerOutput
    from twinserve.gpu.distributed.pipeline import PipelineLinks
    from twinserve.gpu.worker.model_runner import ModelRunner

DEFAULT_ROUNDS = 7


@dataclass(frozen=True, slots=True)
class ShapeOverlap:
    """One step shape: the driver's stage compute per round alone and beside stage 1, and its
    send per alone round (seconds, with the bytes sent)."""

    label: str
    num_tokens: int
    alone_s: tuple[float, ...]
    shared_s: tuple[float, ...]
    send_s: tuple[float, ...]
    send_bytes: int

    @property
    def slowdown(self) -> float:
        return statistics.median(self.shared_s) / statistics.median(self.alone_s)


@dataclass(frozen=True, slots=True)
class StageOverlap:
    """Every shape measured; ``slowdown`` is what a profile stores (never below 1: a stage
    does not run faster beside another; a lower reading is noise)."""

    shapes: tuple[ShapeOverlap, ...]

    def __post_init__(self) -> None:
        if not self.shapes:
            raise ValueError("shapes: no step shape was measured.")

    @property
    def measured(self) -> float:
        """The median over the shapes of each one's slowdown, as read."""
        return statistics.median(s.slowdown for s in self.shapes)

    @property
    def slowdown(self) -> float:
        return max(1.0, self.measured)

    def describe(self) -> str:
        parts = ", ".join(f"{s.label}: {statistics.median(s.alone_s) * 1e3:.1f} -> "
                          f"{statistics.median(s.shared_s) * 1e3:.1f} ms (x{s.slowdown:.2f}), "
                          f"send {statistics.median(s.send_s) * 1e3:.2f} ms / "
                          f"{s.send_bytes / 1024:.1f} KB" for s in self.shapes)
        return (f"shared-stage slowdown {self.slowdown:.3f} (read {self.measured:.3f}; the "
                f"driver's stage alone -> beside stage 1: {parts})")


def overlap_specs(runner: ModelRunner) -> list[StepSpec]:
    """The host-speed probe's steps (1, 6, 16 decodes and a prefill chunk, clipped to the
    runner's limits): decodes and a prefill, as the replays run them."""
    limits = runner.engine_config.scheduler
    return speed_probe_specs(limits.max_num_seqs, limits.max_num_batched_tokens,
                             runner.max_model_len)


def measure_stage_overlap(runner: ModelRunner, specs: Sequence[StepSpec] | None = None,
                          rounds: int = DEFAULT_ROUNDS, warmup: int = 1) -> StageOverlap:
    """Times ``runner``'s first stage alone and beside the next (see the module doc) on each of
    ``specs`` (default ``overlap_specs``) whose blocks fit its cache. ``runner`` must queue
    batches (pipeline parallelism without speculation)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}.")
    if not runner.can_queue_batches or runner.tp is None or runner.tp.group is None:
        raise ValueError("measure_stage_overlap needs a runner with pipeline_parallel_size > 1 "
                         "(and no speculative decoding).")
    links = runner.tp.group.pipeline
    assert links is not None
    steps = []
    for spec in specs if specs is not None else overlap_specs(runner):
        try:
            steps.append((spec, build_step(spec, runner.block_size, runner.num_gpu_blocks,
                                           runner.vocab_size, runner.kv_layout.num_groups)))
        except ValueError:
            continue  # (its blocks do not fit this cache)
    if not steps:
        raise ValueError("no step shape fits the runner's KV cache.")
    timed, most = links.timed, runner.tp.max_batches_in_flight
    links.timed = True
    try:
        shapes = tuple(_measure_shape(runner, links, spec, step, rounds, warmup)
                       for spec, step in steps)
    finally:
        links.timed = timed
        runner.tp.max_batches_in_flight = most  # (the engine's own count, as it was)
    return StageOverlap(shapes)


def _measure_shape(runner: ModelRunner, links: PipelineLinks, spec: StepSpec,
                   step: SchedulerOutput, rounds: int, warmup: int) -> ShapeOverlap:
    for _ in range(warmup):
        _alone(runner, links, step)
        _shared(runner, links, step)
    alone, shared, sends = [], [], []
    sent = links.bytes_sent
    for _ in range(rounds):
        compute, send = _alone(runner, links, step)
        alone.append(compute)
        sends.append(send)
        shared.append(_shared(runner, links, step))
    per_send = (links.bytes_sent - sent) // (3 * rounds)
    return ShapeOverlap(spec.label(), spec.num_tokens, tuple(alone), tuple(shared), tuple(sends),
                        per_send)


def _submit_timed(runner: ModelRunner, links: PipelineLinks, step: SchedulerOutput):
    """``runner.submit(step)``: (the pending step, the driver's compute, its send)."""
    sent = links.send_s
    t0 = time.perf_counter()
    pending = runner.submit(step)
    wall = time.perf_counter() - t0
    send = links.send_s - sent
    return pending, wall - send, send


def _alone(runner: ModelRunner, links: PipelineLinks, step: SchedulerOutput) -> tuple[float, float]:
    pending, compute, send = _submit_timed(runner, links, step)
    runner.finish(pending)
    return compute, send


def _shared(runner: ModelRunner, links: PipelineLinks, step: SchedulerOutput) -> float:
    first = runner.submit(step)
    second, compute, _ = _submit_timed(runner, links, step)
    runner.finish(first)
    runner.finish(second)
    return compute
