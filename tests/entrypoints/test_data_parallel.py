"""Data parallelism through LLM and the front: replicas in processes, routing, faults, shutdown."""

from __future__ import annotations

import csv
import dataclasses
import os
import queue
import signal
import time
from typing import Any

import psutil
import pytest

from twinserve import LLM, SamplingParams
from twinserve.core.engine_args import EngineArgs
from twinserve.entrypoints.dp_front import DataParallelFront, ReplicaDied

SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=256,
             kv_cache_memory_bytes=32 << 20)
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Hello, my name is", "Water boils at"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


class Collect:
    def __init__(self) -> None:
        self.items: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, item: Any) -> None:
        self.items.put(item)

    def last(self, timeout_s: float = 120.0) -> Any:
        """The final output, or the exception that ended the request."""
        while True:
            item = self.items.get(timeout=timeout_s)
            if isinstance(item, BaseException) or (item is not None and item.finished):
                return item


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie still answers kill(0)
        return f.read().split(")")[-1].split()[0] != "Z"


def wait_until(predicate: Any, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.slow
def test_llm_data_parallel_matches_one_engine() -> None:
    one = LLM(**SMALL)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.shutdown()
    two = LLM(data_parallel_size=2, **SMALL)
    try:
        outs = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [o.prompt for o in outs] == PROMPTS
        served = [r.served for r in two.engine.front.snapshot()]
        assert served == [2, 2]  # round-robin: both replicas worked
        pids = [two.engine.front.pid(i) for i in range(2)]
    finally:
        two.shutdown()
    assert not any(alive(p) for p in pids if p is not None)


def test_bad_data_parallel_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineArgs(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_backend"):
        EngineArgs(data_parallel_backend="threads")
    from twinserve.gpu.engine.llm_engine import LLMEngine
    with pytest.raises(ValueError, match="data_parallel_size=2: an LLMEngine is one replica"):
        LLMEngine(EngineArgs(data_parallel_size=2))  # refused, not run as one replica
    with pytest.raises(ValueError, match="unknown router 'cache-awar'"):
        LLM(router="cache-awar")  # one replica routes nothing: still refused


def test_more_ranks_than_a_cpu_can_hold_are_refused_before_any_process() -> None:
    from twinserve.gpu.engine.dp_client import check_cpu_ranks
    from twinserve.gpu.worker.cpu_cores import usable_cores
    check_cpu_ranks([EngineArgs(pipeline_parallel_size=2)] * 2, 2)  # two ranks a core: runs
    with pytest.raises(ValueError, match="5 worker ranks in all on 2 usable cores"):
        check_cpu_ranks([EngineArgs()] * 5, 2)
    too_many = 2 * usable_cores() + 1
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match=f"{too_many} replicas"):
        LLM(data_parallel_size=too_many, **SMALL)  # (not minutes of starting processes)
    assert set(psutil.Process().children(recursive=True)) <= before


@pytest.mark.slow
def test_replicas_refusing_their_arguments_raise_value_error() -> None:
    """A replica's engine refusing its arguments is the caller's bad input: ValueError, with
    the reason (the bundled model's 9 heads do not split over 2 ranks)."""
    with pytest.raises(ValueError, match=r"replica \d: ValueError: Total number of attention "
                                         r"heads \(9\) must be divisible by tensor parallel size"):
        LLM(data_parallel_size=2, tensor_parallel_size=2, **SMALL)


def test_validate_warns_where_worker_ranks_share_cores() -> None:
    from twinserve.entrypoints.cli.validate_dp import core_sharing
    dp_pp = EngineArgs(data_parallel_size=2, pipeline_parallel_size=2)
    assert core_sharing(dp_pp, 2, on_cuda=False) == (
        "2 replicas x 2 worker ranks = 4 processes on 2 cores: ranks share cores, which the "
        "twin's profile (a core per rank) does not model; the real fleet will run slower than "
        "its twin.")
    assert core_sharing(dp_pp, 4, on_cuda=False) is None
    assert core_sharing(dp_pp, 2, on_cuda=True) is None
    assert core_sharing(EngineArgs(data_parallel_size=2), 2, on_cuda=False) is None


def test_each_replica_owns_one_gpu_per_worker_rank() -> None:
    from twinserve.gpu.engine.dp_client import replica_gpus
    tp2, pp2, one = (EngineArgs(tensor_parallel_size=2), EngineArgs(pipeline_parallel_size=2),
                     EngineArgs())
    assert [replica_gpus(i, [tp2, tp2], True) for i in range(2)] == [(0, 1), (2, 3)]
    assert [replica_gpus(i, [one, pp2, one], True) for i in range(3)] == [(0,), (1, 2), (3,)]
    assert replica_gpus(1, [tp2, tp2], False) == ()


_DP_PP_SCRIPT = """
import json
from twinserve import LLM, SamplingParams
SMALL = {small!r}
PROMPTS, GREEDY = {prompts!r}, SamplingParams(temperature=0, max_tokens=8)
one = LLM(**SMALL)
expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
one.shutdown()
llm = LLM(data_parallel_size=2, pipeline_parallel_size=2, **SMALL)
outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
replicas = [llm.engine.front.pid(i) for i in range(2)]
workers = [int(c) for p in replicas for c in open(f"/proc/{{p}}/task/{{p}}/children").read().split()]
print(json.dumps([outs == expected, [r.served for r in llm.engine.front.snapshot()],
                  replicas + workers]))
# no shutdown: the front ends its replicas (no daemons: they start workers) at exit
"""


@pytest.mark.slow
def test_replicas_with_pipeline_stages_match_one_engine_and_end_at_exit() -> None:
    """A replica with workers is no daemonic process (which may not start any). From a script
    read from standard input (``python - <<EOF``: spawned replicas cannot re-run ``<stdin>``),
    which never shuts its LLM down: the tokens equal one engine's, and the script exits,
    leaving no replica or worker behind."""
    import json
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-"], input=_DP_PP_SCRIPT.format(
        small=SMALL, prompts=PROMPTS), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    same, served, pids = json.loads(done.stdout.strip().splitlines()[-1])
    assert same and served == [2, 2]
    assert len(pids) == 4  # two replicas, each with its second stage's worker
    wait_until(lambda: not any(alive(p) for p in pids), timeout_s=10)
    assert "leaked" not in done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("restart", [True, False])
def test_a_killed_replica_ends_its_requests_and_the_other_serves(restart: bool) -> None:
    args = EngineArgs(data_parallel_size=2, restart_dead_replicas=restart, **SMALL)
    front = DataParallelFront(args, "llm", on_cuda=False)
    try:
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        sinks = [Collect() for _ in range(4)]
        where = [front.submit(f"r{i}", [1, 2, 3, 4 + i], long, {}, s) for i, s in enumerate(sinks)]
        assert sorted(where) == [0, 0, 1, 1]
        wait_until(lambda: all(r.served for r in front.snapshot()))
        victim = front.pid(0)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        for sink, replica in zip(sinks, where):
            last = sink.last()
            if replica == 0:
                assert isinstance(last, ReplicaDied)
            else:
                assert not isinstance(last, BaseException)
                assert len(last.outputs[0].token_ids) == 200
        wait_until(lambda: not alive(victim))
        if restart:
            wait_until(lambda: front.health() == ["ready", "ready"])
            assert front.snapshot()[0].restarts == 1
        else:
            assert front.health() == ["dead", "ready"]
        after = [Collect() for _ in range(2)]
        where = [front.submit(f"after{i}", [5, 6, 7], GREEDY, {}, s) for i, s in enumerate(after)]
        assert sorted(where) == ([0, 1] if restart else [1, 1])
        assert all(not isinstance(s.last(), BaseException) for s in after)
    finally:
        pids = [front.pid(i) for i in range(2)]
        front.shutdown()
    assert not any(alive(p) for p in pids if p is not None)
    assert front.health() == ["dead", "dead"]


@pytest.mark.slow
def test_requests_sharing_a_prefix_reach_the_replica_holding_it() -> None:
    args = EngineArgs(data_parallel_size=2, router="cache-aware", **SMALL)
    front = DataParallelFront(args, "llm", on_cuda=False)
    try:
        prefix = list(range(100, 164))  # four full blocks
        busy, first = Collect(), Collect()
        # replica 0 busy (ties go to the lowest index), so the prefix lands on replica 1: later
        # requests at equal load would go to 0 if the router ignored what 1 holds
        assert front.submit("busy", [1, 2, 3], GREEDY, {}, busy) == 0
        home = front.submit("first", prefix + [7], GREEDY, {}, first)
        assert home == 1
        assert not isinstance(first.last(), BaseException)
        assert not isinstance(busy.last(), BaseException)
        wait_until(lambda: front.snapshot()[home].stats is not None)
        where = []
        for i in range(4):  # one at a time: equal load, so the held prefix decides
            sink = Collect()
            where.append(front.submit(f"same{i}", prefix + [8 + i], GREEDY, {}, sink))
            assert not isinstance(sink.last(), BaseException)
        assert where == [home] * 4
        stats = front.snapshot()[home].stats
        assert stats is not None and stats.prefix_cache_hits >= 4 * len(prefix)
    finally:
        front.shutdown()


def test_block_hashes_agree_between_processes() -> None:
    """The front hashes prompts in its process; the replicas' KV events carry theirs."""
    import subprocess
    import sys
    code = ("from twinserve.core.request import Request\n"
            "from twinserve.core.sampling_params import SamplingParams\n"
            "from twinserve.routers.hashing import prompt_block_hashes\n"
            "print(list(prompt_block_hashes(Request('r', list(range(64)), SamplingParams(), 0.0), 16)))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout for _ in range(2)}
    assert len(runs) == 1 and len(eval(runs.pop())) == 4


def test_validate_data_parallel_needs_a_profile_and_formats_both_sides() -> None:
    import argparse

    from twinserve.entrypoints.cli.validate_dp import FleetRow, format_table, run_validate_dp
    with pytest.raises(ValueError, match="--profile"):
        run_validate_dp(argparse.Namespace(profile=None), EngineArgs(data_parallel_size=2), [])
    for flag, value in (("reuse_real", ["runs/x"]), ("at_host_speed", True),
                        ("use_profile_cache", False), ("detokenize", False),
                        ("acceptance_profile", ["a.json"])):
        args = argparse.Namespace(profile="p.json", **{flag: value})
        with pytest.raises(ValueError, match="not supported with --data-parallel-size"):
            run_validate_dp(args, EngineArgs(data_parallel_size=2), [])
    row = FleetRow("cache-aware", {"mean_ttft_ms": 12.0, "p99_ttft_ms": 30.0, "mean_tpot_ms": 5.0,
                                   "prefix_cache_hit_rate": 0.5},
                   {"mean_ttft_ms": 10.0, "p99_ttft_ms": 25.0, "mean_tpot_ms": 4.5,
                    "prefix_cache_hit_rate": 0.25})
    table = format_table([row]).splitlines()
    assert table[2] == ("| cache-aware | 12.0 ms | 10.0 ms | 30.0 ms | 25.0 ms | 5.0 ms | 4.5 ms "
                        "| 50.0% | 25.0% |") and len(table) == 3  # (no speed: no fit)
    timed = format_table([dataclasses.replace(row, replay_speed=0.9204)]).splitlines()
    assert timed[3] == "real steps, cache-aware: 0.920x the profile's time for the same steps"


def test_a_fleet_replay_waits_for_every_record_it_is_due() -> None:
    """The last steps' records come with the replicas' next messages: they are waited for, and
    a shortfall is an error, not a summary of fewer requests."""
    from twinserve.core.metrics import RequestRecord
    from twinserve.entrypoints.cli.validate_dp import _all_records

    class Front:
        def __init__(self, batches: list[list[RequestRecord]]) -> None:
            self.batches = batches

        def take_records(self) -> list[RequestRecord]:
            return self.batches.pop(0) if self.batches else []
    late = [RequestRecord(f"r{i}", 0.0, 0.1, 0.2, 0.3, 4, 2) for i in range(3)]
    assert _all_records(Front([[], late[:1], [], late[1:]]), 3) == late
    with pytest.raises(RuntimeError, match="3 more records were due from the replicas; 1 came"):
        _all_records(Front([late[:1]]), 3, timeout_s=0.3)


@pytest.mark.slow
def test_validate_data_parallel_writes_both_sides_per_router(tmp_path: Any, capsys: Any) -> None:
    """``validate --data-parallel-size 2``: per router, each real run and the twin's as run
    folders naming each request's replica, the errors against the real median, the report."""
    import json
    from dataclasses import replace

    from twinserve.entrypoints.cli.main import main
    from twinserve.fidelity.backend import with_model
    from twinserve.simulator.hardware import FittedParams, load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    out = tmp_path / "v"
    model = load_model_spec(str(with_model(EngineArgs()).model)).name  # (a fit of its steps)
    fit = FittedParams(5e-3, {"num_tokens": 2e-5, "num_decode_seqs": 1e-4}, model)
    profile = replace(load_hardware("cpu"), fitted=(fit,)).save(tmp_path / "fit.json")
    assert main(["validate", "--data-parallel-size", "2", "--router", "cache-aware",
                 "--trace", "multi-app", "--num-apps", "2", "--system-len-min", "32",
                 "--system-len-max", "48", "--num-requests", "6", "--request-rate", "4",
                 "--input-len", "16", "--output-len", "4", "--max-model-len", "128",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
                 "--profile", str(profile), "--real-repeats", "2", "--at-replay-speed", "--quiet",
                 "--out", str(out)]) == 0
    where = out / "cache-aware"
    for run in ("real", "real-2", "sim"):
        with open(where / run / "requests.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 6 and {r["replica"] for r in rows} <= {"0", "1"}
        assert {r["tenant"] for r in rows} == {"app-0", "app-1"}  # the trace's, both sides
        with open(where / run / "steps.csv", newline="") as f:  # each replica's steps, both sides
            steps = list(csv.DictReader(f))
        served = {r["replica"] for r in rows}
        assert {s["replica"] for s in steps} == served
        times = [float(s["time"]) for s in steps]
        assert times == sorted(times) and all(float(s["duration"]) > 0 for s in steps)
        ends = max(float(r["finish_time"]) for r in rows)
        assert min(times) >= 0 and max(times) < ends  # (on the requests' clock)
        # every prompt token not cached is computed in some step, every output token but the
        # prefills' first decoded in one
        assert sum(int(s["num_prefill_tokens"]) for s in steps) == \
            sum(int(r["input_tokens"]) - int(r["cached_tokens"]) for r in rows)
        assert sum(int(s["num_decode_tokens"]) for s in steps) == \
            sum(int(r["output_tokens"]) - 1 for r in rows)
        if run != "sim":  # each step's measured sample, as a single engine's replay keeps
            with open(where / run / "step_features.csv", newline="") as f:
                samples = list(csv.DictReader(f))
            assert [float(x["seconds"]) for x in samples] == \
                pytest.approx([float(s["duration"]) for s in steps])
    real = json.loads((where / "real" / "config.json").read_text())
    assert (real["backend"], real["router"], real["data_parallel_size"],
            real["data_parallel_backend"]) == ("twinserve", "cache-aware", 2, "mp")
    with open(where / "errors.csv", newline="") as f:
        errors = {r["metric"]: r for r in csv.DictReader(f)}
    assert errors["mean_ttft_ms"]["real_runs"] == "2"
    # the real runs' own speed against the profile's, to which the twin's profile was scaled
    from twinserve.simulator.hardware import load_hardware
    speed = float(errors["replay_speed_vs_profile"]["real"])
    scaled = load_hardware(str(where / "profile-at-replay-speed.json"))
    assert speed > 0 and scaled.fitted[0].intercept_s == pytest.approx(5e-3 * speed, rel=1e-6)
    assert "real steps, cache-aware: " in capsys.readouterr().out  # (the table prints it)
    assert float(errors["replayed_step_time_s"]["real"]) > 0
    assert "Replicas behind a router" in (out / "report.html").read_text()


@pytest.mark.slow
def test_ray_backend_matches_one_engine_and_survives_a_killed_actor() -> None:
    pytest.importorskip("ray")
    one = LLM(**SMALL)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.shutdown()
    two = LLM(data_parallel_size=2, data_parallel_backend="ray", **SMALL)
    front = two.engine.front
    try:
        outs = two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert [r.served for r in front.snapshot()] == [2, 2]
        # each actor reports its resolved configuration, as a replica process does (metrics)
        assert [r.config["kv_cache_bytes"] for r in front.snapshot()] == \
            [one.engine.engine_config.kv_cache_bytes] * 2  # type: ignore[index]
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        sinks = [Collect() for _ in range(2)]
        where = [front.submit(f"long{i}", [1, 2, 3, 4 + i], long, {}, s)
                 for i, s in enumerate(sinks)]
        assert sorted(where) == [0, 1]
        wait_until(lambda: all(r.served == 3 for r in front.snapshot()))
        victim = front.pid(where.index(0))
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        assert isinstance(sinks[where.index(0)].last(), ReplicaDied)
        assert len(sinks[where.index(1)].last().outputs[0].token_ids) == 200
        wait_until(lambda: front.health() == ["ready", "ready"])
        assert front.snapshot()[0].restarts == 1
    finally:
        two.shutdown()
    assert front.health() == ["dead", "dead"]


def test_simulate_takes_data_parallel_size_as_its_replicas(tmp_path: Any, capsys: Any) -> None:
    import json

    from twinserve.entrypoints.cli.main import main
    base = ["simulate", "--trace", "synthetic", "--num-requests", "8", "--disable-tqdm"]
    assert main([*base, "--data-parallel-size", "2", "--out", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert (config["num_replicas"], config["data_parallel_size"]) == (2, 1)
    assert ", 2 replicas behind round-robin, fcfs)" in capsys.readouterr().out  # (the title)
    with open(tmp_path / "a" / "requests.csv", newline="") as f:  # who served each (round robin)
        rows = sorted(csv.DictReader(f), key=lambda r: float(r["arrival_time"]))
    assert [r["replica"] for r in rows] == ["0", "1"] * 4
    assert main([*base, "--data-parallel-size", "2", "--num-replicas", "3",
                 "--out", str(tmp_path / "b")]) == 2
    assert not (tmp_path / "b" / "config.json").exists()
