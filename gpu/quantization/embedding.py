"""Quantized token embeddings and LM head, read from their blocks: a lookup dequantizes only the
looked-up rows (the same values as the fp32 table), the LM head's product runs through the
quantized kernels like any projection. A tied model shares one table for both."""

from __future__ import annotations

import torch
from torch import nn

from twinserve.gpu.quantization.quant_tensor import QuantTensor


class QuantizedEmbedding(nn.Module):
    """``[vocab, hidden]`` as a ``QuantTensor``; ``dtype``: the model's activations;
    ``int8_activations``: the engine's ``quant_activations`` is ``int8`` (the LM head's
    product)."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype, int8_activations: bool) -> None:
        super().__init__()
        self.weight_q = weight
        self.dtype = dtype
        self.int8_activations = int8_activations

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T] -> [T, hidden]`` in the model's dtype."""
        if input_ids.numel() and (int(input_ids.min()) < 0
                                  or int(input_ids.max()) >= self.weight_q.rows):
            raise ValueError(f"token id out of range [0, {self.weight_q.rows}).")
        return self.weight_q.dequantize(input_ids.long()).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, vocab]``."""
        return self.weight_q.matmul(hidden, int8_activations=self.int8_activations)
