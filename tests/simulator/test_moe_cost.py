"""The twin's mixture-of-experts and sliding-window terms (simulator/moe_cost.py): experts touched
per step grow with the batch as E * (1 - (1 - k/E)^T), only those experts' weights are streamed and
only k experts' FLOPs computed per token; a window bounds the KV a step reads; the bundled model
specs at their public sizes."""

from __future__ import annotations

import dataclasses

import pytest

from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.cost_model import CostModel
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.moe_cost import expected_experts_touched

H100 = load_hardware("h100-sxm")


def _decodes(n: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(total_num_scheduled_tokens=n, num_decode_tokens=n, num_decode_seqs=n,
                           sum_context_tokens=n * context, sum_decode_context_tokens=n * context,
                           max_decode_context=context)


def test_experts_touched_grow_with_the_batch_to_all_of_them() -> None:
    assert expected_experts_touched(128, 8, 0) == 0.0
    assert expected_experts_touched(128, 8, 1) == pytest.approx(8.0)
    assert expected_experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75 ** 2))
    touched = [expected_experts_touched(128, 8, t) for t in (1, 4, 16, 64, 256)]
    assert touched == sorted(touched) and touched[-1] == pytest.approx(128, rel=1e-6)


@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    ("qwen3-30b-a3b", 30.5, 3.3), ("mixtral-8x7b", 46.7, 12.9)])
def test_bundled_moe_specs_have_their_public_sizes(name: str, total_b: float,
                                                   active_b: float) -> None:
    spec = load_model_spec(name)
    assert spec.num_params / 1e9 == pytest.approx(total_b, rel=0.01)
    moe = spec.moe
    active = (spec.num_params - spec.num_hidden_layers * spec.arch.expert_params(spec)
              * (moe.num_experts - moe.num_experts_per_tok))
    assert active / 1e9 == pytest.approx(active_b, rel=0.03)


def test_an_moe_step_reads_the_experts_it_touches_and_computes_k_of_them() -> None:
    spec = load_model_spec("qwen3-30b-a3b")
    cost = CostModel(spec, H100)
    arch, moe = spec.arch, spec.moe
    expert_bytes = spec.num_hidden_layers * arch.expert_params(spec) * spec.dtype_bytes
    one, many = cost.breakdown(_decodes(1, 100)), cost.breakdown(_decodes(256, 100))
    kv = cost.kv_bytes_per_token_per_gpu
    weights_one = one.nbytes - kv * 101
    weights_many = many.nbytes - kv * 256 * 101
    full = arch.streamed_params(spec) * spec.dtype_bytes  # every layer and the LM head
    assert weights_one == pytest.approx(full - (moe.num_experts - 8) * expert_bytes, rel=1e-9)
    assert weights_many == pytest.approx(full, rel=1e-3)  # a big batch touches every expert
    # FLOPs per token count k experts, not E: the 3.35B active parameters but the embedding and
    # the LM head (0.31B each; the head is charged per sampled sequence), not 30.5B
    assert arch.linear_flops_per_token(spec) / 2 / 1e9 == pytest.approx(2.73, rel=0.01)
    assert one.total_s < many.total_s
    assert cost.step_time(_decodes(1, 100)) == one.total_s


def test_a_sparse_model_decodes_faster_than_the_dense_one_of_its_total_size() -> None:
    moe = CostModel(load_model_spec("qwen3-30b-a3b"), H100)
    dense = CostModel(load_model_spec("llama-3.1-8b"), H100)
    # batch 1: Qwen3-30B-A3B reads ~3.3B parameters, Llama-3.1-8B all 8B
    assert moe.step_time(_decodes(1, 512)) < dense.step_time(_decodes(1, 512))


def test_a_window_bounds_the_kv_a_decode_reads() -> None:
    mistral = load_model_spec("mistral-7b-v0.1")  # every layer: window 4096
    cost = CostModel(mistral, H100)
    at_window = cost.breakdown(_decodes(8, 4096)).nbytes
    assert cost.breakdown(_decodes(8, 30000)).nbytes == pytest.approx(at_window, rel=1e-3)
    full = CostModel(dataclasses.replace(mistral, sliding_window=None), H100)
    assert full.breakdown(_decodes(8, 30000)).nbytes > 1.5 * at_window


def test_gemma3_global_layers_still_read_the_whole_context() -> None:
    gemma = load_model_spec("gemma-3-27b")  # 1 global layer in 6, window 1024
    assert gemma.kv_sliding_window is None  # the global layers keep every block
    cost = CostModel(gemma, H100)
    kv = cost.kv_bytes_per_token_per_gpu
    read = cost.breakdown(_decodes(1, 60000)).nbytes - cost.breakdown(_decodes(1, 1)).nbytes
    globals_share = sum(gemma.layer_window(i) is None for i in range(62)) / 62
    expected = kv * (globals_share * 60000 + (1 - globals_share) * 1024)
    assert read == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("name", ["qwen3-8b-128k", "qwen3-30b-a3b-128k", "llama-3.1-8b",
                                  "gemma-3-27b"])
def test_long_context_specs_serve_128k(name: str) -> None:
    spec = load_model_spec(name)
    assert spec.max_position_embeddings == 131072
    if name.startswith("qwen3"):  # YaRN over the 32K the model was trained at
        assert spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "yarn"
        assert spec.num_params == load_model_spec(name.removesuffix("-128k")).num_params
