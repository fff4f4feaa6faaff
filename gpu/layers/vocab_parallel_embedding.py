"""The vocabulary split across tensor-parallel ranks (vLLM's ``VocabParallelEmbedding`` and
``ParallelLMHead``): rank r holds rows ``[r * n, (r + 1) * n)`` of the embedding and of the LM head,
``n = ceil(vocab / tp)``, the last rank's tail padded with zero rows that no token id reaches.

    embed:  tokens outside the rank's rows look up zeros; an all-reduce sums the ranks' rows.
    logits: each rank's ``[N, n]`` slice, all-gathered to ``[N, tp * n]`` and cut to ``vocab``.

Every rank gets the whole logits (an all-gather, not a gather to rank 0) because that costs the same
on two ranks and keeps one collective shape for gloo and NCCL; only rank 0 samples (see
``gpu/executor/worker.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from twinserve.gpu.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from twinserve.gpu.distributed.parallel_state import TPGroup


@dataclass(frozen=True, slots=True)
class VocabParallel:
    """One rank's slice of a ``vocab_size`` vocabulary, and the collectives joining the slices."""

    vocab_size: int
    group: TPGroup | None = None

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}.")

    @property
    def tp_size(self) -> int:
        return 1 if self.group is None else self.group.world_size

    @property
    def rows_per_rank(self) -> int:
        return -(-self.vocab_size // self.tp_size)

    @property
    def start(self) -> int:
        return (0 if self.group is None else self.group.rank) * self.rows_per_rank

    @property
    def end(self) -> int:
        """One past the last real (unpadded) row of this rank."""
        return min(self.start + self.rows_per_rank, self.vocab_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """This rank's rows of the full ``[vocab, hidden]`` HF tensor; padding rows zeroed."""
        if loaded_weight.shape[0] != self.vocab_size:
            raise ValueError(f"vocabulary weight of shape {tuple(loaded_weight.shape)} does not "
                             f"have vocab_size={self.vocab_size} rows.")
        n = self.end - self.start
        param.data[:n].copy_(loaded_weight[self.start:self.end])
        param.data[n:].zero_()

    def embed(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.group is None or self.group.world_size == 1:
            return F.embedding(input_ids, weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(self.group, out)

    def gather_logits(self, local_logits: torch.Tensor) -> torch.Tensor:
        """``[N, rows_per_rank]`` on every rank -> ``[N, vocab]`` on every rank."""
        if self.group is None or self.group.world_size == 1:
            return local_logits
        full = tensor_model_parallel_all_gather(self.group, local_logits, dim=-1)
        return full[:, :self.vocab_size]
