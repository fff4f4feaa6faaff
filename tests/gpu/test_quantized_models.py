"""Quantized models end to end against their dequantized fp32 twins: the same weights after
dequantization, computed once from the blocks (the quantized kernels) and once from the fp32
directory (the dense path).

Measure: greedy tokens equal over every prompt, and the log-probabilities of the chosen tokens
within 2e-3 (fp32 accumulation in another order moves a logit by ~1e-5 here; a flip needs a near
tie, which the random weights' wide logit gaps make unlikely)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from quant_helpers import assert_close_runs
from safetensors.torch import load_file, save_file

from twinserve import LLM, SamplingParams
from twinserve.gpu.quantization.awq import dequantize_awq, quantize_awq
from twinserve.gpu.quantization.cpu_kernel import kernel_available
from twinserve.gpu.quantization.fp8 import quantize_fp8
from twinserve.gpu.quantization.gptq import dequantize_gptq, quantize_gptq
from twinserve.gpu.quantization.int8 import quantize_int8
from twinserve.gpu.quantization.quant_tensor import reference_dequantize

pytestmark = pytest.mark.skipif(not kernel_available(),
                                reason="the C++ quantized kernel cannot be built (no g++?)")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7], [11, 3, 99, 42, 8, 120, 17], [200] * 12, [1, 2]]


def _build(path: Path, arch: str) -> Path:
    import transformers
    common = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = (transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)) if arch == "llama"
             else transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quant_base")
    return {arch: _build(root / arch, arch) for arch in ("llama", "qwen2")}  # qwen2: qkv bias


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def _write(src: Path, dst: Path, tensors: dict[str, torch.Tensor],
           quantization_config: dict | None = None) -> Path:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _pair(src: Path, method: str, root: Path) -> tuple[Path, Path, str | None]:
    """(quantized dir, its dequantized fp32 twin, quantization= to pass)."""
    tensors = load_file(str(src / "model.safetensors"))
    if method in ("int8", "fp8"):  # the twin re-quantizes to the very same blocks
        quantize = quantize_int8 if method == "int8" else quantize_fp8
        twin = {k: reference_dequantize(quantize(v)) if _is_projection(k) else v
                for k, v in tensors.items()}
        path = _write(src, root / f"{method}-twin", twin)
        return path, path, method
    pack, unpack = ((quantize_gptq, dequantize_gptq) if method == "gptq"
                    else (quantize_awq, dequantize_awq))
    packed, twin = {}, {}
    for name, value in tensors.items():
        if not _is_projection(name):
            packed[name] = twin[name] = value
            continue
        parts = pack(value, 128)
        prefix = name.removesuffix(".weight")
        packed.update({f"{prefix}.{k}": v for k, v in parts.items()})
        twin[name] = unpack(parts, 128)
    config = ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
               "sym": True} if method == "gptq" else
              {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
               "version": "gemm"})
    return (_write(src, root / method, packed, config), _write(src, root / f"{method}-twin", twin),
            None)


def _greedy(model: str, quantization: str | None, **kwargs) -> list:
    kwargs.setdefault("dtype", "float32")  # auto: bf16 on a CPU with native bf16
    llm = LLM(model, quantization=quantization, max_num_seqs=8, max_num_batched_tokens=256,
              kv_cache_memory_bytes=16 << 20, max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("method, arch", [("int8", "llama"), ("fp8", "qwen2"), ("gptq", "llama"),
                                          ("awq", "qwen2")])
def test_quantized_checkpoint_matches_its_dequantized_twin(base_dirs, tmp_path: Path,
                                                           method: str, arch: str) -> None:
    quantized, twin, quantization = _pair(base_dirs[arch], method, tmp_path)
    runs = _greedy(str(quantized), quantization)
    assert_close_runs(runs, _greedy(str(twin), None))
    if method in ("int8", "fp8"):  # and quantizing changed the original model's weights
        original = _greedy(str(base_dirs[arch]), None)
        assert any(r.logprobs != o.logprobs for r, o in zip(runs, original))


def test_quantized_weights_are_smaller(base_dirs, tmp_path: Path) -> None:
    from twinserve.gpu.models.model_loader import load_model
    from twinserve.gpu.quantization.quant_linear import quantized_weight_bytes
    cpu = torch.device("cpu")
    dense = load_model(base_dirs["llama"], torch.float32, cpu, 64)
    proj = sum(p.numel() * 4 for n, p in dense.named_parameters() if n.endswith("proj.weight"))
    gptq_dir, _, _ = _pair(base_dirs["llama"], "gptq", tmp_path)
    sizes = {m: quantized_weight_bytes(load_model(d, torch.float32, cpu, 64, quantization=m))
             for m, d in (("int8", base_dirs["llama"]), ("gptq", gptq_dir))}
    assert proj / 4 < sizes["int8"] < proj / 4 * 1.04  # 1 byte + a scale per row, against 4
    assert proj / 8 < sizes["gptq"] < proj / 6.5  # 0.5 byte + 8 bytes per 128 (fp32 d, m)


def test_quantization_refusals(base_dirs, tmp_path: Path) -> None:
    plain = str(base_dirs["llama"])
    with pytest.raises(ValueError, match="supported: gguf, int8, fp8, gptq, awq"):
        LLM(plain, quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization='gguf' needs a .gguf model file"):
        LLM(plain, quantization="gguf")
    gptq_dir, _, _ = _pair(base_dirs["llama"], "gptq", tmp_path)
    with pytest.raises(ValueError, match="does not match the model, which is 'gptq'"):
        LLM(str(gptq_dir), quantization="awq")
    config = json.loads((gptq_dir / "config.json").read_text())
    for key, value, match in [("desc_act", True, "act-order"), ("bits", 8, "4-bit GPTQ only"),
                              ("group_size", 100, "group_size=100 is not supported")]:
        bad = json.loads(json.dumps(config))
        bad["quantization_config"][key] = value
        (gptq_dir / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            LLM(str(gptq_dir), kv_cache_memory_bytes=16 << 20, max_model_len=64)
    bad = json.loads(json.dumps(config))
    bad["quantization_config"]["quant_method"] = "bitsandbytes"
    (gptq_dir / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        LLM(str(gptq_dir))


def test_a_model_quantized_at_load_time_runs_in_bfloat16(base_dirs) -> None:
    # quantized from its float32 weights, then cast: the RoPE tables follow the cast, so the keys
    # reach the bf16 KV cache in bf16 (they were float32, and the cache write refused them)
    llm = LLM(str(base_dirs["llama"]), quantization="int8", dtype="bfloat16", max_model_len=128,
              kv_cache_memory_bytes=16 << 20)
    assert {r.cos.dtype for r in llm.engine.runner.model.ropes} == {torch.bfloat16}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [len(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)] \
        == [8] * len(PROMPTS)
