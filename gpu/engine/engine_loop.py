"""Synthetic serving workloads through a live engine, every step recorded.

``StepRecorder`` observes an ``LLMEngine``'s step driver, so that every ``engine.step()`` yields
its ``SchedulerOutput`` aggregates, the whole step's seconds (schedule, forward pass, sampling,
``update_from_output``, output processing) and the forward pass alone. ``run_engine_loop`` drives
the ``LoopScenario`` workloads through it (calibration's engine loop, which sets a profile's
level); ``gpu.replay`` records a whole trace replay with it.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from twinserve.core.engine_args import EngineArgs
from twinserve.core.errors import EngineOverloaded
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.step_sample import StepSample
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.gpu.worker.model_runner import ModelRunner

FIRST_TOKEN_ID = 16  # below: special tokens
Log = Callable[[str], None]


def synthetic_prompt(seed: int, length: int, vocab_size: int) -> list[int]:
    """``length`` distinct-per-seed token ids, none of them special."""
    span = vocab_size - FIRST_TOKEN_ID
    return [FIRST_TOKEN_ID + (seed * 7919 + 31 * i) % span for i in range(length)]


class StepRecorder:
    """Records every step of ``engine`` (an ``LLMEngine``) that scheduled work: its
    ``SchedulerOutput`` aggregates, the whole step's seconds and the forward pass's. It observes
    the engine's step driver (``core.step_driver.StepObserver``); ``close()`` detaches it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps: list[StepSample] = []
        engine.driver.observers.append(self)

    def on_step(self, out: SchedulerOutput, seconds: float, execute_seconds: float) -> None:
        self.steps.append(StepSample.of_step(out, seconds, execute_seconds))

    def close(self) -> None:
        observers = self.engine.driver.observers
        if self in observers:
            observers.remove(self)


@dataclass(slots=True, frozen=True)
class LoopScenario:
    """``num_requests`` distinct prompts of ``prompt_len`` tokens, each generating ``output_len``
    tokens: all queued at once, or, with ``concurrency``, as a client holding that many requests
    in flight sends them (the next one as soon as one finishes). With ``prompt_len_max`` /
    ``output_len_max`` the lengths are drawn uniformly up to them (seeded), so requests finish
    at different steps and batches change their make-up as a server's do."""

    num_requests: int
    prompt_len: int
    output_len: int
    concurrency: int | None = None
    prompt_len_max: int | None = None
    output_len_max: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoopScenario.{name} must be >= 1, got {getattr(self, name)}.")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"LoopScenario.concurrency must be >= 1, got {self.concurrency}.")
        for low, high in (("prompt_len", "prompt_len_max"), ("output_len", "output_len_max")):
            top = getattr(self, high)
            if top is not None and top < getattr(self, low):
                raise ValueError(f"LoopScenario.{high} ({top}) is below {low} "
                                 f"({getattr(self, low)}).")

    def lengths(self) -> list[tuple[int, int]]:
        """Each request's (prompt, output) length."""
        rng = random.Random(self.seed)
        return [(rng.randint(self.prompt_len, self.prompt_len_max or self.prompt_len),
                 rng.randint(self.output_len, self.output_len_max or self.output_len))
                for _ in range(self.num_requests)]

    def label(self) -> str:
        prompt = (f"{self.prompt_len}-{self.prompt_len_max}" if self.prompt_len_max
                  else str(self.prompt_len))
        output = (f"{self.output_len}-{self.output_len_max}" if self.output_len_max
                  else str(self.output_len))
        flight = f", {self.concurrency} in flight" if self.concurrency else ""
        return f"{self.num_requests} x ({prompt} in, {output} out{flight})"


def default_scenarios(max_num_seqs: int = 128, max_model_len: int = 2048,
                      quick: bool = False) -> list[LoopScenario]:
    """Serving-like workloads at a spread of concurrencies: twice as many requests as are held
    in flight, prompts and outputs of mixed lengths, so batches fill, churn (requests join and
    leave at different steps, prefill chunks land beside decodes) and drain, as a server's do.
    A batch of equal requests decoding in lockstep runs faster than that (measured here: ~7%
    below the grid where replays ran 2-5% above it), so it would set the live speed too low."""
    flights = [b for b in ((2, 16, 64) if quick else (1, 4, 16, 32, 64, 128)) if b <= max_num_seqs]
    if flights and flights[-1] < max_num_seqs <= 128:
        flights.append(max_num_seqs)
    longest = max(16, min(max_model_len - 40, 200 if quick else 600))
    out_len = (4, 12) if quick else (4, 28)
    return [LoopScenario(2 * b, 16, out_len[0], b, longest, out_len[1], seed=k)
            for k, b in enumerate(flights)]


def run_engine_loop(engine: LLMEngine, scenarios: Iterable[LoopScenario], detokenize: bool = True,
                    progress: Log | None = None) -> list[StepSample]:
    """Runs each scenario to completion through ``engine`` and returns its recorded steps."""
    recorder = StepRecorder(engine)
    vocab = engine.runner.vocab_size
    try:
        for k, sc in enumerate(scenarios):
            first = len(recorder.steps)
            pending = deque(enumerate(sc.lengths()))
            flight = sc.concurrency or sc.num_requests
            scheduler = engine.scheduler
            while pending or engine.has_unfinished_requests():
                while pending and len(scheduler.running) + scheduler.num_waiting < flight:
                    i, (prompt_len, output_len) = pending[0]
                    params = SamplingParams(max_tokens=output_len, ignore_eos=True,
                                            temperature=0.0)
                    try:
                        engine.add_request(synthetic_prompt(10_000 * (k + 1) + i, prompt_len, vocab),
                                           params, request_id=f"profile-{k}-{i}",
                                           detokenize=detokenize)
                    except EngineOverloaded:  # a small cache's waiting bound: retry after a step
                        break
                    pending.popleft()
                engine.step()
            if progress:
                steps = recorder.steps[first:]
                total = sum(s.seconds for s in steps)
                progress(f"[{k + 1}] {sc.label()}: {len(steps)} steps, {total:.2f} s")
    finally:
        recorder.close()
    return recorder.steps


def runner_scenarios(runner: ModelRunner, quick: bool = False,
                     space: tuple[int, int, int] | None = None) -> list[LoopScenario]:
    """``default_scenarios`` within ``runner``'s limits (or within ``space``: ``(max_num_seqs,
    max_num_batched_tokens, max_model_len)``, a part of them): the engine loop's workloads."""
    if space is not None:
        return default_scenarios(space[0], space[2], quick)
    return default_scenarios(runner.engine_config.scheduler.max_num_seqs, runner.max_model_len,
                             quick)


def measure_engine_loop(runner: ModelRunner, engine_args: EngineArgs, quick: bool = False,
                        log: Log | None = None, parts: Iterable[int] | None = None,
                        space: tuple[int, int, int] | None = None) -> list[StepSample]:
    """The synthetic serving workloads (``runner_scenarios``; with ``parts``, those at these
    indices) through a fresh ``LLMEngine`` on ``runner``: their recorded steps."""
    scenarios = runner_scenarios(runner, quick, space)
    what = f"{len(scenarios)} synthetic workloads"
    if parts is not None:
        parts = list(parts)
        what = f"synthetic workload(s) {', '.join(str(i + 1) for i in parts)} of {len(scenarios)}"
        scenarios = [scenarios[i] for i in parts]
    if log is not None:
        log(f"engine loop: {what}")
    engine = LLMEngine(engine_args, runner=runner, usage_context="server")
    engine.metrics.record_steps = False
    # Under pipeline parallelism the profile models one batch alone in the pipeline (the stages
    # in turn: simulator.pipeline splits it and overlaps the batches itself), so the loop runs
    # without the batch queue, whose overlapping batches would time each other's waits.
    engine.batch_queue = None
    return run_engine_loop(engine, scenarios, progress=log)
