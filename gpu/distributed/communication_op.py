"""The collectives the sharded layers call: all-reduce (row-parallel outputs, the vocab-parallel
embedding) and all-gather (vocab-parallel logits). A group of one rank returns its input."""

from __future__ import annotations

import time

import torch

from twinserve.gpu.distributed.parallel_state import TPGroup


def tensor_model_parallel_all_reduce(group: TPGroup, x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the ranks, in place; returns it."""
    if group.pg is None:
        return x
    x = x.contiguous()
    t0 = time.perf_counter() if group.timed else 0.0
    group.pg.allreduce([x]).wait()
    if group.timed:
        _sync(x)
        stats = group.stats
        stats.all_reduce_s += time.perf_counter() - t0
        stats.all_reduce_calls += 1
        stats.all_reduce_bytes += x.numel() * x.element_size()
    return x


def tensor_model_parallel_all_gather(group: TPGroup, x: torch.Tensor,
                                     dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim``, in rank order."""
    if group.pg is None:
        return x
    x = x.contiguous()
    t0 = time.perf_counter() if group.timed else 0.0
    parts = [torch.empty_like(x) for _ in range(group.world_size)]
    group.pg.allgather([parts], [x]).wait()
    out = torch.cat(parts, dim=dim)
    if group.timed:
        _sync(out)
        group.stats.all_gather_s += time.perf_counter() - t0
        group.stats.all_gather_calls += 1
    return out


def _sync(x: torch.Tensor) -> None:
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
