"""Load an HF Llama/Mistral/Qwen2 directory into ``CausalLM``, fusing q/k/v and gate/up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from twinserve.gpu.config import ModelConfig
from twinserve.gpu.cpu_gemm import cpu_has_native_bf16
from twinserve.gpu.model import CausalLM
from twinserve.gpu.weights import SafetensorsWeights

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig,
                  device: torch.device) -> torch.dtype:
    """``"auto"``: on CPU bfloat16 where the CPU has native bf16 matmuls (avx512_bf16 / AMX),
    else float32, exact to the checkpoint. On such CPUs ``"bfloat16"`` is the faster choice for
    small batches (half the weight bytes: batch-1 decode ~2x float32 here) and ~10% slower for large
    ones, whose products are widened to float32 (``cpu_gemm``). On CUDA the config's half dtype,
    bfloat16 for float32 checkpoints."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be one of {list(_DTYPES)}, got {dtype}.")
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return _DTYPES.get(config.torch_dtype or "", torch.bfloat16) \
                if config.torch_dtype in ("bfloat16", "float16") else torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {dtype!r}.")
    return _DTYPES[dtype]


def load_generation_config(model_dir: Path) -> dict[str, Any]:
    """``generation_config.json`` if present, else ``{}``."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> CausalLM:
    """Build the model on the meta device, then assign the checkpoint's (fused) tensors."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: model directory does not exist.")
    config = ModelConfig.from_dir(model_dir)
    weights = SafetensorsWeights(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, max_positions, dtype, device)
    state = {name: t.to(device=device, dtype=dtype) for name, t in
             _fused_state(config, weights).items()}
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _fused_state(config: ModelConfig, weights: SafetensorsWeights) -> dict[str, torch.Tensor]:
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.q_size, config.kv_size
    state = {"embed_tokens": weights.get("model.embed_tokens.weight",
                                         (config.vocab_size, hidden)),
             "norm": weights.get("model.norm.weight", (hidden,))}
    if not config.tie_word_embeddings:
        state["lm_head"] = weights.get("lm_head.weight", (config.vocab_size, hidden))
    for i in range(config.num_hidden_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = hf + "self_attn.", hf + "mlp."
        state[ours + "input_layernorm"] = weights.get(hf + "input_layernorm.weight", (hidden,))
        state[ours + "post_attention_layernorm"] = weights.get(
            hf + "post_attention_layernorm.weight", (hidden,))
        state[ours + "qkv_proj"] = torch.cat([
            weights.get(attn + "q_proj.weight", (q, hidden)),
            weights.get(attn + "k_proj.weight", (kv, hidden)),
            weights.get(attn + "v_proj.weight", (kv, hidden))])
        if config.attention_bias:
            state[ours + "qkv_bias"] = torch.cat([
                weights.get(attn + "q_proj.bias", (q,)),
                weights.get(attn + "k_proj.bias", (kv,)),
                weights.get(attn + "v_proj.bias", (kv,))])
        state[ours + "o_proj"] = weights.get(attn + "o_proj.weight", (hidden, q))
        state[ours + "gate_up_proj"] = torch.cat([
            weights.get(mlp + "gate_proj.weight", (inter, hidden)),
            weights.get(mlp + "up_proj.weight", (inter, hidden))])
        state[ours + "down_proj"] = weights.get(mlp + "down_proj.weight", (hidden, inter))
    return state
