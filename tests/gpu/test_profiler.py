"""The backend's measurement for calibration: hand-built steps, the micro-benchmark grid and its
probe, the engine-loop workloads, the host-speed probe and the interleaved calibration, on a
tiny random Llama (``tiny_model``, ``tiny_runner``: conftest)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest


def test_build_step_aggregates_match_the_scheduler() -> None:
    from twinserve.core.config import SchedulerConfig
    from twinserve.core.outputs import ModelRunnerOutput
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.core.scheduler import Scheduler, make_request
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    from twinserve.policies import get_policy
    # the scheduler's own accounting of 3 decodes at context 40 + a 50-token chunk after 32
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=16, max_model_len=256,
                          enable_prefix_caching=False)
    sched = Scheduler(cfg, get_policy("fcfs"))
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    tokens = ModelRunnerOutput({f"d{i}": [7] for i in range(3)})
    for i in range(3):
        sched.add_request(make_request(f"d{i}", [20 + i] * 38, sampling_params=params))
    sched.update_from_output(sched.schedule(0.0), tokens, 0.0)
    sched.add_request(make_request("p", [30] * 82, sampling_params=params))
    cfg.max_num_batched_tokens = 3 + 32
    sched.update_from_output(sched.schedule(0.0), tokens, 0.0)
    cfg.max_num_batched_tokens = 8192
    theirs = aggregates(sched.schedule(0.0))
    mine = aggregates(build_step(StepSpec(decodes=(40,) * 3, prefills=((50, 32),)), 16, 64, 256))
    assert mine == theirs
    assert mine["sum_decode_context_tokens"] == 120 and mine["num_prefill_tokens"] == 50
    with pytest.raises(ValueError, match="KV blocks"):
        build_step(StepSpec(decodes=(200,) * 8), 16, 16, 256)


def test_grid_times_every_decode_batch_size_and_scenarios_are_validated() -> None:
    from twinserve.gpu.engine.engine_loop import LoopScenario, default_scenarios
    from twinserve.gpu.measurement.profiler import batch_sweep, default_grid
    assert batch_sweep(40) == [*range(1, 33), 40]
    assert batch_sweep(300) == [*range(1, 33), *range(40, 257, 8)]
    assert batch_sweep(64, quick=True) == [*range(1, 17), 32, 48, 64]
    for max_num_seqs in (6, 32, 64):
        sizes = {len(s.decodes) for s in default_grid(512, max_num_seqs, 512) if not s.prefills}
        assert set(range(1, min(max_num_seqs, 32) + 1)) <= sizes
        assert max(sizes) == max_num_seqs
    grid = default_grid(512, 64, 512)  # prompts' chunks between the powers of two, and mixed
    fresh = {s.prefills[0][0] for s in grid if not s.decodes and s.prefills[0][1] == 0}
    assert {16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512} <= fresh
    mixed = {(len(s.decodes), s.prefills[0][0]) for s in grid if s.kind == "mixed"}
    assert {(b, n) for b in (1, 2, 4, 8, 16, 32) for n in (16, 48, 96, 192, 384)} <= mixed
    # several short chunks after cached prefixes in one step, as prefix-cache hits arrive
    prefix = {(len(s.prefills), *s.prefills[0]) for s in grid
              if len(s.prefills) > 1 and s.prefills[0][1]}
    assert prefix == {(k, n, c) for k in (4, 10) for n in (8, 32) for c in (64, 240, 480)}
    from twinserve.core.step_sample import aggregates
    from twinserve.gpu.measurement.profiler import StepSpec, build_step
    agg = aggregates(build_step(StepSpec(prefills=((8, 0), (8, 128), (4, 64))), 16, 64, 256))
    assert agg["num_prefix_chunks"] == 2 and agg["sum_prefix_context_tokens"] == 192
    assert agg["sum_context_tokens"] == 36 + 8 * 128 + 36 + 4 * 64 + 10
    assert agg["sum_prefill_attention_area"] == 8 * 8 + 8 * 136 + 4 * 68
    for sc in default_scenarios(32, 512):
        lengths = sc.lengths()
        assert len(lengths) == 2 * sc.concurrency and sc.concurrency <= 32
        assert all(16 <= p <= 472 and 4 <= o <= 28 for p, o in lengths)
        assert lengths == sc.lengths()  # seeded
    assert len({o for sc in default_scenarios(32, 512) for _, o in sc.lengths()}) > 5
    for bad, field in ((dict(concurrency=0), "concurrency"), (dict(prompt_len_max=3), "below"),
                       (dict(num_requests=0), "num_requests")):
        with pytest.raises(ValueError, match=field):
            LoopScenario(**{"num_requests": 2, "prompt_len": 8, "output_len": 4, **bad})


def test_engine_loop_holds_its_concurrency_and_runs_every_request(tiny_runner) -> None:
    """A serving-like scenario: never more requests in a step than in flight, every request
    generates its own number of tokens, and batches change their make-up from step to step."""
    from twinserve.gpu.engine.engine_loop import LoopScenario, run_engine_loop
    from twinserve.gpu.engine.llm_engine import LLMEngine
    eargs, runner = tiny_runner
    engine = LLMEngine(eargs, runner=runner, usage_context="server")
    sc = LoopScenario(9, 8, 2, concurrency=3, prompt_len_max=60, output_len_max=9, seed=4)
    steps = run_engine_loop(engine, [sc], detokenize=False)
    seqs = [s.aggregates["num_decode_seqs"] + s.aggregates["num_prefill_seqs"] for s in steps]
    assert max(seqs) == 3
    assert sum(s.aggregates["num_decode_tokens"] for s in steps) == sum(
        o - 1 for _, o in sc.lengths())  # the first token of each comes from its prefill
    assert len({s.aggregates["sum_decode_context_tokens"] for s in steps if s.kind == "decode"}) > 5
    assert any(s.kind == "mixed" for s in steps)
    assert not engine.has_unfinished_requests()
    assert runner.kv_cache is not None and engine.scheduler.kv.usage == 0.0


def test_the_speed_probe_times_the_same_steps_on_any_engine(tiny_model: Path) -> None:
    """The probe's steps fit a cache of 48 blocks, and timed on a runner they set against a fit
    whose probe took a third of the time give a host about 3x slower (1.5..6 on a shared host)."""
    from twinserve.entrypoints.cli.calibrate import load_runner
    from twinserve.entrypoints.cli.main import build_parser
    from twinserve.gpu.measurement.profiler import speed_probe, speed_probe_specs
    from twinserve.simulator.hardware import FittedParams
    specs = speed_probe_specs(32, 512, 512)
    assert [s.kind for s in specs] == ["decode"] * 3 + ["prefill"]
    assert max(sum(-(-c // 16) for c in (*s.decodes, *(n for n, _ in s.prefills)))
               for s in specs) <= 48
    args = build_parser().parse_args(["calibrate", "--model", str(tiny_model), "--max-num-seqs",
                                      "16", "--max-num-batched-tokens", "128", "--max-model-len",
                                      "128", "--dtype", "float32", "--out", "unused.json"])
    _, runner = load_runner(args)
    probe = speed_probe(runner, repeats=3)
    assert set(probe) == {s.label() for s in speed_probe_specs(16, 128, 128)}
    fit = FittedParams(0.0, {}, model="m", speed_probe={k: v / 3 for k, v in probe.items()})
    assert 1.5 < fit.host_speed(speed_probe(runner, repeats=3)) < 6.0


def test_engine_loop_retries_what_a_small_cache_refuses(tiny_runner) -> None:
    """A scenario holding more prompt tokens in flight than the waiting bound admits (a small
    cache: ``validate --num-gpu-blocks-override``) is fed as the bound allows, step by step,
    instead of failing with EngineOverloaded; every request runs."""
    import dataclasses

    from twinserve.gpu.engine.engine_loop import LoopScenario, run_engine_loop
    from twinserve.gpu.engine.llm_engine import LLMEngine
    eargs, runner = tiny_runner
    engine = LLMEngine(eargs, runner=runner, usage_context="server")
    scheduler = engine.scheduler  # the bound a small cache would set (4 x its tokens)
    scheduler.config = dataclasses.replace(scheduler.config, max_waiting_tokens=100)
    sc = LoopScenario(12, 30, 3, concurrency=12, prompt_len_max=60, output_len_max=5, seed=2)
    assert sum(p for p, _ in sc.lengths()) > 100
    steps = run_engine_loop(engine, [sc], detokenize=False)
    assert sum(s.aggregates["num_prefill_seqs"] for s in steps) >= 12
    assert sum(s.aggregates["num_decode_tokens"] for s in steps) == sum(
        o - 1 for _, o in sc.lengths())
    assert not engine.has_unfinished_requests()


def test_the_grid_read_against_its_probe_keeps_its_shape_on_a_drifting_host() -> None:
    """``MicroGrid`` with a probe step: on a host whose speed drifts within a pass and between
    passes (a fake clock here, each step's time its base time x the speed at that call), the
    steps read against the probes beside them keep their true ratios, where the raw times
    bend them by the drift."""
    import itertools
    import types

    import torch

    from twinserve.core.outputs import SchedulerOutput
    from twinserve.gpu.measurement import profiler
    from twinserve.gpu.measurement.profiler import MicroGrid, StepSpec, grid_probe

    clock = [0.0]
    calls = itertools.count()

    def execute(step: SchedulerOutput) -> None:  # base time: 1 ms per token, drift up to 1.8x
        speed = 1.0 + 0.8 * abs(math.sin(next(calls) / 12))
        clock[0] += 1e-3 * step.total_num_scheduled_tokens * speed

    runner = types.SimpleNamespace(block_size=16, num_gpu_blocks=4096, vocab_size=256,
                                   kv_layout=types.SimpleNamespace(num_groups=1),
                                   device=torch.device("cpu"), execute=execute)
    specs = [StepSpec(prefills=((n, 0),)) for n in (16, 32, 64, 96, 128, 256)]
    specs += [StepSpec(decodes=(64,) * b) for b in (1, 4, 16, 32)]
    tokens = [s.num_tokens for s in specs]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(profiler.time, "perf_counter", lambda: clock[0])
        grids = [MicroGrid.build(runner, specs, probe=probe, seed=3)  # type: ignore[arg-type]
                 for probe in (grid_probe(32, 512, 512), None)]
        for grid in grids:
            grid.run(warmup=0, repeats=4)
    probed, raw = ([s.seconds / n for s, n in zip(g.samples(), tokens)] for g in grids)
    assert max(probed) / min(probed) < 1.02  # the same time per token, whatever the drift
    assert max(raw) / min(raw) > 1.1
    assert grids[0].probe is not None and grids[1].probe is None


@pytest.mark.parametrize("limits", [(32, 512, 512), (1, 8, 64), (2, 2, 16), (5, 16, 8), (5, 4, 64)])
def test_the_grid_probe_fits_the_engine_limits(limits: tuple[int, int, int]) -> None:
    """``grid_probe`` within any engine's limits: no more sequences, tokens or context than the
    engine schedules, and a prefill chunk always (the probe loads the host as both kinds do)."""
    from twinserve.gpu.measurement.profiler import grid_probe
    max_num_seqs, max_num_batched_tokens, max_model_len = limits
    spec = grid_probe(max_num_seqs, max_num_batched_tokens, max_model_len)
    assert len(spec.decodes) + len(spec.prefills) <= max_num_seqs and len(spec.prefills) == 1
    assert 0 < spec.num_tokens <= max_num_batched_tokens
    assert all(c < max_model_len for c in spec.decodes)
    assert all(n + cached < max_model_len for n, cached in spec.prefills)


def test_each_round_times_the_grid_again_and_its_medians_span_the_rounds(tiny_model: Path) -> None:
    """``InterleavedCalibration.measure_level`` adds a timed pass of the micro-benchmark grid
    before each round's engine loop: every grid step then holds the initial repeats plus one
    time per round, and the micro samples the fit uses are their medians."""
    import statistics

    from twinserve.entrypoints.cli.calibrate import calibration_settings, load_runner
    from twinserve.entrypoints.cli.main import build_parser
    from twinserve.fidelity.interleaved import InterleavedCalibration
    args = build_parser().parse_args(["calibrate", "--model", str(tiny_model), "--quick",
                                      "--repeats", "2", "--max-num-seqs", "8",
                                      "--max-num-batched-tokens", "64", "--max-model-len", "128",
                                      "--dtype", "float32", "--out", "unused.json"])
    eargs, runner = load_runner(args)
    cal = InterleavedCalibration(calibration_settings(args), eargs, runner, lambda msg: None)
    cal.measure_grid()
    grid = cal.measured.grid
    assert grid is not None and grid.steps and all(len(t) == 2 for t in grid.times)
    for _ in range(2):
        cal.measure_level()
    assert all(len(t) == 4 for t in grid.times) and grid.probe is not None
    assert all(len(p) == 4 for p in grid.probe_times)
    read = grid.read_times()
    assert [s.seconds for s in cal.measured.micro] == [statistics.median(t) for t in read]
    assert [s.repeats for s in cal.measured.micro] == read
    assert len(cal.probes) == 2 and cal.fit("tiny-llama").params.num_samples > 0
    # one part of the engine loop (the fidelity study splits it between its replays)
    from twinserve.gpu.engine.engine_loop import runner_scenarios
    logged: list[str] = []
    cal.log, steps = logged.append, len(cal.measured.loop)
    assert cal.num_loop_parts() == len(runner_scenarios(runner, quick=True)) > 1
    cal.measure_loop([1])
    assert [m.split(":")[0] for m in logged if m.startswith("[")] == [
        f"[1] {runner_scenarios(runner, quick=True)[1].label()}"]
    assert len(cal.measured.loop) > steps and len(cal.probes) == 3
    assert all(len(t) == 4 for t in grid.times)  # the grid was not timed again
