"""Convert a llama.cpp GGUF (Llama architecture, BPE "gpt2" tokenizer) into an HF directory.

Weights are dequantized with ``gguf.quants.dequantize`` and stored as float32 safetensors: the
dequantized values ``d * q + m`` are exact in float32, so the HF directory is the GGUF model, bit
for bit (bfloat16 would round them; ``dtype="bfloat16"`` at load time casts once in memory).
llama.cpp stores Q and K rows permuted for its interleaved RoPE; ``unpermute`` restores HF's
rotate_half layout (the inverse of ``permute`` in llama.cpp's ``convert_hf_to_gguf.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_CONTROL = 3  # gguf.TokenType.CONTROL


def convert_gguf(gguf_path: Path, out_dir: Path, weights: bool = True) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json and
    generation_config.json for ``gguf_path`` into ``out_dir`` (which must exist); without
    ``weights`` everything but model.safetensors (what running the GGUF natively needs)."""
    reader = gguf.GGUFReader(str(gguf_path))
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.")}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: general.architecture is "
                         f"{meta.get('general.architecture')!r}, only 'llama' is converted.")
    ids = {k: int(reader.fields[f"tokenizer.ggml.{k}_token_id"].contents())
           for k in ("bos", "eos", "padding") if f"tokenizer.ggml.{k}_token_id" in reader.fields}
    config = {**_config(meta), "bos_token_id": ids.get("bos"), "eos_token_id": ids.get("eos")}
    if any(t.name == "output.weight" for t in reader.tensors):
        config["tie_word_embeddings"] = False
    for tensor in reader.tensors:
        hf_name(tensor.name)  # every tensor must have a counterpart, weights written or not
    _write_json(out_dir / "config.json", config)
    if weights:
        save_file(_weights(reader, config), str(out_dir / "model.safetensors"),
                  metadata={"format": "pt"})
    tokenizer, special = _tokenizer(reader)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "GPT2Tokenizer", "chat_template": meta.get("tokenizer.chat_template"),
        "bos_token": tokens[ids["bos"]] if "bos" in ids else None,
        "eos_token": tokens[ids["eos"]] if "eos" in ids else None,
        "pad_token": tokens[ids["padding"]] if "padding" in ids else None,
        "add_bos_token": False, "additional_special_tokens": special,
        "model_max_length": config["max_position_embeddings"]})
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids.get("bos"), "eos_token_id": ids.get("eos"),
        "pad_token_id": ids.get("padding")})


def _config(meta: dict[str, Any]) -> dict[str, Any]:
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(meta["llama.vocab_size"]), "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32",
    }


def hf_name(gguf_name: str) -> str:
    """The HF tensor name of a GGUF tensor (ValueError when it has none)."""
    parts = gguf_name.split(".")
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no HF counterpart.")


def permuted_heads(gguf_name: str, config: dict[str, Any]) -> int | None:
    """The head count whose llama.cpp row permutation ``gguf_name`` carries (q, k), else None."""
    kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
    if kind == "attn_q":
        return int(config["num_attention_heads"])
    if kind == "attn_k":
        return int(config["num_key_value_heads"])
    return None


def _weights(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        heads = permuted_heads(tensor.name, config)
        if heads is not None:
            array = unpermute(array, heads)
        out[hf_name(tensor.name)] = torch.from_numpy(np.ascontiguousarray(array))
    return out


def unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate_half halves)."""
    half = weight.shape[0] // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tokenizer(reader: gguf.GGUFReader) -> tuple[Tokenizer, list[str]]:
    """A byte-level BPE ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*`` (model "gpt2")."""
    model = reader.fields["tokenizer.ggml.model"].contents()
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer.ggml.model is {model!r}, only 'gpt2' (BPE) is converted.")
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ", 1)) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split_digits = reader.fields.get("tokenizer.ggml.pre") is not None and \
        reader.fields["tokenizer.ggml.pre"].contents() == "smollm"
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level]) if split_digits
        else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, kind in zip(tokens, types) if kind == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tokenizer, special


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
