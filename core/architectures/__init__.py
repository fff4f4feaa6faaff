"""Architecture families by HF architecture name: a decorator registry, one file per family.

``@register`` on a ``DenseDecoder`` subclass (see ``llama.py``) makes it serve the HF names in its
``names``; every module of this package is imported with it. The table is filled only by those
decorators when this package is imported and is read-only afterwards: it holds stateless
entries, never a model or a config.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, TypeVar

from twinserve.core.architectures.base import (
    DenseDecoder,
    FamilyFields,
    LinearSpec,
    MoEFields,
    WeightShard,
    WeightTarget,
)

A = TypeVar("A", bound=type[DenseDecoder])

_REGISTRY: dict[str, DenseDecoder] = {}
_BY_MODEL_TYPE: dict[str, str] = {}


def register(cls: A) -> A:
    """Class decorator: one entry (an instance of ``cls``) for each name in ``cls.names``."""
    if not cls.names or not cls.model_type:
        raise ValueError(f"architecture {cls.__name__} must set names and model_type")
    entry = cls()
    for name in cls.names:
        if name in _REGISTRY:
            raise ValueError(f"architecture {name!r} is registered twice")
        _REGISTRY[name] = entry
    _BY_MODEL_TYPE.setdefault(cls.model_type, cls.names[0])
    return cls


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_architecture(name: str) -> DenseDecoder:
    """The entry serving HF architecture ``name``; an unknown one raises ValueError listing
    the supported ones."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ValueError(f"unknown architecture {name!r}; supported: "
                         f"{', '.join(supported_architectures())}.")
    return entry


def architecture_name(raw: Mapping[str, Any]) -> str:
    """The HF architecture of a ``config.json``: ``architectures[0]``, else the registered
    architecture of its ``model_type``."""
    names = raw.get("architectures")
    if isinstance(names, list) and names:
        return str(names[0])
    model_type = raw.get("model_type")
    if isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError("config.json: field 'architectures' is missing or empty, and model_type "
                     f"{model_type!r} names no registered family; supported: "
                     f"{', '.join(supported_architectures())}.")


def _import_families() -> None:
    """Every module of this package but the shared bases (``base``, ``*_base``) is a family that
    registers itself on import, so adding one is adding its file."""
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name != "base" and not module.name.endswith("_base"):
            importlib.import_module(f"{__name__}.{module.name}")


_import_families()

__all__ = ["DenseDecoder", "FamilyFields", "LinearSpec", "MoEFields", "WeightShard", "WeightTarget",
           "architecture_name", "get_architecture", "register", "supported_architectures"]
