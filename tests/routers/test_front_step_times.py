"""The data-parallel front fills each replica's step times (``ReplicaLoad.step_elapsed_s``,
``last_step_s``) from when its step messages come, as the twin fills them from its steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.dp_fakes import FakeReplicas, NullSink
from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import SchedulerStats
from twinserve.entrypoints import dp_front
from twinserve.gpu.engine.dp_client import ReplicaEvent


def _stats(running: int, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0.1, 0, 0, 0, 0, 0)


def test_the_front_times_each_replicas_steps_from_its_messages(monkeypatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(dp_front, "make_replica_set", FakeReplicas)
    monkeypatch.setattr(dp_front, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    front = dp_front.DataParallelFront(EngineArgs(data_parallel_size=2, router="cache-aware"),
                                       "llm", on_cuda=False)
    try:
        params = SamplingParams(max_tokens=4)
        assert [load.step_elapsed_s for load in front.loads] == [None, None]
        first = front.submit("a", list(range(40)), params, {}, NullSink())  # an idle replica: no wait
        clock[0] = 100.013  # its first step ends: the next one starts now
        front._handle(ReplicaEvent(first, "message",
                                   ("step", [], ["a"], [], _stats(1), [], [])))
        assert front.loads[first].last_step_s == pytest.approx(0.013)
        clock[0] = 100.020
        second = front.submit("b", list(range(40)), params, {}, NullSink())
        busy = front.loads[first]
        assert busy.step_elapsed_s == pytest.approx(0.007)
        assert busy.step_left_s == pytest.approx(0.006)
        assert second != first  # the other is idle: its first token comes sooner
        clock[0] = 100.030  # the busy replica's request finished: idle after this message
        front._handle(ReplicaEvent(first, "message", ("step", [], [], [], _stats(0), [], [])))
        assert front.loads[first].last_step_s == pytest.approx(0.017)
        front.submit("c", list(range(40)), params, {}, NullSink())
        assert front.loads[first].step_elapsed_s is None
    finally:
        front.shutdown()
