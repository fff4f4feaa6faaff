"""The CPU product widths a machine tuned (``gemm_tuning``), kept across loads.

Each load used to time its own widths, and near-ties flipped from one load to the next (7 and 8
columns padded to 16 in some loads, kept at 8 in others; 3 kept or padded to 4), so two engines
of one model on one machine ran some batch sizes at different costs, and a profile calibrated in
one process missed the replays of another by the difference. As autotuners keep their choices
(Triton's cache, oneDNN's primitive cache), the first load on a machine times the widths and
writes them to ``$TWINSERVE_CACHE/cpu_gemm/<key>.json``; later loads of the same weight shapes,
dtype, thread count, CPU and torch read them. Delete the folder to time them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from twinserve.gpu.kernels.cpu_gemm import TUNED_MAX_WIDTH, TUNED_WIDTHS
from twinserve.gpu.models.default_model import cache_root

FORMAT = 3


def tuning_key(weights: Sequence[torch.Tensor], extra: dict[str, Any]) -> dict[str, Any]:
    """What the timed widths depend on: the products' shapes and dtype, the threads, the CPU,
    the torch build and ``extra`` (what was timed, the rest of the model's shape)."""
    return {"format": FORMAT, **extra, "widths": list(TUNED_WIDTHS), "cpu": _cpu_name(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "dtype": str(weights[0].dtype) if weights else "",
            "shapes": [list(w.shape) for w in weights]}


def cached_widths(weights: Sequence[torch.Tensor], tune: Callable[[], tuple[int, ...]],
                  extra: dict[str, Any] | None = None) -> tuple[int, ...]:
    """The widths stored for the key of ``weights`` (one layer's) and ``extra``, else
    ``tune()``'s, stored (a file that cannot be read or holds anything else is timed again and
    replaced; one that cannot be written leaves the widths of this load only)."""
    key = tuning_key(weights, extra or {})
    path = cache_root() / "cpu_gemm" / f"{_digest(key)}.json"
    widths = _read(path, key)
    if widths is None:
        widths = tune()
        _write(path, {"key": key, "small_widths": list(widths)})
    return widths


def _read(path: Path, key: dict[str, Any]) -> tuple[int, ...] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        widths = data["small_widths"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    valid = (data.get("key") == key and isinstance(widths, list)
             and len(widths) == TUNED_MAX_WIDTH + 1
             and all(type(w) is int and t <= w <= max(t, TUNED_MAX_WIDTH)
                     for t, w in enumerate(widths)))
    return tuple(widths) if valid else None


def _write(path: Path, data: dict[str, Any]) -> None:
    """Atomically (a temporary sibling renamed), so concurrent loads never read half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        return


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def _cpu_name() -> str:
    """/proc/cpuinfo's model name and flags (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        return ""
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:16] if lines else ""
