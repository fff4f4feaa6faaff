"""The shared ``config.json`` parser in core, and the engine and simulator configs built from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from twinserve.core.hf_config import HFModelShape, read_hf_config
from twinserve.gpu.config import ModelConfig
from twinserve.simulator.model_spec import ModelSpec

MODELS_DIR = Path(__file__).resolve().parents[1] / "simulator" / "data" / "models"
BUNDLED = sorted(MODELS_DIR.glob("*.json"))


def _config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256,
    }
    return {**base, **overrides}


def test_defaults_for_kv_heads_head_dim_and_optional_fields() -> None:
    shape = HFModelShape.from_dict(_config())
    assert (shape.num_key_value_heads, shape.head_dim) == (4, 16)
    assert (shape.rope_theta, shape.rope_scaling) == (10000.0, None)
    assert (shape.tie_word_embeddings, shape.qkv_bias, shape.o_proj_bias) == (False, False, False)
    assert (shape.eos_token_ids, shape.dtype) == ((), None)
    explicit = HFModelShape.from_dict(_config(num_key_value_heads=2, head_dim=32, eos_token_id=[1, 2]))
    assert (explicit.num_key_value_heads, explicit.head_dim, explicit.eos_token_ids) == (2, 32, (1, 2))


def test_transformers_4_rope_and_dtype_spelling() -> None:
    shape = HFModelShape.from_dict(_config(rope_theta=5e5, torch_dtype="float16", rope_scaling={
        "type": "linear", "factor": 2.0}))
    assert shape.rope_theta == 5e5
    assert shape.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert shape.dtype == "float16"


def test_transformers_5_rope_and_dtype_spelling() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    shape = HFModelShape.from_dict(_config(dtype="bfloat16", rope_parameters={**scaling, "rope_theta": 5e5}))
    assert (shape.rope_theta, shape.rope_scaling, shape.dtype) == (5e5, scaling, "bfloat16")
    plain = HFModelShape.from_dict(_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)


def test_qwen2_has_qkv_bias_and_llama_attention_bias_has_both() -> None:
    qwen = HFModelShape.from_dict(_config(architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert (qwen.qkv_bias, qwen.o_proj_bias) == (True, False)
    llama = HFModelShape.from_dict(_config(attention_bias=True))
    assert (llama.qkv_bias, llama.o_proj_bias) == (True, True)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_required_field_is_named(field: str) -> None:
    raw = _config()
    del raw[field]
    with pytest.raises(ValueError, match=rf"config\.json.*'{field}'"):
        HFModelShape.from_dict(raw)
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match=field):
        ModelSpec.from_hf_config(raw, "m")


def test_non_positive_field_is_named() -> None:
    with pytest.raises(ValueError, match=r"config\.json: num_attention_heads must be a positive integer"):
        HFModelShape.from_dict(_config(num_attention_heads=0))


def test_consumers_keep_their_own_requirements() -> None:
    no_positions = _config()
    del no_positions["max_position_embeddings"]
    assert ModelConfig.from_dict(no_positions).max_position_embeddings == 2048
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ModelSpec.from_hf_config(no_positions, "m")
    with pytest.raises(ValueError, match="architectures"):
        ModelConfig.from_dict(_config(architectures=[]))
    assert ModelSpec.from_hf_config(_config(architectures=[]), "m").num_layers == 2


def test_read_hf_config_accepts_a_file_or_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    assert read_hf_config(tmp_path) == read_hf_config(tmp_path / "config.json") == _config()
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path / "absent")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_engine_and_simulator_agree_on_bundled_shapes(path: Path) -> None:
    raw = read_hf_config(path)
    engine, spec = ModelConfig.from_dict(raw), ModelSpec.from_hf_config(raw, path.stem)
    assert (engine.num_hidden_layers, engine.hidden_size, engine.intermediate_size, engine.vocab_size) == (
        spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size)
    assert (engine.num_attention_heads, engine.num_key_value_heads, engine.head_dim) == (
        spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)
    assert (engine.q_size, engine.kv_size) == (spec.q_size, spec.kv_size)
    assert (engine.tie_word_embeddings, engine.max_position_embeddings) == (
        spec.tie_word_embeddings, spec.max_position_embeddings)
    assert engine.attention_bias == spec.qkv_bias
