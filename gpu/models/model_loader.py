"""Load an HF directory of a registered architecture into ``CausalLM``: each checkpoint tensor goes
through the weight loader of the layer the architecture's weight map names (q/k/v and gate/up
land in their fused parameters there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from twinserve.core.kernel_settings import DEFAULT_KERNELS, KernelSettings
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.distributed.parallel_state import TPGroup
from twinserve.gpu.layers.linear import LinearBase
from twinserve.gpu.models.model import CausalLM
from twinserve.gpu.models.weights import SafetensorsWeights


def load_generation_config(model_dir: Path) -> dict[str, Any]:
    """``generation_config.json`` if present, else ``{}``."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def quantization_config(model_dir: Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (GPTQ/AWQ checkpoints), or None."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        value = json.load(f).get("quantization_config")
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{path}: quantization_config must be a mapping.")
    return value


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, tp_group: TPGroup | None = None,
               quantization: str | None = None, gguf_file: Path | None = None,
               kernels: KernelSettings = DEFAULT_KERNELS) -> CausalLM:
    """Build the model's (uninitialised) parameters in ``dtype`` on ``device``, then place every
    checkpoint tensor through its layer's ``weight_loader``, by the architecture's weight map
    (with ``tp_group``: this tensor-parallel rank's shard of each). ``quantization`` (resolved:
    gguf, int8, fp8, gptq, awq) loads through ``gpu/quantization/loader.py``; ``gguf_file`` is the
    file a ``gguf`` model runs from (``model_dir`` then holds its config and tokenizer);
    ``kernels``: the engine's kernel choices (``core/kernel_settings.py``)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory does not exist.")
    config = ModelConfig.from_dir(model_dir)
    if quantization is not None:
        if tp_group is not None and tp_group.world_size > 1:
            raise ValueError(f"quantization={quantization!r} with tensor_parallel_size > 1 is "
                             "not implemented.")
        from twinserve.gpu.quantization.loader import load_quantized_model
        return load_quantized_model(model_dir, config, quantization, dtype, device,
                                    max_positions, gguf_file, quantization_config(model_dir),
                                    kernels)
    weights = SafetensorsWeights(model_dir)
    model = CausalLM(config, max_positions, dtype, device, tp_group, kernels=kernels)
    load_weights(model, weights)
    model.requires_grad_(False)
    return model.eval()


def load_weights(model: CausalLM, weights: SafetensorsWeights) -> None:
    """Every tensor of ``model.config.arch.weight_map`` into its parameter (shapes checked);
    raises ValueError for a missing tensor or a parameter left unloaded. A pipeline stage reads
    only its own tensors (safetensors reads a tensor only when asked for it)."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf_name, target in model.config.arch.weight_map(model.config).items():
        if model.pipeline is not None and target.param not in params:
            continue  # another stage's layer, embedding, norm or head
        tensor = weights.get(hf_name, target.shape)
        param = params[target.param]
        module_name, _, _ = target.param.rpartition(".")
        owner = model.get_submodule(module_name) if module_name else model
        if isinstance(owner, LinearBase):
            owner.weight_loader(param, tensor, target.shard_id)
        elif hasattr(param, "weight_loader"):  # a vocab-parallel embedding / LM head shard
            if target.shard_id is None:
                param.weight_loader(param, tensor)
            else:  # one expert's tensor of an MoE layer's stacked experts (gpu/layers/moe.py)
                param.weight_loader(param, tensor, target.shard_id)
        else:
            param.data.copy_(tensor)
        loaded.add(target.param)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"weights: parameters {', '.join(missing)} are in no tensor of the "
                         f"{model.config.architecture} weight map.")
