"""A request the front sent counts in its replica's load until a step message accepts it: the
message that ends the step in progress was taken before the replica read the request, so its
stats alone would hide the request (and call an otherwise idle replica idle) for a whole step,
where the twin's scheduler already holds it."""

from __future__ import annotations

from typing import Any

from tests.dp_fakes import FakeReplicas, NullSink
from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import SchedulerStats
from twinserve.entrypoints import dp_front
from twinserve.gpu.engine.dp_client import ReplicaEvent
from twinserve.gpu.engine.engine_process import Refusal


def _step(front: Any, replica: int, accepted: list[str], running: int, waiting: int = 0,
          refused: tuple[Refusal, ...] = ()) -> None:
    stats = SchedulerStats(running, waiting, 0.1, 0, 0, 0, 0, 0)
    front._handle(ReplicaEvent(replica, "message",
                               ("step", [], accepted, list(refused), stats, [], [])))


def test_a_sent_request_stays_in_the_load_until_accepted(monkeypatch) -> None:
    monkeypatch.setattr(dp_front, "make_replica_set", FakeReplicas)
    front = dp_front.DataParallelFront(EngineArgs(data_parallel_size=2, router="least-outstanding"),
                                       "llm", on_cuda=False)
    try:
        params = SamplingParams(max_tokens=4)
        first = front.submit("a", list(range(40)), params, {}, NullSink())
        _step(front, first, [], running=0)  # the step in progress ends before "a" is read
        load = front.loads[first]
        assert (load.num_waiting, load.num_prefill_tokens) == (1, 40)
        assert front._step_started[first] is not None  # it steps on, taking "a"
        second = front.submit("b", list(range(40)), params, {}, NullSink())
        assert second != first  # the stale stats alone would tie them: the lowest index, "a"'s
        _step(front, first, ["a"], running=1)
        load = front.loads[first]
        assert (load.num_running, load.num_waiting, load.num_prefill_tokens) == (1, 0, 0)
        refusal = Refusal("b", "full", "max_waiting_requests", 1.0)
        _step(front, second, [], running=0, refused=(refusal,))
        assert front.loads[second].num_waiting == 0 and front._step_started[second] is None
    finally:
        front.shutdown()
