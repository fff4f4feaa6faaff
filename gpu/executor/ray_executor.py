"""Worker ranks as Ray actors (``--distributed-executor-backend ray``), one per placement-group
bundle (a GPU each on CUDA, ``ShardSpec.num_threads`` CPUs each on a CPU), packed onto as few nodes
as the cluster allows. The driver joins a running cluster (``RAY_ADDRESS`` or ``ray start``) or
starts a local one. An actor serves its calls in order, so the block counts, then the steps, arrive
as sent; a step that raises in an actor ends that actor's process, so the driver's collective fails
at once instead of waiting out the timeout.
"""

from __future__ import annotations

import os
import sys
import traceback
import weakref
from typing import Any

from twinserve.gpu.executor.executor_base import Executor, WorkerFailure
from twinserve.gpu.executor.shard_worker import ShardSpec, ShardStep, ShardWorker


class RayShardWorker:
    """The actor: a ``ShardWorker`` built on ``start``."""

    def __init__(self, spec: ShardSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.worker: ShardWorker | None = None

    def pid(self) -> int:
        return os.getpid()

    def start(self) -> int:
        self.worker = ShardWorker(self.spec, self.rank)
        return self.rank

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._run(lambda w: w.allocate_kv_cache(num_gpu_blocks, num_cpu_blocks))

    def execute(self, step: ShardStep) -> None:
        self._run(lambda w: w.execute(step))

    def _run(self, fn: Any) -> None:
        try:
            if self.worker is None:
                raise RuntimeError(f"rank {self.rank}: called before start")
            fn(self.worker)
        except BaseException:
            traceback.print_exc(file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)  # the peers' collectives fail now rather than at their timeout


class RayExecutor(Executor):
    def __init__(self, spec: ShardSpec) -> None:
        super().__init__(spec)
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("distributed_executor_backend='ray' needs Ray: pip install "
                             "ray==2.60.0") from None
        self._ray = ray
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=True,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": str(spec.num_threads)}})
        per_rank = {"GPU": 1} if spec.device_type == "cuda" else {"CPU": spec.num_threads}
        self._pg = placement_group([dict(per_rank) for _ in range(1, self.world_size)],
                                   strategy="PACK")
        self._pids: list[int] = []
        self._last: list[Any] = []
        self._ready: list[Any] = []
        actor_cls = ray.remote(RayShardWorker)
        self._actors: list[Any] = [
            actor_cls.options(
                num_cpus=per_rank.get("CPU", 0), num_gpus=per_rank.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, i),
                name=None).remote(spec, rank)
            for i, rank in enumerate(range(1, self.world_size))]
        self._finalizer = weakref.finalize(self, _shutdown, ray, self._actors, self._pg)

    def wait_joining(self, timeout_s: float) -> None:
        ray = self._ray
        try:
            ray.get(self._pg.ready(), timeout=timeout_s)
            self._pids = ray.get([a.pid.remote() for a in self._actors], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailure(f"Ray could not place {self.world_size - 1} tensor-parallel "
                                f"worker(s) ({self._pg.bundle_specs}) within {timeout_s:.0f} s: "
                                "the cluster lacks the resources.") from None
        except ray.exceptions.RayError as exc:
            raise WorkerFailure(f"a tensor-parallel Ray worker failed to start: {exc}") from None
        self._ready = [a.start.remote() for a in self._actors]

    def wait_ready(self, timeout_s: float) -> None:
        ray = self._ray
        for rank, ref in enumerate(self._ready, start=1):
            try:
                ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise WorkerFailure(f"tensor-parallel rank {rank} (Ray) did not start within "
                                    f"{timeout_s:.0f} s.") from None
            except ray.exceptions.RayError as exc:
                raise WorkerFailure(f"tensor-parallel rank {rank} (Ray) failed to start: "
                                    f"{_first_line(exc)}") from None

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self._last = [a.allocate_kv_cache.remote(num_gpu_blocks, num_cpu_blocks)
                      for a in self._actors]

    def send_step(self, step: ShardStep) -> None:
        ref = self._ray.put(step)  # serialised once for every actor
        self._last = [a.execute.remote(ref) for a in self._actors]

    def failure(self, timeout_s: float) -> str | None:
        ray = self._ray
        done, _ = ray.wait(self._last, num_returns=len(self._last), timeout=timeout_s)
        for rank, ref in enumerate(self._last, start=1):
            if ref in done:
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.RayError as exc:
                    return f"tensor-parallel rank {rank} (Ray actor) died: {_first_line(exc)}"
        return None

    def worker_pids(self) -> list[int]:
        return list(self._pids)

    def shutdown(self) -> None:
        self._finalizer()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _shutdown(ray: Any, actors: list[Any], pg: Any) -> None:
    if not ray.is_initialized():
        return
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass
    try:
        from ray.util.placement_group import remove_placement_group
        remove_placement_group(pg)
    except Exception:  # the cluster is going down
        pass
