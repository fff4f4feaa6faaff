"""The linear-layer method for quantized weights (``gpu/layers/linear.py``'s ``quant_method``).

A layer's weight is a list of ``QuantTensor`` parts stacked along the output rows: one part when
every shard of a fused projection has the same format (q, k, v of a Q4_1 file), several when a
GGUF file mixes formats (Q4_K_M stores some v/down projections as Q6_K). Activations are
multiplied in fp32 and the result cast back to the layer's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from twinserve.gpu.layers.linear import LinearBase, LinearMethodBase, ShardId
from twinserve.gpu.quantization.quant_tensor import QuantTensor, concat_rows


@dataclass(slots=True)
class QuantState:
    """A quantized layer's weight: ``(first_row, QuantTensor)`` parts in row order, and the
    dtype its outputs are cast to."""

    out_dtype: torch.dtype
    parts: list[tuple[int, QuantTensor]] = field(default_factory=list)


def quant_state(layer: nn.Module) -> QuantState:
    return cast(QuantState, layer.__dict__["quant_state"])


def set_quant_state(layer: nn.Module, state: QuantState) -> None:
    layer.__dict__["quant_state"] = state  # a plain attribute, not a parameter or submodule


class QuantizedLinearMethod(LinearMethodBase):
    """Weights as the layer's ``QuantState``, set by ``load_part`` (shard by shard) and merged
    by ``finish``. ``int8_activations``: the engine's ``quant_activations`` is ``int8``."""

    def __init__(self, int8_activations: bool) -> None:
        self.int8_activations = int8_activations

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        set_quant_state(layer, QuantState(dtype))
        layer.register_parameter("bias", nn.Parameter(
            torch.zeros(output_size, dtype=dtype, device=device), requires_grad=False)
            if bias else None)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        state = quant_state(layer)
        parts = state.parts
        int8 = self.int8_activations
        if len(parts) == 1:
            out = parts[0][1].matmul(x, int8_activations=int8)
        else:
            out = x.new_empty(x.shape[0], layer.output_size, dtype=torch.float32)
            for start, part in parts:
                out[:, start:start + part.rows] = part.matmul(x, int8_activations=int8)
        out = out.to(state.out_dtype)
        bias = layer._parameters["bias"]
        return out if bias is None else out.add_(bias)

    def apply_feature_major(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        return self.apply(layer, x).t()

    @staticmethod
    def load_part(layer: LinearBase, part: QuantTensor, shard_id: ShardId = None) -> None:
        """Place one HF tensor's quantized rows (shard ``shard_id`` of a fused layer)."""
        offsets = getattr(layer, "shard_offsets", {None: (0, layer.output_size)})
        if shard_id not in offsets:
            raise ValueError(f"{type(layer).__name__}: unknown shard {shard_id!r}; shards: "
                             f"{list(offsets)}.")
        start, size = offsets[shard_id]
        if part.rows != size or part.in_features != layer.input_size:
            raise ValueError(f"quantized weight [{part.rows}, {part.in_features}] does not fit "
                             f"shard {shard_id!r} of shape [{size}, {layer.input_size}].")
        parts = quant_state(layer).parts
        parts.append((start, part))
        parts.sort(key=lambda p: p[0])

    @staticmethod
    def finish(layer: LinearBase) -> None:
        """Check every row is loaded once and merge neighbouring parts of one format."""
        state = quant_state(layer)
        parts = state.parts
        row = 0
        for start, part in parts:
            if start != row:
                raise ValueError(f"{type(layer).__name__}: output rows {row}..{start} have no "
                                 "quantized weight.")
            row += part.rows
        if row != layer.output_size:
            raise ValueError(f"{type(layer).__name__}: {layer.output_size - row} output rows "
                             "have no quantized weight.")
        merged: list[tuple[int, QuantTensor]] = []
        for start, part in parts:
            if merged and merged[-1][1].fmt == part.fmt:
                merged[-1] = (merged[-1][0], concat_rows([merged[-1][1], part]))
            else:
                merged.append((start, part))
        state.parts = merged


def quantized_weight_bytes(module: nn.Module) -> int:
    """Bytes the quantized parts of every layer of ``module`` hold."""
    return sum(part.nbytes for layer in module.modules() if "quant_state" in layer.__dict__
               for _, part in quant_state(layer).parts)
