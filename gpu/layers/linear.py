"""Linear layers in the manner of vLLM's: a layer holds a ``quant_method`` that creates its
parameters and computes its product, and a ``weight_loader`` that places each HF tensor in its
(fused, later tensor-parallel) parameter.

    QKVParallelLinear           q/k/v_proj       -> one [q + 2 kv, hidden] weight, shards q, k, v
    MergedColumnParallelLinear  gate/up_proj     -> one [2 inter, hidden] weight, shards 0, 1
    RowParallelLinear           o_proj, down_proj   (tensor parallelism splits the input dim)
    ReplicatedLinear            the same weight on every rank

``UnquantizedLinearMethod`` keeps the weight in the model's dtype and multiplies through
``gpu.cpu_gemm.Gemm`` (its CPU fast paths: feature-major slabs, widened half products, padded
token counts). Quantized weights plug in as another method; LoRA as a wrapper of ``apply``.
Tensor parallelism (Megatron-LM's split, as vLLM's layers): a column-parallel layer holds rank r's
rows of every shard (q/k/v: its heads; k/v replicated when there are fewer KV heads than ranks),
a row-parallel layer rank r's input columns and all-reduces its output over ``tp_group``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from twinserve.gpu.distributed.communication_op import tensor_model_parallel_all_reduce
from twinserve.gpu.distributed.parallel_state import TPGroup
from twinserve.gpu.kernels.cpu_gemm import Gemm

if TYPE_CHECKING:
    from twinserve.core.architectures import LinearSpec
    from twinserve.core.model_config import ModelConfig

ShardId = str | int | None


@dataclass(frozen=True, slots=True)
class LinearOptions:
    """What every linear layer of one model shares: its products, dtype, device, quantization
    method and tensor-parallel position."""

    gemm: Gemm
    dtype: torch.dtype
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    quant_method: LinearMethodBase | None = None  # None: UnquantizedLinearMethod
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: TPGroup | None = None  # the row-parallel layers' all-reduce (None: tp_size 1)


class LinearMethodBase(ABC):
    """How a linear layer stores its weights and computes ``x @ W.T + b``."""

    @abstractmethod
    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        """Register the layer's parameters (``weight``, ``bias``)."""

    @abstractmethod
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``[T, in] -> [T, out]`` (contiguous); ``x`` may be a transposed view."""

    @abstractmethod
    def apply_feature_major(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        """``apply(layer, x).t()``: ``[out, T]``, the layout the CPU MLP path consumes."""


class UnquantizedLinearMethod(LinearMethodBase):
    """Weights in the model's dtype, products by the layer's ``Gemm``."""

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        weight = torch.empty(output_size, input_size, dtype=dtype, device=device)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))
        layer.register_parameter("bias", nn.Parameter(
            torch.zeros(output_size, dtype=dtype, device=device), requires_grad=False)
            if bias else None)

    # ``_parameters[...]`` rather than ``layer.weight``: nn.Module's ``__getattr__`` fallback costs
    # about as much as the rest of a batch-1 product's Python here, four products a layer.
    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        params = layer._parameters
        return layer.gemm.linear(x, params["weight"], params["bias"])  # type: ignore[arg-type]

    def apply_feature_major(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        params = layer._parameters
        out = layer.gemm.feature_major(x, params["weight"])  # type: ignore[arg-type]
        bias = params["bias"]
        return out if bias is None else out.add_(bias[:, None])


class LinearBase(nn.Module):
    """``input_size -> output_size`` (the full, unsharded sizes); this rank's parameters are
    ``[output_size_per_partition, input_size_per_partition]``."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 options: LinearOptions, input_size_per_partition: int | None = None,
                 output_size_per_partition: int | None = None) -> None:
        super().__init__()
        _check_tp(options.tp_rank, options.tp_size)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition or input_size
        self.output_size_per_partition = output_size_per_partition or output_size
        self.tp_rank, self.tp_size = options.tp_rank, options.tp_size
        self.tp_group = options.tp_group
        self.gemm = options.gemm
        method = options.quant_method
        self.quant_method = UnquantizedLinearMethod() if method is None else method
        self.quant_method.create_weights(self, self.input_size_per_partition,
                                         self.output_size_per_partition, bias, options.dtype,
                                         options.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)

    def forward_feature_major(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply_feature_major(self, x)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        """Copy a whole HF tensor into ``param`` (``shard_id`` must be None)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}.")
        _copy_into(param.data, loaded_weight)

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
                f"tp={self.tp_rank}/{self.tp_size}")


class ReplicatedLinear(LinearBase):
    """The full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Splits the output dim: rank r holds rows ``[r * n, (r + 1) * n)`` of every shard, the
    shards stacked on dim 0 (``shard_offsets``: each HF tensor's ``(start, size)`` in the full,
    unsharded layout; ``local_offsets``: ``(start, size, source_start)`` in this rank's)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool,
                 shard_ids: Sequence[ShardId], options: LinearOptions,
                 local_sizes: Sequence[tuple[int, int]] | None = None) -> None:
        tp, rank = options.tp_size, options.tp_rank
        if local_sizes is None:  # an even split of every shard
            for shard_id, size in zip(shard_ids, output_sizes, strict=True):
                if size % tp:
                    raise ValueError(f"shard {shard_id!r} of {size} rows cannot be split evenly "
                                     f"across tensor_parallel_size={tp} ranks.")
            local_sizes = [(size // tp, rank * (size // tp)) for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias, options,
                         output_size_per_partition=sum(n for n, _ in local_sizes))
        offsets: dict[ShardId, tuple[int, int]] = {}
        local: dict[ShardId, tuple[int, int, int]] = {}
        start = local_start = 0
        for shard_id, size, (n, src) in zip(shard_ids, output_sizes, local_sizes, strict=True):
            offsets[shard_id] = (start, size)
            local[shard_id] = (local_start, n, src)
            start += size
            local_start += n
        self.shard_offsets = offsets
        self.local_offsets = local

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        """Place this rank's rows of HF tensor ``shard_id`` (or its bias) in the fused ``param``;
        ``shard_id`` None: a checkpoint tensor holding every shard stacked (Phi-3), split here."""
        if shard_id is None and None not in self.shard_offsets:
            for sid, (start, size) in self.shard_offsets.items():
                self.weight_loader(param, loaded_weight.narrow(0, start, size), sid)
            return
        if shard_id not in self.shard_offsets:
            raise ValueError(f"{type(self).__name__}: unknown shard {shard_id!r}; "
                             f"shards: {list(self.shard_offsets)}.")
        _, size = self.shard_offsets[shard_id]
        _check_shape(loaded_weight, (size, *param.shape[1:]), shard_id)
        local_start, n, src = self.local_offsets[shard_id]
        _copy_into(param.data.narrow(0, local_start, n), loaded_weight.narrow(0, src, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight: ``[(heads + 2 * kv_heads) * head_size, hidden]``.
    Rank r holds ``heads / tp`` query heads and ``max(1, kv_heads / tp)`` KV heads: with fewer
    KV heads than ranks each KV head is replicated on ``tp / kv_heads`` consecutive ranks."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool, options: LinearOptions) -> None:
        tp, rank = options.tp_size, options.tp_rank
        check_heads_divisible(total_num_heads, total_num_kv_heads, tp)
        q, kv = total_num_heads * head_size, total_num_kv_heads * head_size
        heads, kv_heads = total_num_heads // tp, max(1, total_num_kv_heads // tp)
        kv_head0 = rank * kv_heads if total_num_kv_heads >= tp else \
            rank // (tp // total_num_kv_heads)
        local_q, local_kv = heads * head_size, kv_heads * head_size
        local = [(local_q, rank * local_q), (local_kv, kv_head0 * head_size),
                 (local_kv, kv_head0 * head_size)]
        super().__init__(hidden_size, (q, kv, kv), bias, ("q", "k", "v"), options, local)
        self.head_size = head_size
        self.num_heads, self.num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads_per_partition, self.num_kv_heads_per_partition = heads, kv_heads


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input in one weight (gate and up), shards ``0, 1, ...``."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool,
                 options: LinearOptions) -> None:
        super().__init__(input_size, output_sizes, bias, range(len(output_sizes)), options)


class RowParallelLinear(LinearBase):
    """Splits the input dim (rank r holds columns ``[r * n, (r + 1) * n)``) and all-reduces the
    partial outputs; the bias is loaded on rank 0 only (zeros elsewhere), so it is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 options: LinearOptions) -> None:
        if input_size % options.tp_size:
            raise ValueError(f"a row-parallel input of {input_size} columns cannot be split evenly "
                             f"across tensor_parallel_size={options.tp_size} ranks.")
        super().__init__(input_size, output_size, bias, options,
                         input_size_per_partition=input_size // options.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x)
        group = self.tp_group
        return out if group is None else tensor_model_parallel_all_reduce(group, out)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}.")
        _check_shape(loaded_weight, (param.shape[0], self.input_size)[:param.dim()], None)
        if param.dim() == 2:
            per_rank = self.input_size_per_partition
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * per_rank, per_rank)
        elif self.tp_rank > 0:  # the bias: once, on rank 0, before the reduction
            loaded_weight = torch.zeros_like(loaded_weight)
        _copy_into(param.data, loaded_weight)


def linear_from_spec(spec: LinearSpec, config: ModelConfig,
                     options: LinearOptions) -> LinearBase:
    """The engine layer an architecture entry's ``LinearSpec`` names."""
    if spec.kind == "qkv":
        return QKVParallelLinear(spec.input_size, config.head_dim, config.num_attention_heads,
                                 config.num_key_value_heads, spec.bias, options)
    if spec.kind == "merged_column":
        return MergedColumnParallelLinear(spec.input_size, [s.output_size for s in spec.shards],
                                          spec.bias, options)
    if spec.kind == "row":
        return RowParallelLinear(spec.input_size, spec.output_size, spec.bias, options)
    if spec.kind == "replicated":
        return ReplicatedLinear(spec.input_size, spec.output_size, spec.bias, options)
    raise ValueError(f"linear layer {spec.name!r}: unknown kind {spec.kind!r}.")


def check_heads_divisible(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """vLLM's rule: query heads split evenly; KV heads split evenly or replicated evenly."""
    if num_heads % tp_size:
        raise ValueError(f"Total number of attention heads ({num_heads}) must be divisible by "
                         f"tensor parallel size ({tp_size}).")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"Total number of key/value heads ({num_kv_heads}) must divide, or be "
                         f"divisible by, tensor parallel size ({tp_size}).")


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}.")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, {tp_size}), got {tp_rank}.")


def _check_shape(loaded: torch.Tensor, shape: tuple[int, ...], shard_id: ShardId) -> None:
    """The whole (unsharded) HF tensor's shape, checked before it is cut for this rank."""
    if tuple(loaded.shape) != tuple(shape):
        where = "" if shard_id is None else f" shard {shard_id!r}"
        raise ValueError(f"weight of shape {tuple(loaded.shape)} does not fit{where} of shape "
                         f"{tuple(shape)}.")


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight of shape {tuple(src.shape)} does not fit a parameter slice of "
                         f"shape {tuple(dst.shape)}.")
    dst.copy_(src)
