"""``quantization=`` names -> how the model's weights are loaded. The names and their checks live
in ``core/quantization.py`` (the twin shares them); this maps each to its loader here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from twinserve.core.quantization import QUANTIZATION_METHODS, check_quantization
from twinserve.gpu.quantization import awq, gptq
from twinserve.gpu.quantization.fp8 import quantize_fp8
from twinserve.gpu.quantization.int8 import quantize_int8
from twinserve.gpu.quantization.quant_tensor import QuantTensor

# Quantized at load time from an unquantized checkpoint: weight [out, in] -> QuantTensor.
LOAD_TIME: Mapping[str, Callable[[torch.Tensor], QuantTensor]] = {
    "int8": quantize_int8, "fp8": quantize_fp8}
# Read from a quantized checkpoint: (tensor reader, projection prefix, quantization_config).
CHECKPOINT: Mapping[str, Callable[[Callable[[str], torch.Tensor], str, Mapping[str, Any]],
                                  QuantTensor]] = {"gptq": gptq.load_gptq, "awq": awq.load_awq}
CHECKPOINT_CHECKS: Mapping[str, Callable[[Mapping[str, Any]], int]] = {
    "gptq": gptq.check_config, "awq": awq.check_config}

assert set(LOAD_TIME) | set(CHECKPOINT) | {"gguf"} == set(QUANTIZATION_METHODS)


def method_kind(name: str) -> str:
    """``gguf``, ``load_time`` or ``checkpoint`` (ValueError listing the supported names)."""
    check_quantization(name)
    if name == "gguf":
        return "gguf"
    return "load_time" if name in LOAD_TIME else "checkpoint"
