"""One tensor-parallel rank's share of the model: its weight shard, its paged KV cache (only its
KV heads) and its forward pass. The driver (rank 0, inside ``ModelRunner``) and every worker rank
run the same forward on the same prepared inputs; the collectives inside join them.

Only rank 0 samples. The per-request sampling state (seeded generators, grammar matchers, penalties
over the output so far) lives once, in the engine process beside the scheduler, and the sampled
tokens need not travel back: the scheduler is in that process. Every rank still computes its
slice of the logits, because the all-gather needs them, and drops the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from twinserve.core.kernel_settings import DEFAULT_KERNELS, KernelSettings
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.distributed.parallel_state import GroupAddress, TPGroup, destroy_tp_group
from twinserve.gpu.distributed.pipeline import init_parallel_groups
from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.models.model import CausalLM
from twinserve.gpu.models.model_loader import load_model
from twinserve.gpu.worker.batch import ModelInput
from twinserve.gpu.worker.cpu_cores import usable_cores
from twinserve.gpu.worker.kv_cache import KVCache, KVCacheSpec
from twinserve.gpu.worker.platform import TORCH_DTYPES


def threads_per_rank(world_size: int) -> int:
    """The machine's cores split across the ranks (one OpenMP pool per process)."""
    return max(1, usable_cores() // world_size)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """What a rank needs to build its shard (picklable: it crosses to worker processes)."""

    model_dir: str
    dtype: str
    device_type: str  # "cpu" or "cuda" (rank r takes cuda:r)
    max_model_len: int
    block_size: int
    address: GroupAddress
    num_threads: int
    enforce_eager: bool = True
    profile_tokens: int = 0  # > 0 on CUDA: profile a forward of this many tokens (all ranks)
    kernels: KernelSettings = DEFAULT_KERNELS  # the engine's kernel choices (every rank the same)
    tensor_parallel_size: int = 0  # 0: the whole world (no pipeline parallelism)
    layer_partition: tuple[int, ...] | None = None  # layers per stage (None: the even split)

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size or self.address.world_size

    def device(self, rank: int) -> torch.device:
        return torch.device("cuda", rank) if self.device_type == "cuda" else torch.device("cpu")


@dataclass(slots=True)
class ShardStep:
    """One step as every rank sees it: block moves, then (if any token is scheduled) the
    prepared inputs, on the CPU. Built once by the driver and sent to every worker."""

    blocks_to_swap_out: Sequence[tuple[int, int]] = ()
    blocks_to_swap_in: Sequence[tuple[int, int]] = ()
    blocks_to_copy: Sequence[tuple[int, int]] = ()
    inputs: ModelInput | None = None


def kv_cache_spec(config: ModelConfig, block_size: int, dtype: torch.dtype,
                  tp_size: int, num_layers: int | None = None) -> KVCacheSpec:
    """A rank's cache holds only its KV heads (one replicated head when fewer than ranks), and
    only its stage's ``num_layers`` under pipeline parallelism."""
    return KVCacheSpec(num_layers or config.num_hidden_layers, block_size,
                       max(1, config.num_key_value_heads // tp_size), config.head_dim, dtype)


def inputs_to(inputs: ModelInput, device: torch.device) -> ModelInput:
    """``inputs`` with every tensor on ``device`` (the host copy the workers receive)."""
    if inputs.input_ids.device == device:
        return inputs
    meta = inputs.meta
    return ModelInput(
        inputs.input_ids.to(device), inputs.positions.to(device),
        AttentionMetadata(meta.slot_mapping.to(device), meta.block_tables.to(device),
                          meta.seq_lens.to(device), meta.query_start_loc.to(device),
                          meta.max_query_len, meta.max_seq_len),
        inputs.sample_rows.to(device), inputs.sample_index)


class ShardWorker:
    """A worker rank (1 .. tp - 1): joins the group, loads its shard, then runs steps."""

    def __init__(self, spec: ShardSpec, rank: int) -> None:
        torch.set_num_threads(spec.num_threads)
        self.spec, self.rank = spec, rank
        self.device = spec.device(rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        config = ModelConfig.from_dir(spec.model_dir)
        self.group: TPGroup = init_parallel_groups(spec.address, rank, self.device, spec.tp_size,
                                                   config.num_hidden_layers,
                                                   partition=spec.layer_partition)
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.model: CausalLM = load_model(spec.model_dir, self.dtype, self.device,
                                          spec.max_model_len, self.group, kernels=spec.kernels)
        if spec.profile_tokens > 0:  # in step with the driver's profile (its collectives)
            from twinserve.gpu.worker.cuda_graphs import profile_peak_memory
            profile_peak_memory(self.model, spec.profile_tokens, spec.block_size,
                                spec.max_model_len)
        self.kv_cache: KVCache | None = None
        self._graphs: Any = None  # gpu.cuda_graphs.DecodeGraphs on CUDA

    def allocate_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The driver's block counts (every rank the same); then the decode graphs on CUDA."""
        start, end = self.model.layer_range
        spec = kv_cache_spec(self.model.config, self.spec.block_size, self.dtype,
                             self.group.world_size, end - start)
        self.kv_cache = KVCache(spec, num_gpu_blocks, num_cpu_blocks, self.device)
        if self.device.type == "cuda" and not self.spec.enforce_eager:
            from twinserve.gpu.worker.cuda_graphs import DecodeGraphs
            self._graphs = DecodeGraphs(self.model, self.kv_cache.gpu, self.spec.block_size,
                                        self.spec.max_model_len)

    @torch.inference_mode()
    def execute(self, step: ShardStep) -> None:
        kv = self.kv_cache
        if kv is None:
            raise RuntimeError(f"rank {self.rank}: a step arrived before the KV cache.")
        kv.swap_out(list(step.blocks_to_swap_out))
        kv.swap_in(list(step.blocks_to_swap_in))
        kv.copy_blocks(list(step.blocks_to_copy))
        if step.inputs is None:
            return
        inputs = inputs_to(step.inputs, self.device)
        graphs = self._graphs
        if graphs is not None and graphs.can_run(inputs):
            hidden = graphs.run(inputs)
        else:
            self.model.backend.prepare(inputs.meta, self.spec.block_size)
            hidden = self.model(inputs.input_ids, inputs.positions, kv.gpu, inputs.meta)
        pp = self.group.pipeline
        if inputs.sample_index and (pp is None or pp.layout.is_last):
            # the logits' all-gather (and, under pipeline parallelism, their send); rank 0 samples
            self.model.compute_logits(hidden[inputs.sample_rows])

    def close(self) -> None:
        destroy_tp_group(self.group)
