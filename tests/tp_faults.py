"""Faulty tensor-parallel workers for the fault tests (tests/gpu/test_tensor_parallel.py): each is
a ``ShardWorker`` that rank 1 runs instead of the real one, passed to the ``mp`` executor by
``use_worker``. Spawned worker processes import this module by name (the tests' folder is on
the path they inherit)."""

from __future__ import annotations

import time

import pytest

from twinserve.gpu.executor.shard_worker import ShardSpec, ShardStep, ShardWorker

FAULTY_RANK = 1
HANG_AT_STEP = 3


class FailsLoadingWorker(ShardWorker):
    """Rank 1 joins the group, then fails before it is ready (as a shard that cannot load)."""

    def __init__(self, spec: ShardSpec, rank: int) -> None:
        super().__init__(spec, rank)
        if rank == FAULTY_RANK:
            self.close()
            raise RuntimeError(f"injected fault: rank {rank} cannot load its shard")


class HangingWorker(ShardWorker):
    """Rank 1 stops answering at its ``HANG_AT_STEP``-th step (its peers wait in a collective)."""

    def __init__(self, spec: ShardSpec, rank: int) -> None:
        super().__init__(spec, rank)
        self.steps = 0

    def execute(self, step: ShardStep) -> None:
        self.steps += 1
        if self.rank == FAULTY_RANK and self.steps >= HANG_AT_STEP:
            time.sleep(3600)
        super().execute(step)


def use_worker(monkeypatch: pytest.MonkeyPatch, worker_type: type[ShardWorker]) -> None:
    """Engines built while ``monkeypatch`` holds start their ``mp`` workers as ``worker_type``."""
    from twinserve.gpu.executor import tp_driver
    from twinserve.gpu.executor.mp_executor import MultiprocExecutor

    def make_executor(backend: str, spec: ShardSpec) -> MultiprocExecutor:
        assert backend == "mp", backend
        return MultiprocExecutor(spec, worker_type)
    monkeypatch.setattr(tp_driver, "make_executor", make_executor)
