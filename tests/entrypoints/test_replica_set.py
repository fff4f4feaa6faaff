"""The front's replica set with real processes behind it (a stand-in for the engine)."""

from __future__ import annotations

import threading

import pytest

from tests.dp_fakes import inbox_reader
from twinserve.core.engine_args import EngineArgs
from twinserve.gpu.engine import dp_client


def _feeders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "QueueFeederThread" and t.is_alive()]


def test_shutdown_leaves_no_queue_feeder_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """A closed inbox's feeder thread holds its semaphores last and unlinks them as it ends: a
    front exiting while one still ran left the resource tracker a semaphore it called leaked.
    ``shutdown`` returns only once every feeder has ended."""
    monkeypatch.setattr(dp_client, "replica_main", inbox_reader)
    before = _feeders()
    replicas = dp_client.ReplicaSet(EngineArgs(data_parallel_size=2), "test", on_cuda=False)
    for i in range(2):
        replicas.start(i)
        replicas.send(i, ("noop",))  # (a first command starts the inbox's feeder)
    assert len(_feeders()) == len(before) + 2
    replicas.shutdown()
    assert _feeders() == before
    assert [replicas.pid(i) for i in range(2)] == [None, None]
