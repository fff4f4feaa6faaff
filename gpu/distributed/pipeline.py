"""Pipeline parallelism: which layers a stage holds, and the point-to-point links between stages.

Ranks are numbered as vLLM numbers them: ``rank = pp_rank * tp + tp_rank``, so the engine process
(rank 0) is the first stage's tensor-parallel rank 0. Tensor-parallel rank ``t`` of stage ``s`` sends
its hidden states and residual to rank ``t`` of stage ``s + 1`` (every TP rank holds the full
hidden state after the row-parallel all-reduce); TP rank 0 of the last stage sends the sampled
rows' logits back to rank 0, where the scheduler and the sampler live. Every link is its own gloo /
NCCL group of two ranks, built from the driver's store under its own prefix, so a send waits with
the group's timeout like every collective does.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinserve.core.pipeline_stages import stage_layer_counts
from twinserve.gpu.distributed.parallel_state import GroupAddress, TPGroup, init_tp_group


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int,
                      partition: tuple[int, ...] | None = None) -> tuple[int, int]:
    """The layers ``[start, end)`` of stage ``pp_rank`` (``core.pipeline_stages``: the
    partition given, else vLLM's even split)."""
    if pp_size < 1 or not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}.")
    sizes = stage_layer_counts(num_layers, pp_size, partition)
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass(frozen=True, slots=True)
class StageLayout:
    """A rank's place in the pipeline: its stage, its layers ``[start, end)``, its TP rank."""

    pp_rank: int
    pp_size: int
    tp_rank: int
    tp_size: int
    start: int
    end: int

    @classmethod
    def of(cls, rank: int, tp_size: int, pp_size: int, num_layers: int,
           partition: tuple[int, ...] | None = None) -> StageLayout:
        pp_rank, tp_rank = divmod(rank, tp_size)
        return cls(pp_rank, pp_size, tp_rank, tp_size,
                   *stage_layer_range(num_layers, pp_size, pp_rank, partition))

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def holds(self, layer: int) -> bool:
        return self.start <= layer < self.end


@dataclass(slots=True)
class PipelineLinks:
    """A rank's links: to the previous and next stage (its own TP rank there) and, on the last
    stage's TP rank 0 and on the driver, the logits link between them. ``send_s``/``recv_s``:
    time spent in the links (the benchmark's communication share)."""

    layout: StageLayout
    device: torch.device
    prev: dist.ProcessGroup | None = None
    next: dist.ProcessGroup | None = None
    logits: dist.ProcessGroup | None = None
    timed: bool = False
    send_s: float = 0.0
    recv_s: float = 0.0
    bytes_sent: int = 0

    def send_next(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        assert self.next is not None
        self._send(self.next, torch.stack((hidden, residual)).contiguous())

    def recv_prev(self, num_tokens: int, hidden_size: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.prev is not None
        buf = torch.empty((2, num_tokens, hidden_size), dtype=dtype, device=self.device)
        self._recv(self.prev, buf)
        return buf[0], buf[1]

    def send_logits(self, logits: torch.Tensor) -> None:
        assert self.logits is not None
        self._send(self.logits, logits.contiguous())

    def recv_logits(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        assert self.logits is not None
        buf = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=self.device)
        self._recv(self.logits, buf)
        return buf

    def post_recv_logits(self, num_rows: int, vocab_size: int) -> PendingLogits:
        """Posts the receive of a batch's logits without waiting (the batch queue): the last
        stage's send of them can then complete while the driver runs its stage of the next
        batch, whose own send to stage 1 would otherwise wait on it. Receives on the link
        complete in the order they are posted."""
        assert self.logits is not None
        buf = torch.empty((num_rows, vocab_size), dtype=torch.float32, device=self.device)
        return PendingLogits(self, self.logits.recv([buf], 1 - self.logits.rank(), 0), buf)

    def _send(self, pg: dist.ProcessGroup, x: torch.Tensor) -> None:
        t0 = _now(x) if self.timed else 0.0
        pg.send([x], 1 - pg.rank(), 0).wait()
        if self.timed:
            self.send_s += _now(x) - t0
            self.bytes_sent += x.numel() * x.element_size()

    def _recv(self, pg: dist.ProcessGroup, x: torch.Tensor) -> None:
        t0 = _now(x) if self.timed else 0.0
        pg.recv([x], 1 - pg.rank(), 0).wait()
        if self.timed:
            self.recv_s += _now(x) - t0

    def close(self) -> None:
        groups, self.prev, self.next, self.logits = (self.prev, self.next, self.logits), None, None, None
        for pg in groups:
            if pg is not None and hasattr(pg, "shutdown"):
                try:
                    pg.shutdown()
                except RuntimeError:  # a link whose peer died cannot shut down cleanly
                    pass


@dataclass(slots=True)
class PendingLogits:
    """A posted receive of one batch's logits; ``wait`` returns them (its wait is timed as
    ``recv_s``: the driver idles there)."""

    links: PipelineLinks
    work: dist.Work
    buf: torch.Tensor

    def wait(self) -> torch.Tensor:
        t0 = _now(self.buf) if self.links.timed else 0.0
        self.work.wait()
        if self.links.timed:
            self.links.recv_s += _now(self.buf) - t0
        return self.buf


def _now(x: torch.Tensor) -> float:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    return time.perf_counter()


def init_pipeline_links(address: GroupAddress, store: dist.Store, layout: StageLayout,
                        device: torch.device) -> PipelineLinks:
    """Joins this rank's links (in stage order, so that no two ranks wait on each other)."""
    links = PipelineLinks(layout, device)
    s, t = layout.pp_rank, layout.tp_rank
    if not layout.is_first:
        links.prev = _pair(address, store, f"pp-link-{s - 1}-{t}", 1, device)
    if not layout.is_last:
        links.next = _pair(address, store, f"pp-link-{s}-{t}", 0, device)
    if layout.is_last and t == 0:
        links.logits = _pair(address, store, "pp-logits", 1, device)
    elif s == 0 and t == 0 and layout.pp_size > 1:
        links.logits = _pair(address, store, "pp-logits", 0, device)
    return links


def init_parallel_groups(address: GroupAddress, rank: int, device: torch.device, tp_size: int,
                         num_layers: int, store: dist.TCPStore | None = None,
                         partition: tuple[int, ...] | None = None) -> TPGroup:
    """Joins the world at ``address`` (``world_size = tp * pp``) as ``rank``: its stage's
    tensor-parallel group, then its pipeline links (``TPGroup.pipeline``), its layers by
    ``partition`` (None: the even split). The driver passes the store it hosts."""
    world = address.world_size
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"world size ({world}) must be a multiple of tensor_parallel_size "
                         f"({tp_size}).")
    if world == tp_size:
        return init_tp_group(address, rank, device, store)
    layout = StageLayout.of(rank, tp_size, world // tp_size, num_layers, partition)
    if store is None:
        store = dist.TCPStore(address.host, address.port, world, False,
                              timeout=datetime.timedelta(seconds=address.timeout_s))
    group = TPGroup(layout.tp_rank, tp_size, device, store=store)
    if tp_size > 1:
        stage_store = dist.PrefixStore(f"tp-{layout.pp_rank}", store)
        group.pg = _group(address, stage_store, layout.tp_rank, tp_size)
    group.pipeline = init_pipeline_links(address, store, layout, device)
    return group


def _pair(address: GroupAddress, store: dist.Store, prefix: str, rank: int,
          device: torch.device) -> dist.ProcessGroup:
    return _group(address, dist.PrefixStore(prefix, store), rank, 2)


def _group(address: GroupAddress, store: dist.Store, rank: int, size: int) -> dist.ProcessGroup:
    timeout = datetime.timedelta(seconds=address.timeout_s)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
