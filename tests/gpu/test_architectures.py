"""The architecture registry, the linear layers' weight loaders, and each family against HF
transformers: the same parameter count as HF's random-weight model, the same tensors loaded, the
same greedy tokens in fp32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy

from twinserve.core.architectures import (
    DenseDecoder,
    get_architecture,
    register,
    supported_architectures,
)
from twinserve.core.engine_args import EngineArgs
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.kernels.cpu_gemm import Gemm
from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.layers.linear import (
    LinearOptions,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from twinserve.gpu.models.model import CausalLM
from twinserve.gpu.models.model_loader import load_model
from twinserve.gpu.worker.model_runner import ModelRunner
from twinserve.simulator.cost_model import CostModel
from twinserve.simulator.hardware import load_hardware

CPU = torch.device("cpu")
COMMON: dict[str, Any] = dict(vocab_size=160, hidden_size=64, intermediate_size=96,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1,
                              eos_token_id=2)
# name -> (HF config class, overrides): every family, tied and untied, with and without biases
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "llama": (transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama-biases": (transformers.LlamaConfig, {"attention_bias": True, "mlp_bias": True,
                                                "tie_word_embeddings": False}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None, "head_dim": 32}),
    "qwen2": (transformers.Qwen2Config, {"tie_word_embeddings": False}),
    # head_dim 32 != hidden / heads = 16; tied and untied
    "qwen3": (transformers.Qwen3Config, {"head_dim": 32, "tie_word_embeddings": False}),
    "qwen3-tied": (transformers.Qwen3Config, {"head_dim": 32, "tie_word_embeddings": True}),
}


def _hf_model(name: str) -> transformers.PreTrainedModel:
    config_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**COMMON, **overrides}))
    with torch.no_grad():  # larger than the 0.02 init so that greedy choices are well separated
        for param_name, p in model.named_parameters():
            if "norm" not in param_name:
                p.normal_(0.0, 0.2)
            elif "q_norm" in param_name or "k_norm" in param_name:  # q's and k's told apart
                p.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for name in FAMILIES:
        _hf_model(name).save_pretrained(root / name, safe_serialization=True)
        dirs[name] = root / name
    return dirs


# --- the registry -------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "family"), [("LlamaForCausalLM", "Llama"),
                                              ("MistralForCausalLM", "Mistral"),
                                              ("Qwen2ForCausalLM", "Qwen2"),
                                              ("Qwen3ForCausalLM", "Qwen3")])
def test_each_family_resolves(name: str, family: str) -> None:
    entry = get_architecture(name)
    assert type(entry).__name__ == family and name in entry.names
    assert get_architecture(name) is entry  # one stateless entry per family


def test_unknown_architecture_is_refused_with_the_supported_list() -> None:
    assert supported_architectures() == (
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM",
        "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match=r"unknown architecture 'GPT2LMHeadModel'; supported: "
                                         r"Gemma2ForCausalLM, Gemma3ForCausalLM, "
                                         r"LlamaForCausalLM, MistralForCausalLM, "):
        get_architecture("GPT2LMHeadModel")


def test_registering_a_served_name_twice_or_no_name_is_refused() -> None:
    class Twice(DenseDecoder):
        names = ("LlamaForCausalLM",)
        model_type = "llama"

    class Nameless(DenseDecoder):
        pass

    with pytest.raises(ValueError, match="registered twice"):
        register(Twice)
    with pytest.raises(ValueError, match="must set names"):
        register(Nameless)
    assert type(get_architecture("LlamaForCausalLM")).__name__ == "Llama"


# --- sizes agree with HF and with the loaded engine -----------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_weight_map_and_num_params_equal_the_hf_model(name: str) -> None:
    hf = _hf_model(name)
    config = ModelConfig.from_hf_dict(hf.config.to_dict(), name)
    hf_params = dict(hf.named_parameters())  # tied weights once
    weight_map = config.arch.weight_map(config)
    assert set(weight_map) == set(hf_params)
    assert {n: t.shape for n, t in weight_map.items()} == {n: tuple(p.shape)
                                                           for n, p in hf_params.items()}
    assert config.num_params == sum(p.numel() for p in hf_params.values())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_engine_loads_every_tensor_and_the_twin_counts_the_same_bytes(
        name: str, family_dirs: dict[str, Path]) -> None:
    model = load_model(family_dirs[name], torch.float32, CPU, 64)
    config = model.config
    loaded = sum(p.numel() for p in model.parameters())
    assert loaded == config.num_params
    cost = CostModel(config.with_dtype("float32"), load_hardware("cpu"))
    assert cost.weight_bytes_per_gpu == sum(p.numel() * p.element_size()
                                            for p in model.parameters())
    assert cost.kv_bytes_per_token_per_gpu == (2 * config.num_hidden_layers
                                               * config.kv_size * 4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_parameters_hold_the_hf_tensors(name: str, family_dirs: dict[str, Path]) -> None:
    hf = _hf_model(name)
    model = load_model(family_dirs[name], torch.float32, CPU, 64)
    layer, hf_layer = model.layers[1], hf.model.layers[1]
    attn, mlp = hf_layer.self_attn, hf_layer.mlp
    torch.testing.assert_close(layer.qkv_proj.weight, torch.cat(
        [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), rtol=0, atol=0)
    torch.testing.assert_close(layer.gate_up_proj.weight, torch.cat(
        [mlp.gate_proj.weight, mlp.up_proj.weight]), rtol=0, atol=0)
    torch.testing.assert_close(layer.down_proj.weight, mlp.down_proj.weight, rtol=0, atol=0)
    if attn.q_proj.bias is not None:
        torch.testing.assert_close(layer.qkv_proj.bias, torch.cat(
            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]), rtol=0, atol=0)
    assert (layer.o_proj.bias is None) == (attn.o_proj.bias is None)
    assert (layer.q_norm is None) == (not hasattr(attn, "q_norm"))
    if layer.q_norm is not None:
        torch.testing.assert_close(layer.q_norm, attn.q_norm.weight, rtol=0, atol=0)
        torch.testing.assert_close(layer.k_norm, attn.k_norm.weight, rtol=0, atol=0)
    assert (layer.down_proj.bias is None) == (mlp.down_proj.bias is None)


# --- greedy tokens equal HF transformers (fp32) -------------------------------------------------

def _greedy(model: CausalLM, prompt: list[int], new_tokens: int) -> list[int]:
    """A prefill then one-token decodes over a paged cache of 16-token blocks."""
    config, block = model.config, 16
    blocks = -(-(len(prompt) + new_tokens) // block)
    shape = (blocks, block, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    tables = torch.arange(blocks, dtype=torch.int32)[None, :]
    tokens, start, chunk = [], 0, list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            n, end = len(chunk), start + len(chunk)
            meta = AttentionMetadata(slot_mapping=torch.arange(start, end), block_tables=tables,
                                     seq_lens=torch.tensor([end], dtype=torch.int32),
                                     query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                                     max_query_len=n, max_seq_len=end)
            model.backend.prepare(meta, block)
            hidden = model(torch.tensor(chunk), torch.arange(start, end), caches, meta)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
            start, chunk = end, [tokens[-1]]
    return tokens


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_hf_fp32(name: str, family_dirs: dict[str, Path]) -> None:
    model = load_model(family_dirs[name], torch.float32, CPU, 64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (1, 7, 21)]
    got = [_greedy(model, p, 12) for p in prompts]
    assert got == hf_greedy(family_dirs[name], prompts, 12)


# --- the linear layers' weight loaders ----------------------------------------------------------

OPTIONS = LinearOptions(Gemm(slabs=True, widen_half=False), torch.float32)


def test_qkv_weight_loader_places_q_k_v_rows_and_biases() -> None:
    layer = QKVParallelLinear(8, 2, 4, 2, True, OPTIONS)  # q: 8 rows, k and v: 4 each
    assert layer.weight.shape == (16, 8) and layer.shard_offsets == {
        "q": (0, 8), "k": (8, 4), "v": (12, 4)}
    parts = {"q": torch.randn(8, 8), "k": torch.randn(4, 8), "v": torch.randn(4, 8)}
    biases = {"q": torch.randn(8), "k": torch.randn(4), "v": torch.randn(4)}
    for shard in ("v", "q", "k"):  # any order
        layer.weight_loader(layer.weight, parts[shard], shard)
        layer.weight_loader(layer.bias, biases[shard], shard)
    assert torch.equal(layer.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    assert torch.equal(layer.bias, torch.cat([biases["q"], biases["k"], biases["v"]]))
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.t() + layer.bias)
    with pytest.raises(ValueError, match="unknown shard 'o'"):
        layer.weight_loader(layer.weight, parts["k"], "o")
    with pytest.raises(ValueError, match=r"\(4, 8\) does not fit shard 'q' of shape \(8, 8\)"):
        layer.weight_loader(layer.weight, parts["k"], "q")


def test_merged_row_and_replicated_weight_loaders() -> None:
    merged = MergedColumnParallelLinear(8, [6, 6], False, OPTIONS)
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    merged.weight_loader(merged.weight, up, 1)
    merged.weight_loader(merged.weight, gate, 0)
    assert torch.equal(merged.weight, torch.cat([gate, up])) and merged.bias is None
    for cls in (RowParallelLinear, ReplicatedLinear):
        layer = cls(6, 8, True, OPTIONS)
        w, b = torch.randn(8, 6), torch.randn(8)
        layer.weight_loader(layer.weight, w)
        layer.weight_loader(layer.bias, b)
        assert torch.equal(layer.weight, w) and torch.equal(layer.bias, b)
        with pytest.raises(ValueError, match="has no shard 0"):
            layer.weight_loader(layer.weight, w, 0)
    x = torch.randn(9, 8)  # feature-major on CPU from 2 tokens on: still x @ W.T
    gate_up = merged.forward_feature_major(x)
    torch.testing.assert_close(gate_up, (x @ merged.weight.t()).t())


def test_a_tensor_parallel_rank_outside_the_group_is_refused() -> None:
    # (the sharded layers themselves: tests/gpu/test_tensor_parallel.py)
    for tp_size, tp_rank in ((2, 2), (1, 1), (2, -1)):
        options = LinearOptions(OPTIONS.gemm, torch.float32, tp_rank=tp_rank, tp_size=tp_size)
        with pytest.raises(ValueError, match="tp_rank must be in"):
            RowParallelLinear(8, 8, False, options)


# --- refusals at load time ----------------------------------------------------------------------

def _with_config(src: Path, dst: Path, **overrides: Any) -> Path:
    import json
    import shutil
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **overrides}))
    return dst


def test_a_sliding_window_model_loads_at_its_full_length(
        family_dirs: dict[str, Path], tmp_path: Path) -> None:
    windowed = _with_config(family_dirs["mistral"], tmp_path / "windowed", sliding_window=16)
    args = dict(dtype="float32", block_size=4, kv_cache_memory_bytes=1 << 22, swap_space=0.001)
    for max_model_len in (None, 128):  # no longer capped to the window
        runner = ModelRunner(EngineArgs(str(windowed), max_model_len=max_model_len, **args))
        assert (runner.max_model_len, runner.config.sliding_window) == (128, 16)
        assert [layer.window for layer in runner.model.layers] == [16, 16]


def test_an_unknown_rope_scaling_type_is_refused_at_load(family_dirs: dict[str, Path],
                                                        tmp_path: Path) -> None:
    mrope = _with_config(family_dirs["llama"], tmp_path / "mrope",
                         rope_scaling={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not implemented"):
        load_model(mrope, torch.float32, CPU, 64)
