"""One tensor-parallel group: its rank, size and ``torch.distributed`` process group.

The group is built straight from a ``TCPStore`` (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), not
through ``init_process_group``: that one sets a process-wide default group, and two engines in one
process must share nothing. The driver (rank 0) hosts the store on a free port; the workers join it.
Every collective carries the group's timeout, so a rank that hangs ends the step with an error
instead of a hang.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from twinserve.gpu.distributed.pipeline import PipelineLinks

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where the ranks meet: the store's host and port, the group size and the backend."""

    host: str
    port: int
    world_size: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}.")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be gloo or nccl, got {self.backend!r}.")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}.")


@dataclass(slots=True)
class CommStats:
    """Time and bytes a rank spent in collectives (the benchmark's all-reduce share)."""

    all_reduce_s: float = 0.0
    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_s: float = 0.0
    all_gather_calls: int = 0

    def reset(self) -> None:
        self.all_reduce_s = self.all_gather_s = 0.0
        self.all_reduce_calls = self.all_reduce_bytes = self.all_gather_calls = 0


@dataclass(slots=True)
class TPGroup:
    """A rank's view of its tensor-parallel group. ``pg`` is None when ``world_size == 1``."""

    rank: int
    world_size: int
    device: torch.device
    pg: dist.ProcessGroup | None = None
    store: dist.TCPStore | None = None
    stats: CommStats = field(default_factory=CommStats)
    timed: bool = False  # time collectives into ``stats`` (a sync per call on CUDA)
    pipeline: PipelineLinks | None = None  # pipeline parallelism: this rank's stage and links

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def host_store(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
               host: str = "127.0.0.1") -> dist.TCPStore:
    """The driver's store, on a free port (``store.port``), waiting for ``world_size`` ranks."""
    return dist.TCPStore(host, 0, world_size, True,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def init_tp_group(address: GroupAddress, rank: int, device: torch.device,
                  store: dist.TCPStore | None = None) -> TPGroup:
    """Joins the group at ``address`` as ``rank`` (the driver passes the store it hosts)."""
    if not 0 <= rank < address.world_size:
        raise ValueError(f"rank must be in [0, {address.world_size}), got {rank}.")
    timeout = datetime.timedelta(seconds=address.timeout_s)
    if address.world_size == 1:
        return TPGroup(0, 1, device)
    if store is None:
        store = dist.TCPStore(address.host, address.port, address.world_size, False,
                              timeout=timeout)
    pg: Any
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    else:
        pg = dist.ProcessGroupGloo(store, rank, address.world_size, timeout)
    return TPGroup(rank, address.world_size, device, pg, store)


def destroy_tp_group(group: TPGroup) -> None:
    """Drops the process group, the pipeline links (and the store, for the driver); safe to
    call twice."""
    if group.pipeline is not None:
        group.pipeline.close()
    pg, group.pg, group.store = group.pg, None, None
    if pg is not None and hasattr(pg, "shutdown"):
        try:
            pg.shutdown()
        except RuntimeError:  # a group whose peer died cannot shut down cleanly
            pass
