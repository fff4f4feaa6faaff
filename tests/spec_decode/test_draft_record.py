"""A real replay with speculation records each request's drafts step by step (``drafts.csv``):
the record adds up to the request's vLLM counters, every verification follows the proposal
that found its drafts, and the run's acceptance profile carries the chain fitted on it and one
unit per request."""

from __future__ import annotations

import csv
import json

import pytest

from twinserve.core.draft_record import DRAFTS_FILE, DraftStep, read_drafts, write_drafts
from twinserve.traces import SyntheticConfig, synthetic_trace

# prompts that repeat (a short vocabulary), so that ngram finds drafts
TRACE = synthetic_trace(SyntheticConfig(num_requests=6, input_len=48, output_len=24,
                                        request_rate=50.0, seed=3))


@pytest.fixture(scope="module")
def replay_dir(tiny_model, tmp_path_factory):
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.engine.replay import replay_real, write_real_run
    engine = LLMEngine(EngineArgs(model=str(tiny_model), dtype="float32", max_model_len=256,
                                  kv_cache_memory_bytes=1 << 22, speculative_config={
                                      "method": "ngram", "num_speculative_tokens": 3,
                                      "prompt_lookup_min": 1, "policy": "fixed"}))
    run = replay_real(engine, TRACE, progress=False, detokenize=False)
    return write_real_run(run, engine, tmp_path_factory.mktemp("runs") / "real",
                          {"trace": "synthetic"}, str(tiny_model))


def test_the_record_adds_up_to_each_requests_counters(replay_dir):
    steps = read_drafts(replay_dir / DRAFTS_FILE)
    with open(replay_dir / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sum(int(r["spec_num_drafts"]) for r in rows) > 0
    for r in rows:
        mine = [s for s in steps if s.request_id == r["request_id"]]
        assert sum(s.num_drafts > 0 for s in mine) == int(r["spec_num_drafts"])
        assert sum(s.num_drafts for s in mine) == int(r["spec_num_draft_tokens"])
        assert sum(s.num_accepted for s in mine) == int(r["spec_num_accepted_tokens"])
        for before, after in zip(mine, mine[1:]):  # drafts are verified the step after found
            assert after.num_drafts <= before.num_found
            assert after.position == before.position + 1 + after.num_accepted


def test_the_runs_profile_carries_its_chain_and_draws_its_units(replay_dir):
    from twinserve.fidelity.acceptance import ACCEPTANCE_FILE, record_acceptance
    profile = record_acceptance(replay_dir, "synthetic")
    assert profile is not None and profile.draws == "requests"
    data = json.loads((replay_dir / ACCEPTANCE_FILE).read_text())
    assert data["format_version"] == 3 and data["draws"] == "requests"
    assert len(profile.requests) == len(data["requests"]) == len(TRACE)  # one unit a request
    asked = sum(s.num_asked > 0 for s in read_drafts(replay_dir / DRAFTS_FILE))
    assert profile.chain is not None  # the tiny random model loops, and ngram copies the loop
    assert data["chain"]["num_requests"] == len(TRACE)
    assert 0 < profile.chain.num_transitions <= asked


def test_drafts_files_round_trip_and_refuse_bad_rows(tmp_path):
    steps = [DraftStep("a", 10, 0, 0, 3, 2), DraftStep("a", 13, 2, 2, 3, 0)]
    assert read_drafts(write_drafts(tmp_path / DRAFTS_FILE, steps)) == steps
    (tmp_path / "bad.csv").write_text("request_id,position,num_drafts,num_accepted,num_asked,"
                                      "num_found\na,1,2,3,4,4\n")
    with pytest.raises(ValueError, match="num_accepted"):
        read_drafts(tmp_path / "bad.csv")
    (tmp_path / "other.csv").write_text("request_id,tokens\na,1\n")
    with pytest.raises(ValueError, match="not a drafts file"):
        read_drafts(tmp_path / "other.csv")
