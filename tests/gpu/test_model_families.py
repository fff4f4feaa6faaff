"""The families beyond the dense Llama layout -- Mistral with its sliding window, Gemma 2 and 3,
Phi-3 (with longrope), Mixtral, Qwen2-MoE and Qwen3-MoE -- against HF transformers on tiny
random-weight models built with transformers' config classes: the checkpoint's tensors are exactly
the weight map (names, shapes, and their sum is the twin's parameter count), the engine loads every
one, and greedy tokens in fp32 equal HF's. Then the same through the whole engine (``LLM``) with
prefix caching, chunked prefill and preemption, where the window frees blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import hf_greedy
from safetensors import safe_open
from test_architectures import COMMON, _greedy

from twinserve.core.model_config import ModelConfig
from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.models.model import CausalLM
from twinserve.gpu.models.model_loader import load_model
from twinserve.simulator.cost_model import CostModel
from twinserve.simulator.hardware import load_hardware

CPU = torch.device("cpu")
PAD = {"pad_token_id": 0}
GEMMA = {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24, **PAD}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.2 * i for i in range(8)], "rope_theta": 10000.0}
# name -> (HF config class, overrides)
FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "mistral-window": (transformers.MistralConfig, {"sliding_window": 8}),
    # Qwen2's window on the layers from max_window_layers on (layer 1 of 2)
    "qwen2-window": (transformers.Qwen2Config, {"use_sliding_window": True, "sliding_window": 8,
                                                "max_window_layers": 1}),
    "gemma2": (transformers.Gemma2Config, {**GEMMA, "attn_logit_softcapping": 0.3,
                                           "final_logit_softcapping": 3.0}),
    "gemma3": (transformers.Gemma3TextConfig, {
        **GEMMA, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                               "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": (transformers.Phi3Config, {**PAD, "tie_word_embeddings": False}),
    "phi3-longrope": (transformers.Phi3Config, {
        **PAD, "head_dim": 16, "max_position_embeddings": 128,
        "original_max_position_embeddings": 64, "rope_parameters": LONGROPE}),
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": (transformers.Qwen2MoeConfig, {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "norm_topk_prob": False}),
    "qwen3-moe": (transformers.Qwen3MoeConfig, {
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "norm_topk_prob": True, "head_dim": 32}),
}


def hf_model(name: str) -> transformers.PreTrainedModel:
    config_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**{**COMMON, **overrides}))
    with torch.no_grad():  # larger than the init so that greedy choices are well separated
        for param_name, p in model.named_parameters():
            if "norm" not in param_name:
                p.normal_(0.0, 0.2)
            else:  # Gemma's (1 + w) norms start at w = 0; Qwen3's q/k norms told apart
                p.normal_(0.0 if "gemma" in name else 1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("more_families")
    dirs = {}
    for name in FAMILIES:
        hf_model(name).save_pretrained(root / name, safe_serialization=True)
        dirs[name] = root / name
    return dirs


def _checkpoint_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_weight_map_is_the_checkpoint_and_the_twin_counts_its_tensors(
        name: str, family_dirs: dict[str, Path]) -> None:
    config = ModelConfig.from_dir(family_dirs[name])
    shapes = _checkpoint_shapes(family_dirs[name])
    weight_map = config.arch.weight_map(config)
    assert {n: t.shape for n, t in weight_map.items()} == shapes
    total = sum(torch.Size(s).numel() for s in shapes.values())
    assert config.num_params == total
    cost = CostModel(config.with_dtype("float32"), load_hardware("cpu"))
    assert cost.weight_bytes_per_gpu == 4 * total
    model = load_model(family_dirs[name], torch.float32, CPU, 64)
    assert sum(p.numel() for p in model.parameters()) == total


def test_configs_read_their_family_fields(family_dirs: dict[str, Path]) -> None:
    gemma2 = ModelConfig.from_dir(family_dirs["gemma2"])
    assert (gemma2.hidden_act, gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping,
            gemma2.query_pre_attn_scalar) == ("gelu_tanh", 0.3, 3.0, 24)
    assert [gemma2.layer_window(i) for i in range(2)] == [8, None]
    assert gemma2.kv_sliding_window is None  # a global layer keeps every block
    gemma3 = ModelConfig.from_dir(family_dirs["gemma3"])
    assert gemma3.layer_rope(0) == (1e4, None)
    assert gemma3.layer_rope(1) == (1e6, {"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_dir(family_dirs["mistral-window"]).kv_sliding_window == 8
    moe = ModelConfig.from_dir(family_dirs["qwen2-moe"]).moe
    assert moe is not None and (moe.num_experts, moe.num_experts_per_tok,
                                moe.shared_expert_intermediate_size) == (4, 2, 48)
    phi = ModelConfig.from_dir(family_dirs["phi3-longrope"])
    assert phi.rope_scaling is not None and phi.rope_scaling["rope_type"] == "longrope"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_tokens_equal_hf_fp32(name: str, family_dirs: dict[str, Path]) -> None:
    model = load_model(family_dirs[name], torch.float32, CPU, 64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (1, 7, 21)]
    got = [_greedy(model, p, 12) for p in prompts]
    assert got == hf_greedy(family_dirs[name], prompts, 12)


def _prefill_logits(model: CausalLM, prompt: list[int]) -> torch.Tensor:
    config, n, block = model.config, len(prompt), 16
    blocks = -(-n // block)
    shape = (blocks, block, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(slot_mapping=torch.arange(n),
                             block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             max_query_len=n, max_seq_len=n)
    model.backend.prepare(meta, block)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_logits_equal_hf_fp32(name: str, family_dirs: dict[str, Path]) -> None:
    """Every position's logits (the window, the capping, the experts' weights show here even
    where they leave the argmax alone)."""
    model = load_model(family_dirs[name], torch.float32, CPU, 64)
    prompt = torch.randint(3, 160, (29,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = hf_model(name)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(_prefill_logits(model, prompt), ref, rtol=1e-4, atol=1e-4)


def test_phi3_fused_tensors_are_split_into_the_engine_shards(
        family_dirs: dict[str, Path]) -> None:
    hf = hf_model("phi3")
    model = load_model(family_dirs["phi3"], torch.float32, CPU, 64)
    layer, hf_layer = model.layers[1], hf.model.layers[1]
    assert torch.equal(layer.qkv_proj.weight, hf_layer.self_attn.qkv_proj.weight)
    assert torch.equal(layer.gate_up_proj.weight, hf_layer.mlp.gate_up_proj.weight)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"architectures": ["Gemma3ForConditionalGeneration"]},
     "unknown architecture 'Gemma3ForConditionalGeneration'"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not implemented"),
    ({"hidden_act": "relu"}, "hidden_act 'relu' is not implemented"),
    ({"rope_scaling": {"rope_type": "mrope", "factor": 2.0}},
     "rope_scaling type 'mrope' is not implemented"),
])
def test_what_is_not_implemented_is_refused_by_name(family_dirs: dict[str, Path],
                                                    overrides: dict, match: str) -> None:
    raw = json.loads((family_dirs["phi3"] / "config.json").read_text())
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_dict({**raw, **overrides}, "m")


def test_moe_layers_without_experts_are_refused(family_dirs: dict[str, Path]) -> None:
    raw = json.loads((family_dirs["qwen2-moe"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"dense MLP layers among the expert layers"):
        ModelConfig.from_hf_dict({**raw, "mlp_only_layers": [1]}, "m")
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds the 4 experts"):
        ModelConfig.from_hf_dict({**raw, "num_experts_per_tok": 9}, "m")


# --- through the whole engine: prefix caching, chunked prefill, preemption ------------------------

E2E_TOKENS = 16
E2E_REGIMES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "chunks-of-16": dict(max_num_batched_tokens=16),
    "recompute-preemption": dict(num_gpu_blocks_override=24),
    "swap-preemption": dict(num_gpu_blocks_override=24, preemption_mode="swap"),
}
# the windowed model holds few blocks: a smaller cache (10, with 16-token chunks) preempts it,
# though its longest request alone would need 17 blocks without the window
WINDOW_PRESSURE = dict(num_gpu_blocks_override=10, max_num_batched_tokens=16)
# Gemma 2's hybrid cache: its longest request holds 17 full blocks and, with 16-token chunks,
# 7 in its sliding group (a whole-prompt chunk would hold 17 there too: more than 24 blocks)
HYBRID_PRESSURE = dict(num_gpu_blocks_override=28, max_num_batched_tokens=16)


def _e2e_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 160, (24,), generator=g).tolist()
    own = [torch.randint(3, 160, (n,), generator=g).tolist() for n in (5, 40, 13, 29, 3, 50)]
    return own[:3] + [shared + own[3][:6], shared + own[4]] + own[3:]


def _run_engine(model_dir: Path, regime: dict[str, Any]
                ) -> tuple[list[list[int]], int, Any, int]:
    """Greedy tokens of every prompt, the most blocks a request held at once (in group 0), the
    engine, and the most blocks a request's sliding group freed (hybrid layouts; else 0)."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.gpu.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", block_size=4,
                                  kv_cache_memory_bytes=1 << 22, swap_space=0.01, **regime))
    params = SamplingParams(temperature=0.0, max_tokens=E2E_TOKENS, ignore_eos=True)
    prompts = _e2e_prompts()
    ids = [engine.add_request(p, params) for p in prompts[:4]]  # one with the shared prefix
    tokens: dict[str, list[int]] = {}
    peak = steps = dropped = 0
    while engine.has_unfinished_requests() or len(ids) < len(prompts):
        if steps == 3:  # the rest later: the shared prefix is in the cache by then
            ids += [engine.add_request(p, params) for p in prompts[4:]]
        steps += 1
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        kv = engine.scheduler.kv
        peak = max([peak, *(len(t.blocks) - t.num_dropped for t in kv.tables.values())])
        for group in getattr(kv, "sliding_groups", ()):
            dropped = max([dropped, *(t.num_dropped for t in group.tables.values())])
    return [tokens[i] for i in ids], peak, engine, dropped


@pytest.mark.slow
@pytest.mark.parametrize("regime", list(E2E_REGIMES))
@pytest.mark.parametrize("name", ["mistral-window", "gemma2", "qwen3-moe"])
def test_the_engine_gives_hf_greedy_tokens_in_every_regime(
        name: str, regime: str, family_dirs: dict[str, Path]) -> None:
    settings = E2E_REGIMES[regime]
    if name == "mistral-window" and "preemption" in regime:
        settings = {**settings, **WINDOW_PRESSURE}
    if name == "gemma2" and "preemption" in regime:
        settings = {**settings, **HYBRID_PRESSURE}
    got, peak, engine, dropped = _run_engine(family_dirs[name], settings)
    assert got == hf_greedy(family_dirs[name], _e2e_prompts(), E2E_TOKENS)
    kv = engine.scheduler.kv
    reserved = 0 if kv.null_block is None else 1
    assert kv.pool.num_free == kv.pool.num_blocks - reserved and not kv.tables
    if "preemption" not in regime:  # (a cache under pressure may evict the shared prefix)
        assert kv.prefix_hits > 0
    else:
        assert engine.scheduler.num_preemptions > 0
    # the longest request's blocks without a window, seen the step before it finishes
    longest = -(-(50 + E2E_TOKENS - 2) // 4)
    if name == "mistral-window":  # window 8, blocks of 4: the window's blocks and a chunk's
        chunked = regime != "defaults"
        assert kv.sliding_window == 8 and peak <= (7 if chunked else longest)
    else:  # the full group (Gemma 2's, group 0: kv.tables) or no window: every block is kept
        assert kv.sliding_window is None and peak == longest
        if name == "gemma2":  # the sliding group freed what its window left behind
            assert kv.num_groups == 2 and dropped >= 10  # the 50-token prompt decodes past 48
