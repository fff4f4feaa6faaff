"""Loading a model under a ``quantization=`` method (``gpu/models/model_loader.py`` calls it):

- ``gguf``: ``gguf.load_gguf_model`` reads the file's blocks;
- ``int8`` / ``fp8``: the checkpoint loads as usual in fp32, then every projection is quantized
  (``quantize_linears``) and its dense weight freed;
- ``gptq`` / ``awq``: each projection's packed tensors are repacked into the kernels' U4 blocks,
  everything else (norms, embedding, LM head, biases) loads as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from twinserve.core.kernel_settings import KernelSettings
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.kernels.cpu_gemm import Gemm
from twinserve.gpu.layers.linear import LinearBase, UnquantizedLinearMethod
from twinserve.gpu.models.model import CausalLM
from twinserve.gpu.models.weights import SafetensorsWeights
from twinserve.gpu.quantization.gguf import load_gguf_model
from twinserve.gpu.quantization.quant_linear import (
    QuantizedLinearMethod,
    QuantState,
    set_quant_state,
)
from twinserve.gpu.quantization.quant_tensor import QuantTensor
from twinserve.gpu.quantization.quantized_model import QuantizedCausalLM
from twinserve.gpu.quantization.registry import CHECKPOINT, CHECKPOINT_CHECKS, LOAD_TIME, method_kind


def load_quantized_model(model_dir: Path, config: ModelConfig, quantization: str,
                         dtype: torch.dtype, device: torch.device, max_positions: int,
                         gguf_file: Path | None, quant_config: Mapping[str, Any] | None,
                         kernels: KernelSettings) -> CausalLM:
    kind = method_kind(quantization)
    if kind == "gguf":
        if gguf_file is None:
            raise ValueError("quantization='gguf' needs a .gguf model file.")
        return load_gguf_model(gguf_file, config, dtype, device, max_positions, kernels)
    if kind == "load_time":
        from twinserve.gpu.models.model_loader import load_weights
        model = CausalLM(config, max_positions, torch.float32, device, kernels=kernels)
        load_weights(model, SafetensorsWeights(model_dir))
        quantize_linears(model, LOAD_TIME[quantization], dtype)  # from the fp32 values
        if dtype != torch.float32:
            model = model.to(dtype)
            model.set_gemm(Gemm.for_device(device, dtype))
        model.requires_grad_(False)
        return model.eval()
    if quant_config is None:
        raise ValueError(f"quantization={quantization!r}: config.json has no "
                         "quantization_config.")
    CHECKPOINT_CHECKS[quantization](quant_config)
    return _load_checkpoint(model_dir, config, quantization, quant_config, dtype, device,
                            max_positions, kernels)


def quantize_linears(model: CausalLM, quantize: Callable[[torch.Tensor], QuantTensor],
                     dtype: torch.dtype) -> None:
    """Replace every dense projection of ``model`` by its quantized weight (bias kept)."""
    for module in model.modules():
        if isinstance(module, LinearBase) and isinstance(module.quant_method,
                                                         UnquantizedLinearMethod):
            weight = module._parameters.pop("weight")
            assert weight is not None
            module.quant_method = QuantizedLinearMethod(model.kernels.int8_activations)
            set_quant_state(module, QuantState(dtype, [(0, quantize(weight.data))]))


def _load_checkpoint(model_dir: Path, config: ModelConfig, quantization: str,
                     quant_config: Mapping[str, Any], dtype: torch.dtype, device: torch.device,
                     max_positions: int, kernels: KernelSettings) -> CausalLM:
    weights = SafetensorsWeights(model_dir)
    model = QuantizedCausalLM(config, max_positions, dtype, device, kernels)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    load = CHECKPOINT[quantization]
    for hf_name, target in config.arch.weight_map(config).items():
        module_name, _, leaf = target.param.rpartition(".")
        owner = model.get_submodule(module_name) if module_name else model
        if isinstance(owner, LinearBase) and leaf == "weight":
            prefix = hf_name.removesuffix(".weight")
            try:
                part = load(weights.get_raw, prefix, quant_config)
            except KeyError as exc:
                raise ValueError(f"weights: tensor {exc} is missing: a {quantization} checkpoint "
                                 "stores each projection as qweight, qzeros and scales.") from None
            QuantizedLinearMethod.load_part(owner, part, target.shard_id)
            continue
        tensor = weights.get(hf_name, target.shape)
        if isinstance(owner, LinearBase):
            owner.weight_loader(params[target.param], tensor, target.shard_id)
        else:
            params[target.param].data.copy_(tensor)
        loaded.add(target.param)
    model.finish_linears()
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights: parameters {', '.join(missing)} are in no tensor of the "
                         f"{config.architecture} weight map.")
    model.requires_grad_(False)
    return model.eval()
