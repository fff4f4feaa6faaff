"""The model the simulator runs, by name or path: a ``twinserve.core.model_config.ModelConfig``.

Its sizes come from the model's architecture entry (``core/architectures``), the same the real
engine builds its layers from. ``load_model_spec`` accepts a path to a ``config.json``, a directory
holding one, or the name of a bundled config (``simulator/data/models/<name>.json``,
case-insensitive, e.g. ``llama-3-8b``).
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from twinserve.core.hf_config import read_hf_config
from twinserve.core.model_config import ModelConfig

_MODELS_DIR = Path(__file__).parent / "data" / "models"
_DTYPE_FOR_BYTES = MappingProxyType({1: "float8_e4m3fn", 2: "bfloat16", 4: "float32"})
# Other spellings users type for bundled configs.
_ALIASES = MappingProxyType({"mistral-7b": "mistral-7b-v0.1", "qwen2.5-7b-instruct": "qwen2.5-7b"})


def load_model_spec(name_or_path: str | Path, dtype_bytes: int | None = None) -> ModelConfig:
    """A ``config.json`` file, a directory holding one, or a bundled name (``bundled_model_names``).

    ``dtype_bytes`` overrides the config's ``torch_dtype`` (e.g. 4 to model an fp32 run): the
    compute dtype becomes the checkpoint's when it has that size, else bfloat16 / float32 /
    float8_e4m3fn for 2 / 4 / 1.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        config_path, name = path / "config.json", path.name
        if not config_path.is_file():
            raise ValueError(f"model directory {str(path)!r} has no config.json.")
    elif path.is_file():
        config_path = path
        name = path.parent.name if path.name == "config.json" else path.stem
    else:
        config_path = _bundled_path(str(name_or_path))
        name = config_path.stem
    config = ModelConfig.from_hf_dict(read_hf_config(config_path), name)
    if dtype_bytes is None or config.dtype_bytes == dtype_bytes:
        return config
    if dtype_bytes not in _DTYPE_FOR_BYTES:
        raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes!r}.")
    return config.with_dtype(_DTYPE_FOR_BYTES[dtype_bytes])


def bundled_model_names() -> list[str]:
    """Names of the configs shipped in ``simulator/data/models``."""
    return sorted(p.stem for p in _MODELS_DIR.glob("*.json"))


def _bundled_path(name: str) -> Path:
    key = _normalize_name(name)
    key = _ALIASES.get(key, key)
    path = _MODELS_DIR / f"{key}.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name!r}: not a config.json path or directory, and not a "
                         f"bundled model. Valid names: {', '.join(bundled_model_names())}.")
    return path


def _normalize_name(name: str) -> str:
    """``meta-llama/Meta-Llama-3-8B`` -> ``llama-3-8b``; ``Llama-2-7b-hf`` -> ``llama-2-7b``."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    key = key.removeprefix("meta-")
    return key.removesuffix("-hf")
