"""validate with speculation: a replay's acceptance is kept in its run folder, and the twin
replays a given profile (another workload's) before the run's own."""

from __future__ import annotations

import dataclasses
import json

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.fidelity.acceptance import ACCEPTANCE_FILE, record_acceptance, twin_acceptance
from twinserve.fidelity.twins import simulate_twin
from twinserve.fidelity.workload import Workload
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.acceptance import AcceptanceProfile
from twinserve.traces import SyntheticConfig, synthetic_trace

TRACE = synthetic_trace(SyntheticConfig(num_requests=30, input_len=100, output_len=60,
                                        request_rate=5.0, seed=2))


def spec_run(tmp_path, rate: float, name: str = "real"):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed",
            "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": rate}
    result = simulate(SimConfig(EngineArgs(speculative_config=spec, max_num_seqs=8)), TRACE)
    return write_sim_run(result, tmp_path / name, {"trace": "synthetic"}), result


def test_run_folder_records_its_acceptance(tmp_path):
    folder, result = spec_run(tmp_path, 0.6)
    profile = record_acceptance(folder, "synthetic")
    assert profile is not None and (folder / ACCEPTANCE_FILE).is_file()
    s = result.summary
    assert profile.num_drafts == s["spec_num_drafts"]
    assert profile.mean_acceptance_length == pytest.approx(s["spec_mean_acceptance_length"])
    assert profile.rates[0] == pytest.approx(0.6, abs=0.06)
    per_pos = [profile.num_drafts // 2, profile.num_drafts // 4, profile.num_drafts // 16]
    counted = record_acceptance(folder, "synthetic", per_pos)
    assert counted is not None and counted.rates == pytest.approx(
        (per_pos[0] / profile.num_drafts, per_pos[1] / per_pos[0], per_pos[2] / per_pos[1]))
    assert counted.proposal_rate > 0.9 and counted.mean_draft_length == 0
    plain = write_sim_run(simulate(SimConfig(EngineArgs(max_num_seqs=8)), TRACE),
                          tmp_path / "plain", {"trace": "synthetic"})
    assert record_acceptance(plain, "synthetic") is None
    assert not (plain / ACCEPTANCE_FILE).exists()


def test_twin_replays_the_given_acceptance_before_the_runs_own(tmp_path):
    folder, _ = spec_run(tmp_path, 0.6)
    config = json.loads((folder / "config.json").read_text())
    config["speculative_config"].update(rejection_sample_method="probabilistic",
                                        synthetic_acceptance_rate=None)
    (folder / "config.json").write_text(json.dumps(config))  # as a real ngram run records it
    record_acceptance(folder, "code-edits")
    given = AcceptanceProfile("rewrites", (0.95,)).save(tmp_path / "rewrites.json")
    messages: list[str] = []
    chosen = twin_acceptance(folder, (given,), messages.append)
    assert chosen is not None and chosen.workload == "rewrites" and "given" in messages[-1]
    assert "pooled draws" in messages[-1]
    own = twin_acceptance(folder, (), messages.append)
    assert own is not None and own.workload == "code-edits" and "not held out" in messages[-1]
    workload = Workload(tuple(TRACE), {"trace": "synthetic"})
    twin_given = simulate_twin("a100-80gb", workload, folder, tmp_path / "sim1",
                               "llama-3-8b", acceptance=chosen)
    twin_own = simulate_twin("a100-80gb", workload, folder, tmp_path / "sim2",
                             "llama-3-8b", acceptance=own)
    assert twin_given["spec_mean_acceptance_length"] > twin_own["spec_mean_acceptance_length"] + 0.5
    recorded = json.loads((tmp_path / "sim1" / "config.json").read_text())
    assert recorded["acceptance_profile"]["workload"] == "rewrites"


def test_synthetic_runs_keep_their_configured_rates(tmp_path):
    folder, _ = spec_run(tmp_path, 0.6)
    record_acceptance(folder, "synthetic")
    assert twin_acceptance(folder, (), lambda m: None) is None


def test_a_capped_self_tuning_run_is_measured_against_its_cap(tmp_path):
    """With ``max_num_speculative_tokens`` the self-tuning policy may draft up to the cap: drafts
    of the configured k then fall short of k_max, and the profile keeps their mean length."""
    folder, result = spec_run(tmp_path, 0.6)
    config = json.loads((folder / "config.json").read_text())
    config["speculative_config"]["max_num_speculative_tokens"] = 6
    (folder / "config.json").write_text(json.dumps(config))
    profile = record_acceptance(folder, "synthetic")
    s = result.summary
    assert profile is not None
    assert profile.mean_draft_length == pytest.approx(
        s["spec_num_draft_tokens"] / s["spec_num_drafts"], abs=1e-3)


def test_a_runs_drafts_record_gives_its_profile_one_unit_per_request(tmp_path):
    from tests.simulator.test_acceptance_units import record
    from twinserve.core.draft_record import DRAFTS_FILE, write_drafts
    folder, _ = spec_run(tmp_path, 0.6)
    rows = [dataclasses.replace(s, request_id=rid) for rid, onset in (("a", 4), ("b", None))
            for s in record(onset, 30)]
    write_drafts(folder / DRAFTS_FILE, rows)
    profile = record_acceptance(folder, "synthetic")
    assert profile is not None and profile.draws == "requests"  # units recorded and drawn
    assert [u.onset for u in profile.requests] == [4, None]
    assert profile.chain is not None
    saved = AcceptanceProfile.load(folder / ACCEPTANCE_FILE)
    assert saved.requests == profile.requests
