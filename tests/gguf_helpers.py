"""Helpers for tests that write GGUF files."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 byte-level BPE base tokens."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A random-weight 2-layer Llama GGUF (F32) with a byte-level BPE tokenizer."""
    import gguf
    rng = np.random.default_rng(0)
    tokens = [*byte_tokens(), "<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt"]
    types = [1] * 256 + [3, 3, 3, 1]
    hidden, ffn, heads, kv_heads, layers = 64, 96, 4, 2, 2
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)

    def add(name: str, *shape: int) -> None:
        scale = 1.0 if len(shape) == 1 else 0.2
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))
    add("token_embd.weight", len(tokens), hidden)
    add("output_norm.weight", hidden)
    head_dim = hidden // heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        add(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
