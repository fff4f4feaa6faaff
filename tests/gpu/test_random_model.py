"""benchmarks/random_model.py writes directories the engine loads (used for GPU benchmarks)."""

from __future__ import annotations

import json

import pytest

from twinserve.benchmarks.random_model import write_random_model
from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.llm_engine import LLMEngine


def _generate(model_dir, n: int = 4) -> list[int]:
    engine = LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", kv_cache_memory_bytes=1 << 24))
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    engine.add_request([5, 6, 7, 8, 9], params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens


def test_bundled_shape_with_fewer_layers_loads_and_generates(tmp_path):
    path = write_random_model(tmp_path / "smol", "smollm2-135m", "bfloat16", num_layers=2)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["torch_dtype"] == "bfloat16"
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) == 3  # embeddings + one shard per layer
    assert len(_generate(path)) == 4
    mtime = (path / "model-00001-of-00003.safetensors").stat().st_mtime_ns
    write_random_model(tmp_path / "smol", "smollm2-135m", "bfloat16", num_layers=2)
    assert (path / "model-00001-of-00003.safetensors").stat().st_mtime_ns == mtime  # reused


def test_qwen2_config_gets_qkv_biases(tmp_path, tiny_model_dirs):
    path = write_random_model(tmp_path / "qwen", str(tiny_model_dirs["qwen2-untied"] / "config.json"),
                              "float32")
    names = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.self_attn.k_proj.bias" in names and "lm_head.weight" in names
    assert len(_generate(path)) == 4


def test_unknown_config_names_the_bundled_ones(tmp_path):
    with pytest.raises(ValueError, match="llama-3-8b"):
        write_random_model(tmp_path / "x", "gpt-5")
