"""How the driver reaches its worker ranks: ``mp`` (local processes) or ``ray`` (Ray actors).

Both carry the same three messages, in order, to every worker: the KV cache's block counts once,
then one ``ShardStep`` per engine step, then ``stop``. A step is sent without waiting for an answer:
the ranks meet in the step's collectives, which time out (the group's timeout) when a rank hangs
and fail at once when one dies; ``failure`` then says which rank and why.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from twinserve.gpu.executor.shard_worker import ShardSpec, ShardStep

EXECUTOR_BACKENDS = ("mp", "ray")


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker failed to start, died or hung; the engine cannot go on."""


class Executor(ABC):
    """Workers ``1 .. world_size - 1`` of one tensor-parallel group (rank 0 is the driver)."""

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.world_size = spec.address.world_size

    @abstractmethod
    def wait_joining(self, timeout_s: float) -> None:
        """Returns once every worker is about to join the group; raises WorkerFailure."""

    @abstractmethod
    def wait_ready(self, timeout_s: float) -> None:
        """Returns once every worker holds its shard; raises WorkerFailure."""

    @abstractmethod
    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Sends the block counts (every rank allocates the same number)."""

    @abstractmethod
    def send_step(self, step: ShardStep) -> None:
        """Queues ``step`` for every worker; does not wait for them."""

    @abstractmethod
    def failure(self, timeout_s: float) -> str | None:
        """Why a worker is gone or silent (waiting up to ``timeout_s`` to learn it), or None."""

    @abstractmethod
    def worker_pids(self) -> list[int]:
        """The workers' process ids, rank order."""

    @abstractmethod
    def shutdown(self) -> None:
        """Ends every worker (politely, then by force); safe to call twice."""


def make_executor(backend: str, spec: ShardSpec) -> Executor:
    if backend == "mp":
        from twinserve.gpu.executor.mp_executor import MultiprocExecutor
        return MultiprocExecutor(spec)
    if backend == "ray":
        from twinserve.gpu.executor.ray_executor import RayExecutor
        return RayExecutor(spec)
    raise ValueError(f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                     f"got {backend!r}.")
