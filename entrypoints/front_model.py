"""What the data-parallel front knows of the model without loading it: its configuration, the
limits the engine arguments resolve to, and its tokenizer.

The replicas run the model; the front only validates, tokenizes and routes. ``FrontModel`` stands
where an ``LLMEngine`` expects its ``ModelRunner`` (the attributes the engine's constructor and the
HTTP layer read), so the server's front-local ``LLMEngine`` checks requests exactly as one
engine does while holding no weights: it never runs a step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from twinserve.core.engine_args import EngineArgs
from twinserve.core.engine_config import EngineConfig, resolve_engine_config
from twinserve.core.model_config import ModelConfig
from twinserve.core.quantization import resolve_quantization
from twinserve.gpu.engine.tokenizer import Tokenizer
from twinserve.gpu.models.default_model import resolve_model_source
from twinserve.gpu.models.model_loader import quantization_config
from twinserve.gpu.worker.platform import current_platform, resolve_device


@dataclass(slots=True)
class FrontModel:
    """A model's facts, as a ``ModelRunner`` exposes them, with no weights (``model`` is None)."""

    model_dir: Path
    gguf_file: Path | None
    config: ModelConfig
    engine_config: EngineConfig
    tokenizer: Tokenizer | None
    model: None = None  # no weights: nothing here can run a step
    tp: None = None
    lora: None = None
    kv_connector: None = None  # the front moves no KV
    can_queue_batches: bool = False  # it runs no pipeline either

    @property
    def max_model_len(self) -> int:
        return self.engine_config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def shutdown(self) -> None:
        """Nothing to end: the front holds no workers."""


def front_tokenizer(model_dir: Path) -> Tokenizer | None:
    """The model's tokenizer alone (None without a ``tokenizer.json``)."""
    return Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None


def front_model(args: EngineArgs, usage_context: str) -> FrontModel:
    """The facts of ``args.model`` resolved as ``ModelRunner`` resolves them (quantization found
    in the files, the engine configuration on ``args.device``), reading only its configuration
    and tokenizer files."""
    model_dir, gguf_file = resolve_model_source(args.model)
    quantization = resolve_quantization(args.quantization, args.model,
                                        quantization_config(model_dir))
    args = dataclasses.replace(args, quantization=quantization)
    config = ModelConfig.from_dir(model_dir)
    resolved = resolve_engine_config(args, config, current_platform(resolve_device(args.device)),
                                     usage_context)
    return FrontModel(model_dir, gguf_file, config, resolved, front_tokenizer(model_dir))
