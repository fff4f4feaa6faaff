"""A request's arrival is when the front takes it, as vLLM's API server stamps it, not when its
replica reads the add after the step in progress; the replicas' records and step rows come
back on the front's clock, so requests and steps of different replicas line up."""

from __future__ import annotations

import time

from tests.dp_fakes import FakeReplicas, NullSink
from twinserve.core.engine_args import EngineArgs
from twinserve.core.metrics import RequestRecord
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import SchedulerStats
from twinserve.entrypoints import dp_front
from twinserve.gpu.engine.dp_client import ReplicaEvent


def _front(monkeypatch) -> dp_front.DataParallelFront:
    monkeypatch.setattr(dp_front, "make_replica_set", FakeReplicas)
    return dp_front.DataParallelFront(EngineArgs(data_parallel_size=2), "llm", on_cuda=False)


def test_the_front_stamps_each_arrival_on_its_replicas_clock(monkeypatch) -> None:
    front = _front(monkeypatch)
    try:
        for rid in ("a", "b"):  # round robin: replica 0, then 1
            before = time.monotonic()
            front.submit(rid, list(range(8)), SamplingParams(max_tokens=2), {}, NullSink())
            after = time.monotonic()
            index, command = front._set.sent[-1]
            arrival = command[4]["arrival_time"]  # ("add", id, prompt, params, kwargs)
            origin = front._set.origins[index]
            assert before - origin <= arrival <= after - origin
        given = {"arrival_time": 1.5}  # a caller's own arrival stays
        front.submit("c", list(range(8)), SamplingParams(max_tokens=2), given, NullSink())
        assert front._set.sent[-1][1][4] == given
    finally:
        front.shutdown()


def test_records_and_step_rows_come_back_on_the_fronts_clock(monkeypatch) -> None:
    from twinserve.core.metrics import StepRecord
    from twinserve.core.step_sample import StepSample
    front = _front(monkeypatch)
    try:
        stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        sample = StepSample({"total_num_scheduled_tokens": 8}, 0.05)
        for replica in (0, 1):  # each replica: 10 s on its own clock
            record = RequestRecord(f"r{replica}", 10.0, 10.1, 10.2, 10.5, 8, 2)
            step = StepRecord(10.0, 0.05, 1, 8, 0, 1, 0, 0.1, 0)
            front._handle(ReplicaEvent(replica, "message", ("step", [], [], [], stats, [],
                                                            [record], [(step, sample)])))
        records = {r.request_id: r for r in front.take_records()}
        for replica in (0, 1):
            r = records[f"r{replica}"]
            at = front._set.origins[replica] + 10.0 - front.time_origin
            assert r.replica == replica and abs(r.arrival_time - at) < 1e-6
            assert abs(r.ttft - 0.2) < 1e-9 and abs(r.e2el - 0.5) < 1e-9  # (spans unchanged)
        assert abs((records["r0"].arrival_time - records["r1"].arrival_time) - (-3.0)) < 1e-6
        steps = front.take_steps()  # each with its replica and its measured sample
        assert [s.replica for s, _ in steps] == [0, 1] and front.take_steps() == []
        for s, measured in steps:
            at = front._set.origins[s.replica] + 10.0 - front.time_origin
            assert abs(s.time - at) < 1e-6 and s.duration == 0.05 and measured is sample
    finally:
        front.shutdown()
