"""twinserve: an LLM serving engine and its SimPy digital twin, sharing one scheduler.

``from twinserve import LLM, SamplingParams`` loads the real engine (torch) on first use only, so
simulation-only users never import torch.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "Logprob", "LoRARequest", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from twinserve.entrypoints.llm import LLM
        return LLM
    if name == "LoRARequest":
        from twinserve.core.lora import LoRARequest
        return LoRARequest
    if name == "Logprob":
        from twinserve.core.logprobs import Logprob
        return Logprob
    if name == "PoolingParams":
        from twinserve.core.pooling_params import PoolingParams
        return PoolingParams
    if name == "SamplingParams":
        from twinserve.core.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'twinserve' has no attribute {name!r}")
