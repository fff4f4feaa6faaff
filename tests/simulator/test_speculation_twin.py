"""The twin schedules speculation through the shared scheduler: its synthetic drafts are
accepted at the configured per-position rates, and run folders record the counts."""

from __future__ import annotations

import csv

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.engine import AcceptanceModel
from twinserve.traces import SyntheticConfig, synthetic_trace


def spec_config(rate, k: int = 3, policy: str = "fixed") -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "policy": policy,
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rate}


def run(spec: dict | None, n: int = 60):
    trace = synthetic_trace(SyntheticConfig(num_requests=n, input_len=200, output_len=120,
                                            request_rate=4.0, seed=3))
    return simulate(SimConfig(EngineArgs(speculative_config=spec, max_num_seqs=16)), trace)


def test_acceptance_statistics_match_the_given_rates():
    rates = [0.8, 0.5, 0.25]
    result = run(spec_config(rates))
    s = result.summary
    assert s["completed"] == 60
    assert s["spec_num_drafts"] > 500
    # position j is reached with prod(rates[:j]); the expected accepted per verification of k
    # drafts is the sum of those products (most verifications carry all 3 drafts)
    expected = 0.8 + 0.8 * 0.5 + 0.8 * 0.5 * 0.25
    per_draft = s["spec_num_accepted_tokens"] / s["spec_num_drafts"]
    assert per_draft == pytest.approx(expected, rel=0.08)
    assert s["spec_mean_acceptance_length"] == pytest.approx(1 + per_draft)
    # every request still ends at its trace length
    assert s["total_output_tokens"] == sum(r.output_tokens for r in result.records)


def test_speculation_shortens_decoding_when_drafts_are_accepted():
    plain, spec = run(None), run(spec_config(0.9))
    assert spec.summary["total_output_tokens"] == plain.summary["total_output_tokens"]
    assert spec.summary["mean_tpot_ms"] < 0.8 * plain.summary["mean_tpot_ms"]
    assert "spec_num_drafts" not in plain.summary


def test_run_folder_records_per_request_counts(tmp_path):
    result = run(spec_config(0.6), n=12)
    folder = write_sim_run(result, tmp_path / "run", {"trace": "synthetic"})
    rows = list(csv.DictReader(open(folder / "requests.csv")))
    assert sum(int(r["spec_num_draft_tokens"]) for r in rows) == \
        result.summary["spec_num_draft_tokens"]
    assert all(int(r["spec_num_accepted_tokens"]) <= int(r["spec_num_draft_tokens"]) for r in rows)
    config = (folder / "config.json").read_text()
    assert '"synthetic_acceptance_rate": 0.6' in config and '"num_speculative_tokens": 3' in config


def test_the_twin_needs_acceptance_rates():
    with pytest.raises(ValueError, match="synthetic_acceptance_rate"):
        run({"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="acceptance rates"):
        AcceptanceModel([1.5])
    model = AcceptanceModel([1.0, 0.0], seed=1)
    assert [model.num_accepted("r", p, 3) for p in range(5)] == [1] * 5


def _twin(spec: dict | None, qps: float):
    trace = synthetic_trace(SyntheticConfig(num_requests=200, input_len=512, output_len=128,
                                            request_rate=qps, seed=1))
    return simulate(SimConfig(EngineArgs(speculative_config=spec, max_num_seqs=256)),
                    trace).summary


def test_adaptive_pays_at_low_load_and_does_not_lose_at_saturation():
    """The self-tuning policy against none and fixed k = 4 (acceptance 0.7 per position): at
    low load it cuts TPOT as fixed k does; saturated, where fixed k loses throughput, it keeps
    at least 0.97x of no speculation's."""
    adaptive, fixed = spec_config(0.7, k=4, policy="adaptive"), spec_config(0.7, k=4)
    low = {name: _twin(spec, 1.0) for name, spec in
           (("none", None), ("adaptive", adaptive))}
    assert low["adaptive"]["mean_tpot_ms"] < 0.6 * low["none"]["mean_tpot_ms"]
    high = {name: _twin(spec, 64.0) for name, spec in
            (("none", None), ("fixed", fixed), ("adaptive", adaptive))}
    assert high["fixed"]["output_throughput"] < 0.95 * high["none"]["output_throughput"]
    assert high["adaptive"]["output_throughput"] >= 0.97 * high["none"]["output_throughput"]
