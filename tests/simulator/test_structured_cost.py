"""The twin's mask cost for constrained decoding (simulator/structured_cost.py): a JSON-mode-heavy
replay takes longer by exactly the modeled mask time, the seeded choice of constrained requests,
the profile fields, and the real engine's measurement that calibrates them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.structured_cost import (
    DEFAULT_MASK_S_PER_ROW,
    StructuredCost,
    StructuredWorkload,
)
from twinserve.traces.trace_request import TraceRequest

PER_ROW = 2e-3
PER_STEP = 5e-3


def _trace(n: int = 24) -> list[TraceRequest]:
    # all at t=0: the scheduler's choices do not depend on the step times, so both replays run
    # the same steps and differ by the mask time alone
    return [TraceRequest(f"r{i}", 0.0, 40 + 7 * i, 8 + (i * 5) % 17) for i in range(n)]


def _profile(tmp_path: Path, per_row: float, per_step: float) -> str:
    hw = dataclasses.replace(load_hardware("h100-sxm"), name="h100-masks",
                             structured_mask_s_per_row=per_row,
                             structured_mask_s_per_step=per_step)
    return str(hw.save(tmp_path / "h100-masks.json"))


def _makespan(result) -> float:
    return max(r.finish_time for r in result.records)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_json_mode_heavy_replay_takes_longer_by_the_modeled_mask_time(tmp_path, fraction):
    trace = _trace()
    cfg = SimConfig(model="llama-3-8b", hardware=_profile(tmp_path, PER_ROW, 0.0),
                    max_num_seqs=8, max_num_batched_tokens=256)
    plain = simulate(cfg, trace)
    workload = StructuredWorkload(fraction, seed=3)
    masked = simulate(cfg, trace, structured=workload)
    constrained = [tr for tr in trace if workload.is_constrained(tr.request_id)]
    assert 0 < len(constrained) <= len(trace) and (fraction < 1 or constrained == trace)
    rows = sum(tr.output_tokens for tr in constrained)   # one sampled row per output token
    assert _makespan(masked) - _makespan(plain) == pytest.approx(PER_ROW * rows, rel=1e-9)
    assert len(masked.steps) == len(plain.steps)
    unaffected = simulate(cfg, trace, structured=StructuredWorkload(0.0))
    assert _makespan(unaffected) == _makespan(plain)


def test_the_per_step_term_counts_steps_with_constrained_rows(tmp_path):
    trace = _trace(6)
    cfg = SimConfig(model="llama-3-8b", hardware=_profile(tmp_path, 0.0, PER_STEP),
                    max_num_seqs=8, max_num_batched_tokens=4096)
    plain = simulate(cfg, trace)
    masked = simulate(cfg, trace, structured=StructuredWorkload(1.0))
    sampling_steps = max(tr.output_tokens for tr in trace)   # one prefill step, then decodes
    assert _makespan(masked) - _makespan(plain) == pytest.approx(PER_STEP * sampling_steps)


def test_workload_choice_is_seeded_and_checked():
    ids = [f"req-{i}" for i in range(2000)]
    half = StructuredWorkload(0.5, seed=1)
    chosen = [i for i in ids if half.is_constrained(i)]
    assert 900 < len(chosen) < 1100
    assert chosen == [i for i in ids if StructuredWorkload(0.5, seed=1).is_constrained(i)]
    assert chosen != [i for i in ids if StructuredWorkload(0.5, seed=2).is_constrained(i)]
    assert not any(StructuredWorkload(0.0).is_constrained(i) for i in ids)
    with pytest.raises(ValueError, match="structured_fraction"):
        StructuredWorkload(1.5)
    with pytest.raises(ValueError, match="mask_s_per_row"):
        StructuredCost(mask_s_per_row=-1.0)
    assert load_hardware("a100-80gb").structured_mask_s_per_row == DEFAULT_MASK_S_PER_ROW
    with pytest.raises(ValueError, match="structured_mask_s_per_row"):
        dataclasses.replace(load_hardware("a100-80gb"), structured_mask_s_per_row=-1.0)


def test_simulate_cli_takes_structured_fraction(tmp_path):
    import json

    from twinserve.entrypoints.cli.main import main
    out = tmp_path / "run"
    assert main(["simulate", "--num-requests", "20", "--structured-fraction", "0.5",
                 "--out", str(out), "--disable-tqdm"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert json.dumps(config).count('"structured_fraction": 0.5') == 1


def test_mask_measurement_on_the_real_engine(tmp_path):
    """The calibration's measurement runs the engine's masks and fits non-negative terms."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from twinserve.gpu.measurement.structured_mask_profile import measure_mask_time
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"name": "a", "age": 3, "tags": ["x"]} 0123456789'] * 10,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet(), show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    timing = measure_mask_time(path, tok.get_vocab_size(), 1, rows=(1, 4), steps=6)
    assert timing.rows == (1, 4) and len(timing.median_s) == 2
    assert timing.per_row_s >= 0 and timing.per_step_s >= 0
    assert timing.per_row_s > 0 or timing.per_step_s > 0
    # calibrate's hook writes the measured terms into the profile it saved
    from types import SimpleNamespace

    from twinserve.fidelity.mask_timing import add_mask_timing
    profile = Path(_profile(tmp_path, DEFAULT_MASK_S_PER_ROW, 0.0))
    runner = SimpleNamespace(model_dir=tmp_path, vocab_size=tok.get_vocab_size(),
                             tokenizer=SimpleNamespace(eos_token_id=1))
    add_mask_timing(profile, runner)
    hw = load_hardware(profile)
    assert (hw.structured_mask_s_per_row, hw.structured_mask_s_per_step) != \
        (DEFAULT_MASK_S_PER_ROW, 0.0)
    assert hw.structured_mask_s_per_row >= 0 and hw.structured_mask_s_per_step >= 0
