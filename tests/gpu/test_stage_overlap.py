"""The shared-stage slowdown measurement (``gpu.measurement.stage_overlap``) and its calibration
hook (``fidelity.calibration``): refusals, the reading's arithmetic, the profile it writes, and
one real reading on this host's PP=2 engine (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.fidelity.calibration import measure_stage_slowdown, with_stage_slowdown
from twinserve.gpu.measurement.profiler import StepSpec
from twinserve.gpu.measurement.stage_overlap import (
    ShapeOverlap,
    StageOverlap,
    measure_stage_overlap,
)
from twinserve.simulator.hardware import load_hardware


def _shape(alone: tuple[float, ...], shared: tuple[float, ...]) -> ShapeOverlap:
    return ShapeOverlap("s", 1, alone, shared, (0.001,) * len(alone), 1024)


def test_the_reading_is_the_median_over_shapes_of_each_shapes_median_ratio() -> None:
    overlap = StageOverlap((_shape((1.0, 2.0, 1.0), (2.0, 9.0, 2.0)),  # 2.0 / 1.0
                            _shape((0.5, 0.5, 0.25), (0.75, 0.5, 1.0)),  # 0.75 / 0.5
                            _shape((1.0,), (1.25,))))
    assert overlap.measured == 1.5
    assert overlap.slowdown == 1.5
    assert "shared-stage slowdown 1.500" in overlap.describe()


def test_a_reading_below_one_is_noise_and_stored_as_one() -> None:
    overlap = StageOverlap((_shape((1.0,), (0.9,)),))
    assert overlap.measured == pytest.approx(0.9)
    assert overlap.slowdown == 1.0
    with pytest.raises(ValueError, match="shapes"):
        StageOverlap(())


def test_the_calibration_writes_the_median_of_its_readings(tmp_path: Path) -> None:
    path = load_hardware("cpu").save(tmp_path / "p.json")
    assert with_stage_slowdown(path, []) == path
    assert load_hardware(path).shared_stage_slowdown == 1.0  # none measured: left as it was
    with_stage_slowdown(path, [1.5, 2.25, 1.75])
    assert load_hardware(path).shared_stage_slowdown == 1.75


def test_a_runner_without_stages_is_refused_and_not_measured(tiny_runner) -> None:
    _, runner = tiny_runner
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        measure_stage_overlap(runner)
    assert measure_stage_slowdown(runner, lambda msg: None) is None


@pytest.mark.slow
def test_two_stages_of_the_bundled_model_read_a_sane_slowdown(default_model_dir) -> None:
    """PP=2 on this 2-core host: a stage beside the other runs at most a few times slower (1.0
    with the host otherwise idle, 1.6-2.2 with other work on it, one thread per stage; a reading
    below 1 is stored as 1); the send carries the hidden states and the residual of every token."""
    from twinserve.gpu.worker.model_runner import ModelRunner
    runner = ModelRunner(EngineArgs(model=str(default_model_dir), dtype="bfloat16",
                                    pipeline_parallel_size=2, max_model_len=128,
                                    max_num_seqs=16, max_num_batched_tokens=256))
    try:
        specs = [StepSpec(decodes=(64,) * 6), StepSpec(prefills=((64, 0),))]
        overlap = measure_stage_overlap(runner, specs, rounds=5)
        hidden = runner.config.hidden_size
        assert [s.send_bytes for s in overlap.shapes] == [2 * n * hidden * 2 for n in (6, 64)]
        assert runner.tp is not None and runner.tp.max_batches_in_flight == 0
    finally:
        runner.shutdown()
    assert 0.8 <= overlap.measured <= 4.0 and overlap.slowdown == max(1.0, overlap.measured), \
        overlap.describe()
    assert all(s.alone_s and s.shared_s for s in overlap.shapes), overlap.describe()


def test_each_level_round_reads_the_slowdown_before_its_replay(monkeypatch, tiny_runner) -> None:
    """``InterleavedCalibration.measure_level`` (validate: before each replay) keeps every
    reading, which ``save`` stores as their median."""
    import twinserve.fidelity.calibration as calibration
    from twinserve.fidelity.interleaved import InterleavedCalibration
    from twinserve.fidelity.settings import CalibrationSettings
    eargs, runner = tiny_runner
    readings = iter([1.5, 2.0])
    monkeypatch.setattr(calibration, "measure_stage_slowdown", lambda r, log: next(readings))
    cal = InterleavedCalibration(CalibrationSettings(quick=True, engine_loop=False), eargs,
                                 runner, lambda msg: None)
    cal.measure_level()
    cal.measure_level()
    assert cal.stage_slowdowns == [1.5, 2.0]
