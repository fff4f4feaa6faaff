"""``ModelConfig``: the one model description, parsed from a ``config.json`` in transformers 4.x and
5.x spellings, validated field by field, and shared by the engine and the simulator."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from twinserve.core.hf_config import read_hf_config
from twinserve.core.model_config import ModelConfig
from twinserve.simulator.model_spec import load_model_spec

MODELS_DIR = Path(__file__).resolve().parents[2] / "simulator" / "data" / "models"
BUNDLED = sorted(MODELS_DIR.glob("*.json"))


def _config(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 256,
    }
    return {**base, **overrides}


def _parse(**overrides: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict(_config(**overrides), "m")


def test_defaults_for_kv_heads_head_dim_and_optional_fields() -> None:
    config = _parse()
    assert (config.name, config.architecture, config.model_type) == ("m", "LlamaForCausalLM",
                                                                      "llama")
    assert (config.num_key_value_heads, config.head_dim) == (4, 16)
    assert (config.rope_theta, config.rope_scaling, config.rms_norm_eps) == (10000.0, None, 1e-6)
    assert (config.tie_word_embeddings, config.qkv_bias, config.o_proj_bias) == (False,) * 3
    assert (config.eos_token_ids, config.torch_dtype, config.dtype) == ((), None, "bfloat16")
    assert config.sliding_window is None
    explicit = _parse(num_key_value_heads=2, head_dim=32, eos_token_id=[1, 2], rms_norm_eps=1e-5)
    assert (explicit.num_key_value_heads, explicit.head_dim) == (2, 32)
    assert explicit.eos_token_ids == (1, 2)
    assert explicit.rms_norm_eps == 1e-5


def test_transformers_4_rope_and_dtype_spelling() -> None:
    config = _parse(rope_theta=5e5, torch_dtype="float16", rope_scaling={"type": "linear",
                                                                         "factor": 2.0})
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"type": "linear", "factor": 2.0, "rope_type": "linear"}
    assert (config.torch_dtype, config.dtype, config.dtype_bytes) == ("float16", "float16", 2)


def test_transformers_5_rope_and_dtype_spelling() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = _parse(dtype="float32", rope_theta=None,
                    rope_parameters={**scaling, "rope_theta": 5e5})
    assert (config.rope_theta, config.rope_scaling) == (5e5, scaling)
    assert (config.torch_dtype, config.dtype, config.dtype_bytes) == ("float32", "float32", 4)
    plain = _parse(rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    assert (plain.rope_theta, plain.rope_scaling) == (1e6, None)
    # both spellings: the legacy rope_scaling wins, as transformers 5.x reads it
    both = _parse(rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert (both.rope_theta, both.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2.0})


@pytest.mark.parametrize("scaling", [{"rope_type": "mrope", "factor": 4.0},
                                     {"type": "proportional", "factor": 2.0}])
def test_unknown_rope_scaling_type_is_refused_when_read(scaling: dict[str, Any]) -> None:
    kind = scaling.get("rope_type", scaling.get("type"))
    with pytest.raises(ValueError, match=rf"rope_scaling type '{kind}' is not implemented.*"
                                         r"default, linear, llama3, dynamic, yarn, longrope"):
        _parse(rope_scaling=scaling)
    with pytest.raises(ValueError, match="not implemented"):
        _parse(rope_parameters={**scaling, "rope_theta": 1e4})


def test_rope_scaling_missing_a_field_is_refused() -> None:
    with pytest.raises(ValueError, match="'llama3' lacks field 'low_freq_factor'"):
        _parse(rope_scaling={"rope_type": "llama3", "factor": 8.0})


def test_biases_per_family() -> None:
    qwen = _parse(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert (qwen.qkv_bias, qwen.o_proj_bias, qwen.mlp_bias) == (True, False, False)
    llama = _parse(attention_bias=True, mlp_bias=True)
    assert (llama.qkv_bias, llama.o_proj_bias, llama.mlp_bias) == (True, True, True)
    mistral = _parse(architectures=["MistralForCausalLM"], model_type="mistral",
                     attention_bias=True)  # Mistral's layers have no biases
    assert (mistral.qkv_bias, mistral.o_proj_bias) == (False, False)


def test_sliding_window_per_family() -> None:
    mistral = {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert _parse(**mistral, sliding_window=16).sliding_window == 16
    assert _parse(**mistral, sliding_window=None).sliding_window is None
    assert _parse(**mistral).sliding_window == 4096  # HF MistralConfig's default
    qwen = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    assert _parse(**qwen, sliding_window=16, use_sliding_window=False).sliding_window is None
    assert _parse(**qwen, sliding_window=16, use_sliding_window=True).sliding_window == 16
    assert _parse(sliding_window=16).sliding_window is None  # Llama has none
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        _parse(**mistral, sliding_window=0)


def test_a_sliding_window_serves_past_its_length() -> None:
    config = _parse(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16)
    for length in (8, 16, 17, 10**6):
        config.check_servable(length)
    assert (config.kv_sliding_window, config.layer_window(0)) == (16, 16)
    assert _parse().kv_sliding_window is None


def test_activation_other_than_silu_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not implemented"):
        _parse(hidden_act="gelu")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size",
                                   "num_hidden_layers", "num_attention_heads"])
def test_missing_required_field_is_named(field: str) -> None:
    raw = _config()
    del raw[field]
    with pytest.raises(ValueError, match=rf"config\.json.*'{field}'"):
        ModelConfig.from_hf_dict(raw, "m")


@pytest.mark.parametrize(("overrides", "match"), [
    ({"num_attention_heads": 0}, r"config\.json: num_attention_heads must be a positive integer"),
    ({"vocab_size": "100"}, r"config\.json: vocab_size must be a positive integer"),
    ({"num_key_value_heads": 3}, r"num_attention_heads=4 is not a multiple of num_key_value_h"),
    ({"head_dim": 15}, r"head_dim must be even"),
    ({"rms_norm_eps": -1.0}, r"rms_norm_eps must be a positive number"),
    ({"torch_dtype": "int4"}, r"torch_dtype 'int4' is not supported"),
    ({"eos_token_id": "2"}, r"eos_token_id must be an integer"),
    ({"architectures": ["GPT2LMHeadModel"]},
     r"unknown architecture 'GPT2LMHeadModel'; supported: Gemma2ForCausalLM, Gemma3ForCausalLM, "
     r"LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, "
     r"Qwen2ForCausalLM"),
])
def test_bad_field_is_named(overrides: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _parse(**overrides)


def test_architecture_falls_back_to_model_type_and_positions_to_the_family_default() -> None:
    assert _parse(architectures=[]).architecture == "LlamaForCausalLM"
    assert _parse(architectures=None, model_type="qwen2").architecture == "Qwen2ForCausalLM"
    with pytest.raises(ValueError, match="'architectures' is missing"):
        _parse(architectures=[], model_type="gpt2")
    raw = _config()
    del raw["max_position_embeddings"]
    assert ModelConfig.from_hf_dict(raw, "m").max_position_embeddings == 2048  # LlamaConfig's
    raw["architectures"] = ["Qwen2ForCausalLM"]
    assert ModelConfig.from_hf_dict(raw, "m").max_position_embeddings == 32768  # Qwen2Config's


def test_dtype_is_the_checkpoint_s_unless_given_and_with_dtype_replaces_it() -> None:
    config = _parse(torch_dtype="torch.bfloat16")
    assert (config.dtype, config.dtype_bytes) == ("bfloat16", 2)
    fp32 = config.with_dtype("fp32")
    assert (fp32.dtype, fp32.dtype_bytes, fp32.torch_dtype) == ("float32", 4, "torch.bfloat16")
    assert fp32.weight_bytes == 2 * config.weight_bytes == 4 * config.num_params
    assert fp32.kv_bytes_per_token == 2 * config.kv_bytes_per_token == 2 * 2 * 4 * 16 * 4
    assert fp32 != config and fp32.with_dtype("bfloat16") == config
    assert hash(fp32.with_dtype("bf16")) == hash(config)  # hashable despite the rope dict
    with pytest.raises(ValueError, match="dtype 'float64' is not supported"):
        config.with_dtype("float64")


def test_from_dir_reads_a_directory_or_its_config_file(tmp_path: Path) -> None:
    model_dir = tmp_path / "My-Model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(_config()))
    assert ModelConfig.from_dir(model_dir) == ModelConfig.from_dir(model_dir / "config.json")
    assert ModelConfig.from_dir(model_dir).name == "My-Model"


def test_read_hf_config_accepts_a_file_or_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config()))
    assert read_hf_config(tmp_path) == read_hf_config(tmp_path / "config.json") == _config()
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path / "absent")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("path", BUNDLED, ids=[p.stem for p in BUNDLED])
def test_engine_and_simulator_read_bundled_configs_as_one(path: Path) -> None:
    """The simulator's ``load_model_spec`` is the engine's ``ModelConfig.from_dir``."""
    spec, engine = load_model_spec(path.stem), ModelConfig.from_dir(path)
    assert spec == engine
    assert spec.num_params == spec.arch.num_params(spec)
    assert load_model_spec(path.stem, dtype_bytes=4) == engine.with_dtype("float32")
