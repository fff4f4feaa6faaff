"""Reading tensors from ``model.safetensors`` or sharded safetensors (never pickle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class SafetensorsWeights:
    """Name -> tensor over one file or the shards listed in ``model.safetensors.index.json``."""

    __slots__ = ("_files", "_where")

    def __init__(self, model_dir: Path) -> None:
        model_dir = Path(model_dir)
        single = model_dir / "model.safetensors"
        index = model_dir / "model.safetensors.index.json"
        if single.is_file():
            shards = [single]
        elif index.is_file():
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: field 'weight_map' is missing.")
            shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        else:
            raise FileNotFoundError(
                f"{model_dir}: no model.safetensors or model.safetensors.index.json.")
        self._files = {}
        self._where: dict[str, str] = {}
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"{shard}: weight shard listed in the index is missing.")
            handle = safe_open(str(shard), framework="pt")
            self._files[shard.name] = handle
            for key in handle.keys():
                self._where[key] = shard.name

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as stored (KeyError when absent): quantized checkpoints' packed
        tensors, whose shapes the loader checks."""
        if name not in self._where:
            raise KeyError(name)
        return self._files[self._where[name]].get_tensor(name)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """The tensor ``name``, checked against the ``shape`` the config implies."""
        if name not in self._where:
            raise ValueError(f"weights: tensor {name!r} is missing from the safetensors files.")
        tensor = self._files[self._where[name]].get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self._where[name]}: tensor {name!r} has shape "
                             f"{tuple(tensor.shape)}, config.json implies {tuple(shape)}.")
        return tensor
