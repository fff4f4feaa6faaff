"""RoPE scalings (gpu/layers/rope.py) against HF transformers' own rope init functions: the inverse
frequencies and the attention factor of yarn, dynamic NTK and longrope (and the older types),
read from config.json the way the engine reads it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from twinserve.core.engine_config import resolve_max_model_len
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.layers.rope import RotaryEmbedding, rope_parameters

HEAD_DIM = 32
BASE: dict[str, Any] = dict(vocab_size=64, hidden_size=128, intermediate_size=64,
                            num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=4096, rope_theta=10000.0)
LONG = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
SHORT = [1.0 + 0.01 * i for i in range(HEAD_DIM // 2)]
SCALINGS = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    "yarn-untruncated": {"rope_type": "yarn", "factor": 2.0,
                         "original_max_position_embeddings": 2048, "truncate": False},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "longrope": {"rope_type": "longrope", "long_factor": LONG, "short_factor": SHORT,
                 "original_max_position_embeddings": 1024},
    "linear": {"rope_type": "linear", "factor": 3.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
}


def _hf(name: str, seq_len: int | None) -> tuple[torch.Tensor, float]:
    scaling = SCALINGS[name]
    config = transformers.LlamaConfig(**BASE, rope_parameters={**scaling, "rope_theta": 10000.0})
    inv_freq, factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)
    return inv_freq, float(factor)


def _ours(name: str, max_positions: int) -> tuple[torch.Tensor, float]:
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                       "rope_scaling": SCALINGS[name]}, "m")
    return rope_parameters(config.head_dim, config.rope_theta, config.rope_scaling, max_positions)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inverse_frequencies_and_attention_factor_equal_hf(name: str) -> None:
    ours, factor = _ours(name, 4096 if name != "longrope" else 512)
    ref, ref_factor = _hf(name, None)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref_factor, rel=1e-9)
    if name.startswith("yarn") or name == "longrope":
        assert factor != 1.0  # the factor is exercised


def test_longrope_uses_the_long_factors_past_the_original_length() -> None:
    short, _ = _ours("longrope", 1024)
    long, factor = _ours("longrope", 4096)
    ref_long, ref_factor = _hf("longrope", 1025)
    torch.testing.assert_close(long, ref_long.float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(short, _hf("longrope", 1024)[0].float(), rtol=1e-6, atol=0)
    assert not torch.equal(short, long) and factor == pytest.approx(ref_factor)


def test_longrope_is_served_within_the_original_length_only() -> None:
    """Past original_max_position_embeddings HF picks the factors by each sequence's length
    (above: short at 1024, long at 1025), so a shorter sequence under a longer max_model_len
    would differ from HF: the default is capped, a longer max_model_len refused by name."""
    config = ModelConfig.from_hf_dict({**BASE, "architectures": ["Phi3ForCausalLM"],
                                       "rope_scaling": SCALINGS["longrope"]}, "m")
    assert config.max_position_embeddings == 4096
    assert resolve_max_model_len(None, config) == 1024
    assert resolve_max_model_len(512, config) == 512
    with pytest.raises(ValueError, match="longrope's original_max_position_embeddings"):
        resolve_max_model_len(1025, config)
    yarn = ModelConfig.from_hf_dict({**BASE, "architectures": ["LlamaForCausalLM"],
                                     "rope_scaling": SCALINGS["yarn"]}, "m")
    assert resolve_max_model_len(None, yarn) == 4096  # other scalings keep the model's limit


def test_dynamic_ntk_is_plain_rope_within_the_trained_length() -> None:
    ours, _ = _ours("dynamic", 4096)
    ref_at_limit, _ = _hf("dynamic", 4096)  # HF's base grows only past max_position_embeddings
    torch.testing.assert_close(ours, ref_at_limit.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, _hf("dynamic", 8192)[0].float())


def test_the_table_carries_the_attention_factor() -> None:
    inv_freq, factor = _ours("yarn", 64)
    table = RotaryEmbedding(HEAD_DIM, 64, 10000.0, SCALINGS["yarn"] | {
        "max_position_embeddings": 4096}, torch.float32, torch.device("cpu"))
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq[None, :]
    torch.testing.assert_close(table.cos, freqs.cos() * factor)


def test_a_longrope_factor_list_of_the_wrong_length_is_refused() -> None:
    bad = {**SCALINGS["longrope"], "short_factor": [1.0, 1.0]}
    with pytest.raises(ValueError, match="longrope short_factor has 2 entries, the head needs 16"):
        rope_parameters(HEAD_DIM, 10000.0, bad, 64)
