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
Tensor parallelism plugs in through ``tp_rank``/``tp_size``: only ``tp_size=1`` is implemented.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from twinserve.gpu.cpu_gemm import Gemm

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
    """``input_size -> output_size`` (the full, unsharded sizes)."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 options: LinearOptions) -> None:
        super().__init__()
        _check_tp(options.tp_rank, options.tp_size)
        self.input_size, self.output_size = input_size, output_size
        self.tp_rank, self.tp_size = options.tp_rank, options.tp_size
        self.gemm = options.gemm
        method = options.quant_method
        self.quant_method = UnquantizedLinearMethod() if method is None else method
        self.quant_method.create_weights(self, input_size, output_size, bias, options.dtype,
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
    """Tensor parallelism would split the output dim: rank r holds rows ``[r * n, (r + 1) * n)``
    of every shard. With ``shard_offsets`` the weight is several HF tensors stacked on dim 0."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool,
                 shard_ids: Sequence[ShardId], options: LinearOptions) -> None:
        super().__init__(input_size, sum(output_sizes), bias, options)
        offsets: dict[ShardId, tuple[int, int]] = {}
        start = 0
        for shard_id, size in zip(shard_ids, output_sizes, strict=True):
            offsets[shard_id] = (start, size)
            start += size
        self.shard_offsets = offsets

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        """Place HF tensor ``shard_id`` (its rows, or its bias) in the fused ``param``."""
        if shard_id not in self.shard_offsets:
            raise ValueError(f"{type(self).__name__}: unknown shard {shard_id!r}; "
                             f"shards: {list(self.shard_offsets)}.")
        start, size = self.shard_offsets[shard_id]
        _check_shape(loaded_weight, (size, *param.shape[1:]), shard_id)
        per_rank = size // self.tp_size
        rows = loaded_weight.narrow(0, self.tp_rank * per_rank, per_rank)
        _copy_into(param.data.narrow(0, start // self.tp_size, per_rank), rows)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one weight: ``[(heads + 2 * kv_heads) * head_size, hidden]``."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool, options: LinearOptions) -> None:
        q, kv = total_num_heads * head_size, total_num_kv_heads * head_size
        super().__init__(hidden_size, (q, kv, kv), bias, ("q", "k", "v"), options)
        self.head_size = head_size
        self.num_heads, self.num_kv_heads = total_num_heads, total_num_kv_heads


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input in one weight (gate and up), shards ``0, 1, ...``."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool,
                 options: LinearOptions) -> None:
        super().__init__(input_size, output_sizes, bias, range(len(output_sizes)), options)


class RowParallelLinear(LinearBase):
    """Tensor parallelism would split the input dim (rank r holds columns ``[r * n, (r + 1) *
    n)``) and all-reduce the outputs, the bias added once after the reduction."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: ShardId = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} has no shard {shard_id!r}.")
        _check_shape(loaded_weight, (param.shape[0], self.input_size)[:param.dim()], None)
        if param.dim() == 2:
            per_rank = self.input_size // self.tp_size
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * per_rank, per_rank)
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


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if tp_size != 1:
        raise ValueError(f"tensor_parallel_size={tp_size} is not implemented for the real engine's "
                         "linear layers (only 1).")
    if tp_rank != 0:
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
