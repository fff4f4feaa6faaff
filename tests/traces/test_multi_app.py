"""The multi-application workload generator."""

from __future__ import annotations

import argparse
from collections import Counter

import pytest

from twinserve.traces.cli_args import trace_desc, trace_from_args
from twinserve.traces.cli_flags import add_trace_args
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace


def test_apps_share_their_own_system_prompt_with_zipf_popularity() -> None:
    cfg = MultiAppConfig(num_requests=4000, request_rate=40.0, num_apps=24, seed=3)
    trace = multi_app_trace(cfg)
    assert trace == multi_app_trace(cfg)  # seeded
    assert len(trace) == 4000
    assert all(b.arrival_time >= a.arrival_time for a, b in zip(trace, trace[1:]))
    assert 80 < trace[-1].arrival_time < 120  # ~100 s at 40 req/s
    prompts: dict[str, set] = {}
    for tr in trace:
        prompts.setdefault(tr.tenant, set()).add((tr.prefix_blocks, tr.prefix_block_tokens))
        assert 256 <= tr.prefix_block_tokens <= 2048
        assert tr.input_tokens > tr.prefix_block_tokens
    assert all(len(p) == 1 for p in prompts.values())  # one system prompt per application
    assert len({next(iter(p)) for p in prompts.values()}) == len(prompts)  # and its own
    counts = Counter(tr.tenant for tr in trace)
    share = cfg.popularity()
    assert counts["app-0"] / 4000 == pytest.approx(share[0], abs=0.03)
    assert counts["app-0"] > 2 * counts["app-1"] * 0.8 and counts["app-1"] > counts["app-5"]


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="system_len_max"):
        MultiAppConfig(system_len_min=512, system_len_max=256)
    with pytest.raises(ValueError, match="request_rate"):
        MultiAppConfig(request_rate=0.0)
    with pytest.raises(ValueError, match="num_apps"):
        MultiAppConfig(num_apps=0)


def _parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_trace_args(parser)
    return parser.parse_args(list(argv))


def test_the_cli_builds_it_from_its_flags_and_refuses_the_others() -> None:
    args = _parse("--trace", "multi-app", "--num-requests", "50", "--num-apps", "30",
                  "--zipf-s", "0.5", "--request-rate", "10", "--seed", "2")
    trace = trace_from_args(args)
    assert trace == multi_app_trace(MultiAppConfig(num_requests=50, num_apps=30, zipf_s=0.5,
                                                   request_rate=10.0, seed=2))
    assert trace_desc(args)["num_apps"] == 30
    with pytest.raises(ValueError, match="--prefix-len: applies only to --trace synthetic"):
        trace_from_args(_parse("--trace", "multi-app", "--prefix-len", "8"))
    with pytest.raises(ValueError, match="--num-apps: applies only to --trace multi-app"):
        trace_from_args(_parse("--trace", "synthetic", "--num-apps", "8"))
    with pytest.raises(ValueError, match="--zipf-s applies only to --trace multi-app"):
        trace_from_args(_parse("--trace", "azure-conv", "--zipf-s", "2"))
    with pytest.raises(ValueError, match="--num-apps: num_apps must be a positive"):
        trace_from_args(_parse("--trace", "multi-app", "--num-apps", "0"))


def test_lengths_spread_as_the_azure_conversation_trace_unless_a_range_ratio_is_given() -> None:
    import numpy as np

    from twinserve.traces.multi_app import INPUT_SIGMA, LENGTH_CAP, OUTPUT_SIGMA
    cfg = MultiAppConfig(num_requests=6000, input_len=256, output_len=128, seed=1)
    trace = multi_app_trace(cfg)
    turns = np.array([tr.input_tokens - tr.prefix_block_tokens for tr in trace])
    outputs = np.array([tr.output_tokens for tr in trace])
    assert np.median(turns) == pytest.approx(256, rel=0.05)
    assert np.median(outputs) == pytest.approx(128, rel=0.05)
    # the log-spread of the trace, only thinned by the cut at LENGTH_CAP medians
    assert np.log(turns).std() == pytest.approx(INPUT_SIGMA, rel=0.1)
    assert np.log(outputs).std() == pytest.approx(OUTPUT_SIGMA, rel=0.1)
    assert turns.max() == LENGTH_CAP * 256 and turns.min() >= 1
    uniform = multi_app_trace(MultiAppConfig(num_requests=500, output_len=128, range_ratio=0.5))
    assert {64 <= tr.output_tokens <= 192 for tr in uniform} == {True}
    with pytest.raises(ValueError, match="range_ratio"):
        MultiAppConfig(range_ratio=1.5)


def test_the_cli_takes_system_prompts_shorter_than_the_default_minimum() -> None:
    """``--system-len-max`` is checked against the given ``--system-len-min``, not the default."""
    trace = trace_from_args(_parse("--trace", "multi-app", "--num-requests", "20",
                                   "--system-len-min", "48", "--system-len-max", "80"))
    assert all(48 <= r.prefix_block_tokens <= 80 for r in trace)
    with pytest.raises(ValueError, match="--system-len-max: system_len_max must be"):
        trace_from_args(_parse("--trace", "multi-app", "--system-len-min", "48",
                               "--system-len-max", "40"))
