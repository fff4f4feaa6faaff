"""Calibrated profiles kept across runs, found by what their step times depend on.

A profile measured on one machine, model, dtype, engine limits and kernel settings times the same
steps the same way the next time (up to the host's drift, which ``validate``'s speed rows
report), so ``validate`` without a profile looks here before it calibrates. An entry is a profile
JSON beside a ``.meta.json`` (``ProfileMeta``: its key and the step space it covers); it serves a
request whose key is equal and whose reachable space it covers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twinserve.fidelity.step_space import StepSpace

if TYPE_CHECKING:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner

FORMAT = 1


@dataclass(slots=True, frozen=True)
class ProfileCacheKey:
    """What a backend profile's step times depend on: the device (its model name: the CPU's
    on a CPU), torch threads, the model directory and dtype, the engine's resolved limits and
    layout, how it was measured (``quick``, ``engine_loop``) and the kernel settings (the
    engine's kernel choices by name; empty until the engine records them)."""

    device: str
    threads: int
    model: str
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    tensor_parallel_size: int = 1
    quantization: str = ""
    kv_cache_dtype: str = "auto"
    enable_lora: bool = False
    quick: bool = False
    engine_loop: bool = True
    kernel_settings: dict[str, str] = field(default_factory=dict)
    # a PP=N step runs the stages on other processes and threads: another profile
    pipeline_parallel_size: int = 1
    pp_layer_partition: str = ""  # (its stages' own shares, as measured: "" the even split)

    def __post_init__(self) -> None:
        for name in ("threads", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "block_size", "tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ProfileCacheKey.{name} must be >= 1, got {getattr(self, name)}.")
        if not all(isinstance(k, str) and isinstance(v, str)
                   for k, v in self.kernel_settings.items()):
            raise ValueError("ProfileCacheKey.kernel_settings must map names to string values.")

    @classmethod
    def of_runner(cls, runner: ModelRunner, engine: EngineArgs, threads: int,
                  quick: bool = False, engine_loop: bool = True,
                  kernel_settings: dict[str, str] | None = None) -> ProfileCacheKey:
        """The key of a calibration of ``engine`` on its loaded ``runner`` at ``threads``."""
        from twinserve.gpu.worker.platform import current_platform
        limits = runner.engine_config.scheduler
        return cls(current_platform(runner.device).device_name, threads,
                   str(Path(str(engine.model)).resolve()),
                   str(runner.dtype).removeprefix("torch."), limits.max_num_seqs,
                   limits.max_num_batched_tokens, runner.max_model_len, runner.block_size,
                   engine.tensor_parallel_size, runner.quantization or "",
                   engine.kv_cache_dtype, engine.enable_lora, quick, engine_loop,
                   dict(kernel_settings or {}), engine.pipeline_parallel_size,
                   engine.pp_layer_partition or "")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        key = self.as_dict()
        if key["pipeline_parallel_size"] == 1:  # the keys cached before it was one
            del key["pipeline_parallel_size"]
        if not key["pp_layer_partition"]:  # (likewise)
            del key["pp_layer_partition"]
        text = json.dumps({"format": FORMAT, **key}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(slots=True, frozen=True)
class ProfileMeta:
    """A cached profile's metadata: its ``key``, the ``space`` it was timed over, when, and the
    kernel settings it was measured under (``key.kernel_settings``, repeated for readers of the
    file alone)."""

    key: ProfileCacheKey
    space: StepSpace
    created: str
    kernel_settings: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "key": self.key.as_dict(),
                           "space": dataclasses.asdict(self.space), "created": self.created,
                           "kernel_settings": self.kernel_settings}, indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> ProfileMeta | None:
        """The metadata at ``path``; ``None`` for a file of another format or not readable."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                return None
            return cls(ProfileCacheKey(**data["key"]), StepSpace(**data["space"]),
                       str(data["created"]), dict(data.get("kernel_settings", {})))
        except (OSError, ValueError, TypeError, KeyError):
            return None


@dataclass(slots=True, frozen=True)
class ProfileCache:
    """A folder of cached profiles (``default_folder()``: ``profiles/`` under twinserve's
    cache)."""

    folder: Path

    def find(self, key: ProfileCacheKey, space: StepSpace) -> Path | None:
        """The newest cached profile of ``key`` whose space covers ``space`` (None: none)."""
        found = []
        for meta_path in sorted(self.folder.glob(f"{key.digest()}-*.meta.json")):
            meta = ProfileMeta.read(meta_path)
            profile = meta_path.with_name(meta_path.name.removesuffix(".meta.json") + ".json")
            if meta is not None and meta.key == key and meta.space.covers(space) \
                    and profile.is_file():
                found.append((meta.created, profile))
        return max(found)[1] if found else None

    def store(self, profile: Path, key: ProfileCacheKey, space: StepSpace) -> Path:
        """Copies ``profile`` into the cache under ``key`` and ``space``; returns the copy."""
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = (f"{key.digest()}-{space.max_num_seqs}x{space.max_num_batched_tokens}"
                f"x{space.max_model_len}")
        target = self.folder / f"{stem}.json"
        shutil.copyfile(profile, target)
        created = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime())
        meta = ProfileMeta(key, space, created, dict(key.kernel_settings))
        (self.folder / f"{stem}.meta.json").write_text(meta.to_json(), encoding="utf-8")
        return target


def default_folder() -> Path:
    """``profiles/`` under twinserve's cache folder (``gpu.models.default_model.cache_root``)."""
    from twinserve.gpu.models.default_model import cache_root
    return cache_root() / "profiles"
