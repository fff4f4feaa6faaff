"""The twin's charges for speculative decoding: a verification is timed as what the engine's
kernels run (on the CPU's native attention the 1 + k decode rows of a short context, else a chunk
that reads its context once and samples 1 + k rows), the proposer's time is added, and
acceptance is drawn per position from given or measured rates."""

from __future__ import annotations

import json

import pytest

from twinserve.core.kernel_settings import KernelSettings, rows_as_decodes
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.simulator.acceptance import AcceptanceModel, AcceptanceProfile
from twinserve.simulator.cost_model import CostModel, FittedCostModel
from twinserve.simulator.hardware import FittedParams, load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.spec_cost import (
    ProposerCost,
    WithSpeculation,
    proposer_cost_for,
    recount_verifications,
    rows_rule_for,
    sample_row_seconds,
    verification_as_chunks,
    with_speculation,
)

PROMPT = 100


def entry(rid: str, context: int, drafts: int = 0, draft_next: int = 0) -> ScheduledRequest:
    """A decode entry at ``context`` tokens (its own token at ``context``) verifying ``drafts``."""
    request = Request(rid, list(range(PROMPT)), SamplingParams(max_tokens=10_000), 0.0)
    spec = [7] * drafts
    sr = ScheduledRequest(request, context, 1 + drafts, [], True, spec_token_ids=spec)
    sr.num_draft_next = draft_next
    return sr


def step(*entries: ScheduledRequest) -> SchedulerOutput:
    out = SchedulerOutput()
    for sr in entries:
        out.scheduled.append(sr)
        Scheduler._count(out, sr, 1)
    return out


def as_chunk(sr: ScheduledRequest) -> ScheduledRequest:
    """The same tokens as a plain chunk (no drafts): the scheduler counts it as a prefill."""
    request = Request(sr.request_id + "c", list(range(sr.start + sr.num_new_tokens)),
                      SamplingParams(max_tokens=8), 0.0)
    return ScheduledRequest(request, sr.start, sr.num_new_tokens, [], True)


COUNTS = ("total_num_scheduled_tokens", "num_prefill_tokens", "num_decode_tokens", "num_prefill_seqs",
          "num_decode_seqs", "sum_context_tokens", "sum_decode_context_tokens", "max_decode_context",
          "num_prefix_chunks", "sum_prefix_context_tokens", "sum_prefill_attention_area")


def test_a_verification_is_counted_as_the_chunk_the_kernels_run():
    verify = [entry("a", 300, 4), entry("b", 900, 2)]
    plain = entry("c", 500)
    out = step(*verify, plain)
    assert out.num_decode_seqs == 3 and out.num_spec_tokens == 6
    chunked = verification_as_chunks(out)
    expected = step(*map(as_chunk, verify), plain)
    for name in (*COUNTS, "num_spec_tokens"):
        assert getattr(chunked, name) == getattr(expected, name), name
    assert out.num_decode_seqs == 3  # the scheduler's output is left as it was
    plain_only = step(entry("d", 400))
    assert verification_as_chunks(plain_only) is plain_only


def test_a_short_cpu_verification_is_counted_as_the_decode_rows_the_kernel_runs():
    short, long = entry("a", 100, 4), entry("b", 3000, 4)
    assert rows_as_decodes(5, 105) and not rows_as_decodes(5, 3005)
    out = step(short, long, entry("c", 500))
    recounted, sampled = recount_verifications(out, rows_as_decodes)
    # the short one as five one-token decodes at contexts 100..104, the long one as a chunk
    rows = [entry(f"a{i}", 100 + i) for i in range(5)]
    expected = step(*rows, as_chunk(long), entry("c", 500))
    for name in COUNTS:
        assert getattr(recounted, name) == getattr(expected, name), name
    assert sampled == 4  # only the chunk's extra rows are charged as sampled rows
    assert recount_verifications(out)[1] == 8 and out.num_decode_seqs == 3


def test_rows_are_the_cpu_native_attention_s_way_only():
    cpu = CostModel(load_model_spec("smollm2-135m"), load_hardware("cpu"))
    assert rows_rule_for(cpu, None) is rows_as_decodes
    assert rows_rule_for(cpu, KernelSettings()) is rows_as_decodes
    assert rows_rule_for(cpu, KernelSettings(cpu_attention="torch")) is None
    assert rows_rule_for(roofline(), KernelSettings()) is None
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    model = with_speculation(cpu, cpu, spec)
    out = step(entry("a", 100, 4))
    # five decode rows, nothing charged beside them (the proposer is not asked this step)
    assert model.step_time(out) == pytest.approx(cpu.step_time(recount_verifications(
        out, rows_as_decodes)[0]))
    assert model.step_time(out) != pytest.approx(with_speculation(
        cpu, cpu, spec, KernelSettings(cpu_attention="torch")).step_time(out))


def roofline(hardware: str = "a100-80gb") -> CostModel:
    return CostModel(load_model_spec("llama-3-8b"), load_hardware(hardware))


def test_roofline_reads_a_verified_context_once_and_samples_every_row():
    cost = roofline()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    model = with_speculation(cost, cost, spec)
    assert isinstance(model, WithSpeculation)
    batch = [entry(str(i), 4000, 4) for i in range(8)]
    out = step(*batch)
    row = sample_row_seconds(cost)
    assert row > 0
    charged = model.step_time(out)
    assert charged == pytest.approx(cost.step_time(verification_as_chunks(out)) + 32 * row)
    # the scheduler's decode counting would read each 4000-token context five times
    assert charged < cost.step_time(out)
    decode = cost.step_time(step(*(entry(str(i), 4000) for i in range(8))))
    # memory-bound at batch 8: verifying 4 drafts costs more than one decode, far less than five
    assert decode < charged < 2 * decode
    assert with_speculation(cost, cost, None) is cost


def test_fitted_model_charges_verifications_as_prefix_chunks():
    base = roofline()
    params = FittedParams(1e-3, {"num_decode_seqs": 1e-2, "num_prefix_chunks": 3e-3,
                                 "num_prefill_tokens": 1e-4}, "llama-3-8b")
    fitted = FittedCostModel(params, base)
    model = WithSpeculation(fitted, ProposerCost(), sample_row_seconds(fitted))
    out = step(entry("a", 200, 3), entry("b", 300, 2), entry("c", 400))
    row = sample_row_seconds(fitted)
    # one plain decode, two prefix chunks of 4 + 3 tokens, 5 extra sampled rows
    assert model.step_time(out) == pytest.approx(1e-3 + 1e-2 + 2 * 3e-3 + 7e-4 + 5 * row)


def test_lookup_proposer_is_charged_per_proposing_sequence():
    cost = roofline()
    lookups = proposer_cost_for(SpeculativeConfig(method="suffix", num_speculative_tokens=3), cost)
    assert lookups.draft is None and lookups.lookup_s_per_seq > 0
    none = step(entry("a", 300, 2), entry("b", 300))
    two = step(entry("a", 300, 2, draft_next=3), entry("b", 300, draft_next=1))
    assert lookups.time(none) == 0.0
    assert lookups.time(two) == pytest.approx(lookups.lookup_s_per_step + 2 * lookups.lookup_s_per_seq)
    with pytest.raises(ValueError, match="lookup_s_per_seq"):
        ProposerCost(lookup_s_per_seq=-1.0)


def test_draft_model_is_charged_one_forward_pass_per_draft():
    cost = roofline()
    spec = SpeculativeConfig(method="draft_model", model="smollm2-135m", num_speculative_tokens=4)
    proposer = proposer_cost_for(spec, cost)
    assert proposer.draft is not None
    one = proposer.time(step(entry("a", 300, draft_next=1)))
    four = proposer.time(step(entry("a", 300, draft_next=4)))
    assert one > 0 and four == pytest.approx(4 * one, rel=0.05)
    # the first proposal after a prompt prefills the whole prompt in the draft model
    request = Request("p", list(range(3000)), SamplingParams(max_tokens=8), 0.0)
    prompt = ScheduledRequest(request, 2488, 512, [], True)
    prompt.num_draft_next = 1
    assert proposer.time(step(prompt)) > 5 * one


def test_acceptance_draws_depend_on_the_request_and_token_only():
    a, b = AcceptanceModel([0.7, 0.5], seed=3), AcceptanceModel([0.7, 0.5], seed=3)
    first = [a.num_accepted("r1", p, 4) for p in range(0, 200, 5)]
    for p in range(50):  # other requests' draws in between change nothing
        b.num_accepted(f"x{p}", p, 3)
    assert [b.num_accepted("r1", p, 4) for p in range(0, 200, 5)] == first
    n = 20_000
    accepted = sum(a.num_accepted(f"q{i}", 10, 2) for i in range(n)) / n
    assert accepted == pytest.approx(a.expected_accepted(2), rel=0.03)
    assert a.expected_accepted(2) == pytest.approx(0.7 + 0.35)
    assert AcceptanceModel([1.0, 0.0]).num_accepted("z", 0, 3) == 1
    with pytest.raises(ValueError, match="acceptance rates"):
        AcceptanceModel([1.5])


def test_profiles_from_counters_and_totals(tmp_path):
    profile = AcceptanceProfile.from_counts("code-edits", 1000, [800, 400, 100])
    assert profile.rates == pytest.approx((0.8, 0.5, 0.25))
    assert profile.mean_acceptance_length == pytest.approx(2.3)
    loaded = AcceptanceProfile.load(profile.save(tmp_path / "p.json"))
    assert loaded == profile
    fitted = AcceptanceProfile.from_totals("rewrites", 1000, 4000, 2000)
    r = fitted.rates[0]
    assert r + r**2 + r**3 + r**4 == pytest.approx(2.0, rel=1e-4)
    with pytest.raises(ValueError, match="num_drafts"):
        AcceptanceProfile.from_counts("w", 0, [1])
    (tmp_path / "bad.json").write_text(json.dumps({"workload": "w"}))
    with pytest.raises(ValueError, match="rates"):
        AcceptanceProfile.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="num_drafts"):
        AcceptanceProfile("w", (0.5,), num_drafts=-1)


def test_measured_profile_carries_how_often_and_how_many_drafts_were_found():
    # a lookup proposer's run: 100 verifications of 2.6 drafts on average (k_max 4), 220
    # accepted, 8 requests of 48 tokens: 384 - 220 - 8 = 156 steps could have verified
    profile = AcceptanceProfile.measured("code-edits", num_drafts=100, num_draft_tokens=260,
                                         num_accepted_tokens=220, k_max=4, output_tokens=384,
                                         num_requests=8, accepted_per_pos=(90, 65, 45, 20))
    assert profile.proposal_rate == pytest.approx(100 / 156)
    assert profile.mean_draft_length == pytest.approx(2.6)
    r = profile.rates[0]  # per-position counters are biased by short drafts: the totals' fit
    assert 0.4 * (r + r**2) + 0.6 * (r + r**2 + r**3) == pytest.approx(2.2, rel=1e-4)
    full = AcceptanceProfile.measured("w", num_drafts=100, num_draft_tokens=400,
                                      num_accepted_tokens=130, k_max=4, output_tokens=1000,
                                      num_requests=4, accepted_per_pos=(60, 40, 20, 10))
    assert full.rates == pytest.approx((0.6, 40 / 60, 0.5, 0.5)) and full.mean_draft_length == 0
    model = AcceptanceModel(profile.rates, 1, profile.proposal_rate, profile.mean_draft_length)
    found = [model.num_proposed(f"r{i}", 50, 4) for i in range(20_000)]
    assert sum(1 for n in found if n) / len(found) == pytest.approx(100 / 156, rel=0.03)
    lengths = [n for n in found if n]
    assert sum(lengths) / len(lengths) == pytest.approx(2.6, rel=0.03)
    assert max(model.num_proposed(f"r{i}", 50, 2) for i in range(100)) == 2
    with pytest.raises(ValueError, match="proposal_rate"):
        AcceptanceModel([0.5], proposal_rate=1.5)


def test_simulate_command_replays_an_acceptance_profile(tmp_path, capsys):
    from twinserve.entrypoints.cli.main import main
    profile = AcceptanceProfile("code-edits", (0.9,), proposal_rate=0.5).save(tmp_path / "a.json")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    base = ["simulate", "--trace", "synthetic", "--num-requests", "20", "--disable-tqdm"]
    assert main([*base, "--speculative-config", spec, "--acceptance-profile", str(profile),
                 "--out", str(tmp_path / "run")]) == 0
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["acceptance_profile"]["workload"] == "code-edits"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # half the steps verify drafts: far fewer verifications than decode steps
    assert 0 < summary["spec_num_drafts"] < 0.7 * summary["total_output_tokens"] / 3
    assert main([*base, "--acceptance-profile", str(profile), "--out", str(tmp_path / "off")]) != 0
    assert "needs --speculative-config" in capsys.readouterr().err


def test_simulate_merges_several_acceptance_profiles(tmp_path):
    from twinserve.entrypoints.cli.main import main
    files = [AcceptanceProfile.from_totals(name, 100, 400, accepted).save(tmp_path / f"{name}.json")
             for name, accepted in (("edits", 300), ("chat", 60))]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"})
    assert main(["simulate", "--trace", "synthetic", "--num-requests", "5", "--disable-tqdm",
                 "--speculative-config", spec, "--acceptance-profile", *map(str, files),
                 "--out", str(tmp_path / "run")]) == 0
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["acceptance_profile"]
    assert recorded["workload"] == "edits + chat"
    assert recorded["num_accepted_tokens"] == 360 and recorded["num_drafts"] == 200
