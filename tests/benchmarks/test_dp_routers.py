"""``benchmarks/dp_routers``: the twin's side on the documented multi-application workload (the
bundled CPU profile in place of a calibrated one), pooled over seeds, and its tail rows."""

from __future__ import annotations

import numpy as np
import pytest

from twinserve.benchmarks.dp_routers import Run, figures, format_tail, main, run_seed

FLAGS = ("--data-parallel-size 2 --router round-robin,least-outstanding,cache-aware "
         "--trace multi-app --num-apps 6 --system-len-min 48 --system-len-max 80 "
         "--num-requests 150 --request-rate 4 --input-len 16 --output-len 16 --max-model-len 128 "
         "--max-num-seqs 40 --max-num-batched-tokens 2048 --profile cpu").split()


@pytest.fixture(scope="module")
def twin() -> list[Run]:
    runs: list[Run] = []
    for seed in (0, 1, 2):
        real, mine = run_seed(FLAGS, seed, rounds=1, twin_only=True)
        assert real == []
        runs += mine
    return runs


def test_cache_aware_beats_both_on_mean_and_p99_ttft_in_the_twin(twin: list[Run]) -> None:
    """By a margin each of its terms is needed for: without the wait for the step in progress
    its pooled mean and p99 are within 4% of the others'; without the prefix term its hits are
    round robin's."""
    by = {name: figures([r for r in twin if r.router == name])
          for name in ("round-robin", "least-outstanding", "cache-aware")}
    aware = by.pop("cache-aware")
    assert aware["mean"] < 0.95 * min(f["mean"] for f in by.values())
    assert aware["p99"] < 0.95 * min(f["p99"] for f in by.values())
    assert aware["hits"] > by["round-robin"]["hits"] + 0.005
    rps = [f["rps"] for f in by.values()]
    assert aware["rps"] == pytest.approx(rps[0], rel=0.01)  # at equal throughput


def test_the_routing_log_sees_every_request_and_the_tail_names_it(twin: list[Run]) -> None:
    run = next(r for r in twin if r.router == "cache-aware" and r.seed == 0)
    assert set(run.log.rows) == {r.request_id for r in run.records}
    chosen = [run.log.rows[r.request_id][0] for r in run.records]
    assert set(chosen) == {0, 1}
    held = [run.log.rows[r.request_id][2] for r in run.records]
    assert any(max(h) >= 48 for h in held)  # the index saw the replicas' stored prefixes
    rr = next(r for r in twin if r.router == "round-robin" and r.seed == 0)
    assert all(rr.log.rows[r.request_id][2] == [-1, -1] for r in rr.records)  # no index
    worst = max(run.records, key=lambda r: r.ttft)
    lines = format_tail(run, 2).splitlines()
    assert len(lines) == 3 and worst.request_id in lines[1]
    pooled = figures([run, rr])
    both = np.concatenate([run.ttfts_ms(), rr.ttfts_ms()])
    assert pooled["p99"] == pytest.approx(float(np.percentile(both, 99)))


def test_bad_rounds_and_a_missing_profile_are_refused() -> None:
    with pytest.raises(ValueError, match="--rounds"):
        main(["--rounds", "0", "--", *FLAGS])
    with pytest.raises(ValueError, match="--profile"):
        run_seed([f for f in FLAGS if f not in ("--profile", "cpu")], 0, 1, True)
    with pytest.raises(ValueError, match="--twin-only"):
        main(["--twin-only", "--at-replay-speed", "--", *FLAGS])


def test_at_replay_speed_the_twin_runs_on_the_profile_scaled_to_the_real_runs(tmp_path) -> None:
    """``--at-replay-speed``: each router's twin on the profile scaled to the median speed of
    its real runs (runs without one left out); a profile without a fit for the model is named."""
    import dataclasses

    from twinserve.benchmarks.dp_routers import _twin_run
    from twinserve.entrypoints.cli.calibrate import engine_of, model_dir_or_default
    from twinserve.entrypoints.cli.main import build_parser, parse_args
    from twinserve.fidelity.workload import TraceSpec
    from twinserve.simulator.hardware import FittedParams, load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    args = parse_args(build_parser(only="validate"), ["validate", *FLAGS, "--out", "/dev/null"])
    args.model = model_dir_or_default(args.model)
    trace = list(TraceSpec.from_namespace(args).load().requests)[:40]
    engine = engine_of(args)
    fit = FittedParams(5e-3, {"num_tokens": 2e-5, "num_decode_seqs": 1e-4},
                       load_model_spec(str(engine.model)).name)
    profile = str(dataclasses.replace(load_hardware("cpu"), fitted=(fit,))
                  .save(tmp_path / "fit.json"))
    given = _twin_run(engine, trace, "cache-aware", {}, 0, profile, None, str(tmp_path))
    slow = _twin_run(engine, trace, "cache-aware", {}, 0, profile,
                     [1.5, float("nan"), 2.5, 2.0], str(tmp_path))
    assert (given.speed, slow.speed) == (1.0, 2.0)
    assert load_hardware(str(tmp_path / "0-cache-aware.json")).fitted[0].intercept_s == \
        pytest.approx(2 * 5e-3)
    assert figures([slow])["mean"] > 1.5 * figures([given])["mean"]
    with pytest.raises(ValueError, match="--at-replay-speed needs"):
        _twin_run(engine, trace, "cache-aware", {}, 0, profile, [float("nan")], str(tmp_path))
