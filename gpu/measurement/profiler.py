"""Micro-benchmarks of the real backend: ``core.step_sample.StepSample`` rows for calibration.

Two kinds of measurement, both keyed by the aggregate fields the scheduler fills in every
``SchedulerOutput`` (``AGGREGATE_FIELDS``), so the simulator's ``step_features(out)`` applies to them:

- ``run_micro_benchmarks``: hand-built steps (prefill chunks after a cached prefix, decode batches,
  decodes + one prefill chunk) timed through ``ModelRunner.execute`` with warm-up and repeats
  (median). Block ids are disjoint and handed out by hand; the KV they hold is whatever is there
  (timing does not depend on its values). Plus swap copies (``measure_swap``).
- the engine loop (``gpu.engine_loop``): synthetic workloads through a live ``LLMEngine``,
  every step recorded whole and its forward pass alone.

``measure_backend`` runs all of them with the limits of the engine at hand. This module knows
nothing of the simulator (``gpu`` never imports ``simulator``): it produces samples;
``simulator.calibration`` turns them into a fit.
"""

from __future__ import annotations

import math
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from twinserve.core.engine_args import EngineArgs
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.step_sample import StepSample
from twinserve.gpu.engine.engine_loop import FIRST_TOKEN_ID, Log, measure_engine_loop, synthetic_prompt
from twinserve.gpu.worker.model_runner import ModelRunner


# ---- hand-built steps ----------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class StepSpec:
    """A step to build: ``decodes`` holds each decode's context length after the step (its KV
    positions, >= 2); ``prefills`` holds ``(new_tokens, cached_tokens)`` per prefill chunk."""

    decodes: tuple[int, ...] = ()
    prefills: tuple[tuple[int, int], ...] = ()

    @property
    def kind(self) -> str:
        if self.decodes and self.prefills:
            return "mixed"
        return "prefill" if self.prefills else "decode"

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for n, _ in self.prefills)

    def label(self) -> str:
        parts = []
        if self.decodes:
            parts.append(f"{len(self.decodes)} decodes @ ctx {max(self.decodes)}")
        parts += [f"prefill {n} after {s}" for n, s in self.prefills]
        return " + ".join(parts)


def build_step(spec: StepSpec, block_size: int, num_blocks: int, vocab_size: int,
               num_groups: int = 1) -> SchedulerOutput:
    """A ``SchedulerOutput`` for ``spec`` with disjoint block ids (one table per KV cache group
    when there are several) and the aggregates the scheduler would fill (``Scheduler._count``).
    Raises ValueError when the blocks do not fit."""
    out = SchedulerOutput()
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0.0)
    next_block = 0

    def blocks_for(tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-tokens // block_size)
        if next_block + n > num_blocks:
            raise ValueError(f"step {spec.label()!r} needs more than the {num_blocks} KV blocks "
                             "of the cache.")
        ids = list(range(next_block, next_block + n))
        next_block += n
        return ids

    def tables_for(tokens: int) -> tuple[list[int], tuple[list[int], ...]]:
        tables = tuple(blocks_for(tokens) for _ in range(num_groups))
        return tables[0], tables if num_groups > 1 else ()

    for i, ctx in enumerate(spec.decodes):
        if ctx < 2:
            raise ValueError(f"a decode needs a context of at least 2 tokens, got {ctx}.")
        req = Request(f"profile-d{i}", synthetic_prompt(i, ctx - 1, vocab_size), params, 0.0)
        req.append_output_token(FIRST_TOKEN_ID, 0.0)
        ids, groups = tables_for(ctx)
        out.scheduled.append(ScheduledRequest(req, ctx - 1, 1, ids, True, groups))
        out.num_decode_seqs += 1
        out.num_decode_tokens += 1
        out.sum_decode_context_tokens += ctx
        out.sum_context_tokens += ctx
        out.max_decode_context = max(out.max_decode_context, ctx)
    for j, (n, cached) in enumerate(spec.prefills):
        if n < 1 or cached < 0:
            raise ValueError(f"a prefill chunk needs n >= 1 and cached >= 0, got {n}, {cached}.")
        req = Request(f"profile-p{j}", synthetic_prompt(1000 + j, cached + n, vocab_size), params, 0.0)
        ids, groups = tables_for(cached + n)
        out.scheduled.append(ScheduledRequest(req, cached, n, ids, True, groups))
        out.num_prefill_seqs += 1
        out.num_prefill_tokens += n
        out.sum_context_tokens += n * cached + n * (n + 1) // 2
        out.num_prefix_chunks += cached > 0
        out.sum_prefix_context_tokens += cached
        out.sum_prefill_attention_area += n * (cached + n)
    out.total_num_scheduled_tokens = out.num_decode_tokens + out.num_prefill_tokens
    return out


def time_call(fn: Callable[[], object], warmup: int = 1, repeats: int = 3,
              sync: Callable[[], None] | None = None) -> list[float]:
    """Seconds of each of ``repeats`` calls after ``warmup`` untimed ones (device synchronised)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def _sync_for(device: torch.device) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


def default_grid(max_num_batched_tokens: int = 2048, max_num_seqs: int = 128,
                 max_model_len: int = 2048, quick: bool = False,
                 gpu: bool = False) -> list[StepSpec]:
    """Prefill chunks (16..max tokens) after cached prefixes, decode batches (1..max_num_seqs) at
    several contexts (equal, and spread up to the context), and decode batches with one prefill
    chunk; all within the given limits."""
    # a GPU runs prefill chunks up to 8k tokens and decodes at 4k contexts in milliseconds
    longest = 8192 if gpu else 2048
    tokens = [t for t in (16, 64, 256, 1024, 2048, 4096, 8192)
              if t <= min(max_num_batched_tokens, longest)] if quick else \
        [t for t in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
         if t <= min(max_num_batched_tokens, longest)]
    if not tokens or tokens[-1] < max_num_batched_tokens <= longest:
        tokens.append(max_num_batched_tokens)
    cached = (0, 512) if quick else (0, 128, 512, 1536)
    batches = [b for b in ((1, 4, 16, 64, 128) if quick else (1, 2, 4, 8, 16, 32, 64, 128, 256))
               if b <= max_num_seqs]
    if batches[-1] < max_num_seqs <= 256:
        batches.append(max_num_seqs)
    contexts = ((64, 512) if quick else (32, 128, 512, 1536)) + ((4096,) if gpu else ())
    if not quick:  # decode contexts reach the model length (up to the longest profiled)
        reach = min(max_model_len - 1, 4096 if gpu else 2048)
        contexts = tuple(sorted({c for c in contexts if c < reach} | {reach}))
    specs: list[StepSpec] = []
    for n in tokens:
        for s in cached:
            if n + s <= max_model_len and (s == 0 or n <= 512):
                specs.append(StepSpec(prefills=((n, s),)))
    # a budget above the model length is filled by several prompts' chunks in one step
    chunk = min(max_model_len, 512)
    for k in () if quick else (2, 4):
        if k * chunk <= min(max_num_batched_tokens, longest) and k <= max_num_seqs:
            specs.append(StepSpec(prefills=((chunk, 0),) * k))
    specs += _prefix_chunks(max_num_batched_tokens, max_num_seqs, max_model_len, quick)
    for b in batches:
        for c in contexts:
            if c < max_model_len:
                specs.append(StepSpec(decodes=(c,) * b))
                if b > 1:  # contexts spread up to c: the padded and the summed KV part ways
                    specs.append(_spread_decodes(b, c))
    # every batch size at a short and a long context: GEMM kernels step up at tile widths (here
    # from 5 and from 17 tokens), which a grid of powers of two alone would interpolate across
    sweep_contexts = sorted({min(c, max_model_len - 1) for c in (48, 256)})
    specs += [_spread_decodes(b, c) for c in sweep_contexts
              for b in batch_sweep(max_num_seqs, quick) if b not in batches]
    for b in [b for b in (4, 16, 64) if b < max_num_seqs] or [max(1, max_num_seqs - 1)]:
        for n in (32, 256) if quick else (32, 128, 512):
            if b + n <= max_num_batched_tokens and n < max_model_len:
                ctx = min(256, max_model_len - 1)
                specs.append(StepSpec(decodes=(ctx,) * b, prefills=((n, 0),)))
    return specs if quick else [*specs, *_serving_prefills(max_num_batched_tokens, max_num_seqs,
                                                           max_model_len)]


def _prefix_chunks(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                   quick: bool) -> list[StepSpec]:
    """Several short chunks after cached prefixes in one step, where requests that hit the prefix
    cache arrive together: each chunk's attention runs against its prefix (a masked kernel on the
    CPU), which single chunks after a prefix alone leave apart from the chunk count. Three
    prefix lengths and two chunk lengths per count part the prefixes' reads
    (``sum_prefix_context_tokens``) from the chunks' tokens x context."""
    shapes = ((4, 16, 128),) if quick else tuple(
        (k, n, s) for k in (4, 10) for n in (8, 32) for s in (64, 240, 480))
    return [StepSpec(prefills=((n, s),) * k) for k, n, s in shapes
            if k <= max_num_seqs and k * n <= max_num_batched_tokens and n + s <= max_model_len]


def _serving_prefills(max_num_batched_tokens: int, max_num_seqs: int,
                      max_model_len: int) -> list[StepSpec]:
    """Where a server's prompts land: fresh prefill chunks between the grid's powers of two,
    and each of them beside 1 to 32 running decodes (contexts spread up to 256): a replay's
    first tokens come from these steps, which the powers of two alone left to interpolation.
    Alone, also 320 and 448 tokens: there a prompt's attention (quadratic in its length) takes a
    quarter of the step, and long prompts' first tokens follow it."""
    ctx = min(256, max_model_len - 1)
    chunks = [n for n in (16, 48, 96, 192, 384) if n < max_model_len]
    alone = [n for n in (48, 96, 192, 320, 384, 448) if n < max_model_len]
    specs = [StepSpec(prefills=((n, 0),)) for n in alone if n <= max_num_batched_tokens]
    for b in (b for b in (1, 2, 4, 8, 16, 32) if b < max_num_seqs):
        specs += [StepSpec(decodes=_spread_decodes(b, ctx).decodes, prefills=((n, 0),))
                  for n in chunks if b + n <= max_num_batched_tokens]
    return specs


def batch_sweep(max_num_seqs: int, quick: bool = False) -> list[int]:
    """Decode batch sizes timed one by one: each up to 32 (16 when ``quick``), then every 8th
    (every 16th) up to ``max_num_seqs`` (at most 256)."""
    dense, stride = (16, 16) if quick else (32, 8)
    top = min(max_num_seqs, 256)
    return [*range(1, min(dense, top) + 1), *range(dense + stride, top + 1, stride)]


def _spread_decodes(batch: int, context: int) -> StepSpec:
    """``batch`` decodes at contexts spread evenly up to ``context``."""
    if batch == 1:
        return StepSpec(decodes=(context,))
    return StepSpec(decodes=tuple(max(2, context * (i + 1) // batch) for i in range(batch)))


def run_micro_benchmarks(runner: ModelRunner, specs: Sequence[StepSpec], warmup: int = 1,
                         repeats: int = 3, progress: Log | None = None,
                         seed: int = 0) -> list[StepSample]:
    """Times ``runner.execute`` on each hand-built step; ``seconds`` is the median of repeats.
    Steps whose blocks do not fit the runner's cache are skipped (reported through ``progress``).

    The grid is timed in passes, each in its own shuffled (seeded) order: ``warmup`` untimed
    passes, then ``repeats`` timed ones. A burst of other work on a shared host then slows one
    repeat of steps scattered over the space (the median drops it) instead of every repeat of
    one region of it."""
    return MicroGrid.build(runner, specs, progress, seed).run(warmup, repeats, progress)


@dataclass(slots=True)
class MicroGrid:
    """Hand-built steps timed pass by pass (``run_micro_benchmarks``); more passes can be added
    later (``InterleavedCalibration`` adds one before each round of real runs, so the grid's
    shape, like the engine loop's level, is measured over the same minutes as the runs).

    With a ``probe`` step, a pass times the probe between every two steps and each step's time
    is read against the mean of the probes on either side, at the probes' median speed over
    every pass: the host's speed moves within a pass too, and read raw such moves bent the
    grid's shape (docs/fidelity.md, "What moves the figures"). What a probe cannot read out is
    the host speeding up its compute-bound steps more than its memory-bound ones."""

    runner: ModelRunner
    specs: list[StepSpec]  # those whose blocks fit
    steps: list[SchedulerOutput]
    times: list[list[float]]  # per step, its raw time in each timed pass
    rng: random.Random
    probe: SchedulerOutput | None = None
    probe_times: list[list[float]] = field(default_factory=list)  # per step, the probes beside

    @classmethod
    def build(cls, runner: ModelRunner, specs: Sequence[StepSpec], progress: Log | None = None,
              seed: int = 0, probe: StepSpec | None = None) -> MicroGrid:
        """The steps of ``specs`` whose blocks fit ``runner``'s cache (and ``probe``'s, if it
        fits); those that do not are reported through ``progress``."""
        def built(spec: StepSpec) -> SchedulerOutput | None:
            try:
                return build_step(spec, runner.block_size, runner.num_gpu_blocks,
                                  runner.vocab_size, runner.kv_layout.num_groups)
            except ValueError as exc:
                if progress:
                    progress(f"skipped: {exc}")
                return None
        pairs = [(spec, step) for spec in specs if (step := built(spec)) is not None]
        steps = [step for _, step in pairs]
        return cls(runner, [spec for spec, _ in pairs], steps, [[] for _ in steps],
                   random.Random(seed), built(probe) if probe else None, [[] for _ in steps])

    def run(self, warmup: int, repeats: int, progress: Log | None = None) -> list[StepSample]:
        """``warmup`` untimed passes, ``repeats`` timed ones, then ``samples()``."""
        for pass_ in range(warmup + repeats):
            self.time_pass(timed=pass_ >= warmup)
            if progress:
                what = "warm-up" if pass_ < warmup else f"timed {pass_ - warmup + 1}/{repeats}"
                progress(f"micro-benchmarks: pass {pass_ + 1} ({what}) of {len(self.steps)} "
                         "steps done")
        samples = self.samples()
        if progress:
            for spec, sample in zip(self.specs, samples):
                progress(f"  {spec.label():<48} {sample.seconds * 1e3:9.1f} ms")
        return samples

    def time_pass(self, timed: bool = True) -> None:
        """Every step once, in a shuffled order (the probe between every two); ``timed`` keeps
        the times."""
        order = list(range(len(self.steps)))
        self.rng.shuffle(order)
        before = self._time_probe()
        for i in order:
            seconds = self._time(self.steps[i])
            after = self._time_probe()
            if timed:
                self.times[i].append(seconds)
                self.probe_times[i].append((before + after) / 2)
            before = after

    def _time_probe(self) -> float:
        return math.nan if self.probe is None else self._time(self.probe)

    def _time(self, step: SchedulerOutput) -> float:
        sync = _sync_for(self.runner.device)
        return time_call(partial(self.runner.execute, step), 0, 1, sync)[0]

    def read_times(self) -> list[list[float]]:
        """Per step, its time in each timed pass: raw without a probe; with one, read against
        the probes beside it (``time * median probe / probe beside``)."""
        if self.probe is None:
            return [list(t) for t in self.times]
        level = statistics.median(p for probes in self.probe_times for p in probes)
        return [[t * level / p for t, p in zip(times, probes, strict=True)]
                for times, probes in zip(self.times, self.probe_times, strict=True)]

    def samples(self) -> list[StepSample]:
        """One sample per step: the median of its timed passes (``read_times``)."""
        out = []
        for step, times in zip(self.steps, self.read_times()):
            if not times:
                raise RuntimeError("MicroGrid.samples needs at least one timed pass")
            median = statistics.median(times)
            out.append(StepSample.of_step(step, median, median, times))
        return out


def grid_probe(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> StepSpec:
    """The step a calibration's grid reads its steps against (``MicroGrid``): a few decodes and
    a short prefill chunk, so that it loads the host as both kinds of step do (~50 ms here)."""
    num_decodes = min(4, max_num_seqs - 1, max_num_batched_tokens - 1)
    decodes = _spread_decodes(num_decodes, min(96, max_model_len - 1)).decodes if num_decodes else ()
    chunk = min(16, max_num_batched_tokens - num_decodes, max_model_len - 1)
    return StepSpec(decodes=decodes, prefills=((chunk, 0),))


# ---- the host's speed now -------------------------------------------------------------------
def speed_probe_specs(max_num_seqs: int, max_num_batched_tokens: int,
                      max_model_len: int) -> list[StepSpec]:
    """The host-speed probe: four steps across the space (1, 6 and 16 decodes, a 128-token
    prefill), small enough for a cache of 48 blocks of 16, the same on every engine that fits
    them (clipped to smaller limits)."""
    ctx = min(96, max_model_len - 1)
    specs = [_spread_decodes(b, c) for b, c in ((1, ctx), (6, ctx), (16, min(48, ctx)))
             if b <= max_num_seqs]
    return [*specs, StepSpec(prefills=((min(128, max_num_batched_tokens, max_model_len), 0),))]


def speed_probe(runner: ModelRunner, repeats: int = 5) -> dict[str, float]:
    """The probe's steps timed now (label -> median seconds of ``repeats``). On a shared VM the
    same steps run 15-20% faster or slower an hour apart; set against their times at
    calibration (``FittedParams.host_speed``) they tell the host's speed from the twin's error."""
    limits = runner.engine_config.scheduler
    specs = [s for s in speed_probe_specs(limits.max_num_seqs, limits.max_num_batched_tokens,
                                          runner.max_model_len)
             if _blocks_needed(s, runner.block_size) * runner.kv_layout.num_groups
             <= runner.num_gpu_blocks]
    samples = run_micro_benchmarks(runner, specs, 1, repeats)
    return {spec.label(): sample.seconds for spec, sample in zip(specs, samples, strict=True)}


def _blocks_needed(spec: StepSpec, block_size: int) -> int:
    contexts = [*spec.decodes, *(n + cached for n, cached in spec.prefills)]
    return sum(-(-c // block_size) for c in contexts)


def measure_swap(runner: ModelRunner, num_blocks: int = 16, warmup: int = 1,
                 repeats: int = 3) -> float | None:
    """Seconds per KV block of a swap-out plus a swap-in (median), or None without a host pool."""
    cache = runner.kv_cache
    n = min(num_blocks, cache.num_cpu_blocks, cache.num_gpu_blocks)
    if n <= 0:
        return None
    pairs = [(i, i) for i in range(n)]

    def swap() -> None:
        cache.swap_out(pairs)
        cache.swap_in(pairs)

    times = time_call(swap, warmup, repeats, _sync_for(runner.device))
    return statistics.median(times) / (2 * n)


# ---- LoRA steps ----------------------------------------------------------------------------
def lora_grid(max_num_seqs: int, max_loras: int, quick: bool = False
              ) -> list[tuple[StepSpec, int]]:
    """``(step, adapters)`` pairs: decode batches and a prefill chunk, each with 1, a few and
    ``max_loras`` distinct adapters (round-robin over the step's requests)."""
    batches = [b for b in ((1, 16) if quick else (1, 8, 32, 64)) if b <= max_num_seqs]
    counts = sorted({1, min(4, max_loras), max_loras})
    steps = [StepSpec(decodes=(128,) * b) for b in batches]
    steps.append(StepSpec(prefills=((256, 0),)))
    return [(spec, k) for spec in steps for k in counts if k <= max(1, len(spec.decodes))]


def measure_lora(runner: ModelRunner, adapter_dir: str, quick: bool = False, warmup: int = 1,
                 repeats: int = 3, progress: Log | None = None) -> list[StepSample]:
    """Times steps whose requests use adapters (random ones of rank ``max_lora_rank`` on every
    projection, written under ``adapter_dir``), each once with its adapters loaded in the step
    (``lora_loads``) and once with them resident: samples with ``lora_features``, from which
    the calibration fits the LoRA terms (products and loads) beside the base ones."""
    from twinserve.core.lora import (
        PEFT_TARGET_MODULES,
        LoRARequest,
        LoRAWork,
        adapter_terms,
        lora_step_features,
    )
    from twinserve.gpu.lora.lora_weights import write_random_adapter
    lora = runner.lora
    if lora is None:
        raise ValueError("measure_lora needs a runner built with enable_lora=True.")
    cfg = lora.lora_config
    rank = cfg.max_lora_rank
    names = []
    for i in range(cfg.max_loras):
        path = write_random_adapter(runner.config, Path(adapter_dir) / f"profile-lora{i}", rank, i)
        names.append(lora.acquire(LoRARequest(f"profile-lora{i}", i + 1, str(path))))
    per_token, weights, load = adapter_terms(runner.config, rank, rank, PEFT_TARGET_MODULES)
    samples, sync = [], _sync_for(runner.device)
    try:
        for spec, k in lora_grid(runner.engine_config.scheduler.max_num_seqs, cfg.max_loras, quick):
            step = build_step(spec, runner.block_size, runner.num_gpu_blocks, runner.vocab_size,
                              runner.kv_layout.num_groups)
            for i, sr in enumerate(step.scheduled):
                sr.request.lora = names[i % k]
            step.lora_loads = [(names[i], i) for i in range(k)]
            work = LoRAWork(per_token * step.total_num_scheduled_tokens, weights * k, k, load * k)
            for loaded in (True, False):
                if not loaded:
                    step.lora_loads = ()
                    work = LoRAWork(work.flops, work.weight_bytes, k)
                times = time_call(partial(runner.execute, step), warmup, repeats, sync)
                median = statistics.median(times)
                sample = StepSample.of_step(step, median, median, times)
                sample.lora_features = lora_step_features(work)
                samples.append(sample)
                if progress:
                    what = "loaded in the step" if loaded else "resident"
                    progress(f"LoRA {spec.label():<26} x {k} adapters, {what:<18} "
                             f"{median * 1e3:8.1f} ms")
    finally:
        for name in names:
            lora.release(name)
    return samples


# ---- everything, for one engine ------------------------------------------------------------
@dataclass(slots=True)
class BackendMeasurement:
    """What ``measure_backend`` measured: the micro-benchmarks (forward pass alone), the steps of
    the engine loop (whole step and forward pass) and the swap copy time per KV block (``None``
    without a host pool)."""

    micro: list[StepSample] = field(default_factory=list)
    loop: list[StepSample] = field(default_factory=list)
    seconds_per_swap_block: float | None = None
    lora: list[StepSample] = field(default_factory=list)  # with LoRA enabled: adapters' steps
    grid: MicroGrid | None = None  # the micro-benchmarks' steps, for more passes

    @property
    def samples(self) -> list[StepSample]:
        return self.micro + self.lora + self.loop


def measure_backend(runner: ModelRunner, engine_args: EngineArgs, quick: bool = False,
                    warmup: int = 1, repeats: int = 3, engine_loop: bool = True,
                    log: Log | None = None,
                    space: tuple[int, int, int] | None = None) -> BackendMeasurement:
    """Micro-benchmarks, swap copies and (with ``engine_loop``) synthetic workloads through an
    ``LLMEngine`` on ``runner`` (a loaded ``ModelRunner``), within the limits of its resolved
    engine configuration (batch budget, sequences, model length), or within ``space``
    (``(max_num_seqs, max_num_batched_tokens, max_model_len)``, a part of those limits)."""
    log = log or (lambda msg: None)
    seqs, budget, max_len = space or runner_space(runner)
    specs = default_grid(budget, seqs, max_len, quick, gpu=runner.device.type == "cuda")
    log(f"micro-benchmarks: {len(specs)} steps x ({warmup} warm-up + {repeats} repeats)")
    grid = MicroGrid.build(runner, specs, log, probe=grid_probe(seqs, budget, max_len))
    measured = BackendMeasurement(grid.run(warmup, repeats, log), grid=grid)
    measured.seconds_per_swap_block = measure_swap(runner, warmup=warmup, repeats=repeats)
    if measured.seconds_per_swap_block is not None:
        log(f"swap copies: {measured.seconds_per_swap_block * 1e6:.1f} us per KV block "
            "(out + in averaged)")
    if runner.lora is not None:
        with tempfile.TemporaryDirectory(prefix="twinserve-lora-") as adapter_dir:
            measured.lora = measure_lora(runner, adapter_dir, quick, warmup, repeats, log)
    if engine_loop:
        measured.loop = measure_engine_loop(runner, engine_args, quick, log, space=space)
    return measured


def runner_space(runner: ModelRunner) -> tuple[int, int, int]:
    """``(max_num_seqs, max_num_batched_tokens, max_model_len)`` of ``runner``'s engine."""
    limits = runner.engine_config.scheduler
    return limits.max_num_seqs, limits.max_num_batched_tokens, runner.max_model_len
