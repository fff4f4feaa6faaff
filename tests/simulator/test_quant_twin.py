"""The twin under quantized deployments: the model spec's bytes per weight and per KV value
follow ``quantization`` / ``kv_cache_dtype`` (core/quantization.py), so a simulated H100 holds
more KV blocks (the weights take less memory; fp8 halves a bf16 block) and a batch-1 decode step,
which streams the weights, takes proportionally less time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.quantization import weight_bytes_per_param
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.run import EngineBuild, SimConfig, build_engine_config


def _decode(batch: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(total_num_scheduled_tokens=batch, num_decode_tokens=batch,
                           num_decode_seqs=batch, sum_context_tokens=batch * context,
                           sum_decode_context_tokens=batch * context)


def _twin(**engine: object) -> EngineBuild:
    return build_engine_config(SimConfig(model="llama-3-8b", hardware="h100-sxm", **engine))


def test_weight_bytes_per_format() -> None:
    spec = load_model_spec("llama-3-8b")  # bf16
    dense = spec.weight_bytes
    tables = 2 * spec.embedding_params  # untied
    for method, proj in [("int8", 1.0), ("fp8", 1.0), ("gptq", 0.5 + 2.5 / 128)]:
        q = spec.with_quantization(method, "auto")
        expected = (spec.num_params - tables) * proj + tables * 2
        assert q.weight_bytes == pytest.approx(expected, rel=1e-9)
        assert q.weight_bytes < dense
    assert weight_bytes_per_param("gguf", 2) == (20 / 32, 34 / 32)
    assert spec.with_quantization(None, "fp8").kv_bytes_per_token * 2 == spec.kv_bytes_per_token
    with pytest.raises(ValueError, match="supported: gguf, int8, fp8, gptq, awq"):
        spec.with_quantization("nf4", "auto")


def test_the_twin_predicts_more_blocks_and_faster_weight_bound_steps() -> None:
    base, int8 = _twin(), _twin(quantization="int8")
    fp8kv, both = _twin(kv_cache_dtype="fp8"), _twin(quantization="awq", kv_cache_dtype="fp8")
    blocks = {name: b.engine_config.scheduler.num_gpu_blocks for name, b in
              [("base", base), ("int8", int8), ("fp8kv", fp8kv), ("both", both)]}
    assert blocks["int8"] > blocks["base"]  # ~7.5 GB of weights freed for KV
    assert blocks["fp8kv"] == pytest.approx(2 * blocks["base"], abs=1)
    assert blocks["both"] > 2 * blocks["int8"]
    assert fp8kv.engine_config.block_bytes * 2 == base.engine_config.block_bytes
    step = _decode(1, 512)
    ratio = int8.cost_model.step_time(step) / base.cost_model.step_time(step)
    assert 0.5 < ratio < 0.62  # batch 1 streams the weights: ~half the bytes (+ fixed costs)
    assert both.cost_model.step_time(step) < int8.cost_model.step_time(step)
    assert int8.model.quantization == "int8"


def test_simulate_cli_takes_the_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from twinserve.entrypoints.cli.main import main
    runs = {}
    for name, flags in [("base", []), ("quant", ["--quantization", "int8",
                                                 "--kv-cache-dtype", "fp8"])]:
        out = tmp_path / name
        assert main(["simulate", "--model", "llama-3-8b", "--hardware", "h100-sxm",
                     "--num-requests", "20", "--out", str(out), "--disable-tqdm", *flags]) == 0
        runs[name] = json.loads((out / "config.json").read_text())
    capsys.readouterr()
    assert runs["quant"]["num_gpu_blocks"] > 2 * runs["base"]["num_gpu_blocks"]
    assert runs["quant"]["quantization"] == "int8" and runs["quant"]["kv_cache_dtype"] == "fp8"
