"""LoRA adapters in PEFT's format, read and checked against the base model.

A PEFT LoRA directory holds ``adapter_config.json`` (``peft_type: LORA``, ``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``, ...) and ``adapter_model.safetensors`` with, per adapted
projection, ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight`` of shape
``[r, in]`` and ``...lora_B.weight`` of shape ``[out, r]``. The adapted product is
``W x + scaling * B (A x)`` with ``scaling = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA); the
scaling is folded into B here, once.

Anything the engine would not apply as PEFT does is refused with the reason: pickled weights
(``adapter_model.bin``), DoRA, trained biases, ``modules_to_save``, per-module rank or alpha
patterns, layer subsets or replication, trained token embeddings, targets other than the
decoder's seven projections, a rank above ``max_lora_rank``, and tensors whose shapes do not fit
the base model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from twinserve.core.lora import PEFT_TARGET_MODULES, LoRARequest
from twinserve.core.model_config import ModelConfig

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
                  r"(?:\.[^.]+)?\.weight$")
# adapter_config.json fields with the only value the engine implements.
_MUST_BE = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "lora_bias": False, "layer_replication": None,
            "trainable_token_indices": None}


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """An adapter checked against its base model: per ``(layer, module)`` (``module`` one of
    ``PEFT_TARGET_MODULES``) the pair ``(A [r, in], B [out, r] * scaling)`` in float32."""

    name: str
    int_id: int
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``module -> (in, out)`` of each projection a LoRA may target, from the architecture."""
    shapes: dict[str, tuple[int, int]] = {}
    for spec in config.arch.linears(config):
        for shard in spec.shards:
            shapes[shard.hf_name.rpartition(".")[2]] = (spec.input_size, shard.output_size)
    return shapes


def load_peft_adapter(request: LoRARequest, config: ModelConfig,
                      max_lora_rank: int) -> LoRAAdapter:
    """Reads and checks ``request.lora_path``; raises ValueError saying what does not fit."""
    path = Path(request.lora_path)
    where = f"LoRA adapter {request.lora_name!r} ({path})"
    if not path.is_dir():
        raise ValueError(f"{where}: no such directory.")
    peft = _read_config(path / "adapter_config.json", where)
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: adapter_config.json field 'r' must be a positive integer, "
                         f"got {rank!r}.")
    if rank > max_lora_rank:
        raise ValueError(f"{where}: rank {rank} is above max_lora_rank {max_lora_rank}; raise "
                         "max_lora_rank (--max-lora-rank).")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}.")
    scaling = alpha / math.sqrt(rank) if peft.get("use_rslora") else alpha / rank
    _check_targets(peft.get("target_modules"), where)
    weights = _read_weights(path, where, config, rank, scaling)
    return LoRAAdapter(request.lora_name, request.lora_int_id, str(path), rank, scaling,
                       frozenset(module for _, module in weights), weights)


def _read_config(file: Path, where: str) -> dict[str, Any]:
    if not file.is_file():
        raise ValueError(f"{where}: adapter_config.json is missing.")
    try:
        peft = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: adapter_config.json is not valid JSON ({exc}).") from None
    if not isinstance(peft, dict):
        raise ValueError(f"{where}: adapter_config.json must hold an object.")
    if peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {peft.get('peft_type')!r} is not supported (LORA).")
    for key, allowed in _MUST_BE.items():
        value = peft.get(key, allowed)
        if value != allowed and not (allowed is None and value in ([], {})):
            raise ValueError(f"{where}: adapter_config.json {key}={value!r} is not supported "
                             f"(only {allowed!r}).")
    return peft


def _check_targets(targets: Any, where: str) -> None:
    """A list of names must be among the seven projections; a regex (PEFT allows one) or
    ``all-linear`` is judged by the tensors the file holds."""
    if isinstance(targets, list):
        unknown = sorted({str(t) for t in targets} - set(PEFT_TARGET_MODULES))
        if unknown:
            raise ValueError(f"{where}: target_modules {unknown} are not supported; supported: "
                             f"{', '.join(PEFT_TARGET_MODULES)}.")
    elif not isinstance(targets, str):
        raise ValueError(f"{where}: target_modules must be a list or a string, got {targets!r}.")


def _read_weights(path: Path, where: str, config: ModelConfig, rank: int,
                  scaling: float) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        pickled = (path / "adapter_model.bin").is_file()
        raise ValueError(f"{where}: adapter_model.safetensors is missing" + (
            "; adapter_model.bin is a pickle, which twinserve never loads (convert it to "
            "safetensors)." if pickled else "."))
    shapes = projection_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        handle = safe_open(str(file), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise ValueError(f"{where}: adapter_model.safetensors cannot be read ({exc}).") from None
    for key in handle.keys():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"{where}: tensor {key!r} is not the LoRA A or B of a decoder "
                             f"projection ({', '.join(PEFT_TARGET_MODULES)}).")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in shapes or layer >= config.num_hidden_layers:
            raise ValueError(f"{where}: tensor {key!r} targets no projection of the base model "
                             f"({config.num_hidden_layers} layers; {', '.join(shapes)}).")
        in_size, out_size = shapes[module]
        expected = (rank, in_size) if half == "A" else (out_size, rank)
        tensor = handle.get_tensor(key)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(tensor.shape)}; the base "
                             f"model with r={rank} needs {expected}.")
        halves.setdefault((layer, module), {})[half] = tensor.float()
    if not halves:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA tensors.")
    weights = {}
    for target, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{where}: layer {target[0]} {target[1]} has lora_{set(pair).pop()} "
                             "without its other half.")
        weights[target] = (pair["A"].contiguous(), (pair["B"] * scaling).contiguous())
    return weights


def write_random_adapter(config: ModelConfig, out: Path, rank: int, seed: int,
                         targets: tuple[str, ...] = PEFT_TARGET_MODULES) -> Path:
    """A PEFT-format LoRA of ``config`` with random A and B (scaled so outputs change)."""
    shapes = projection_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            in_size, out_size = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_size, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_size, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
        "bias": "none", "lora_dropout": 0.0, "task_type": "CAUSAL_LM"}))
    return out
