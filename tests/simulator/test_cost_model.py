"""Model specs, hardware profiles, the roofline step time and the fitted (calibrated) step time."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.cost_model import (
    ALL_FEATURE_NAMES,
    TOKEN_KNOTS,
    TOKEN_SEGMENTS,
    CostModel,
    FittedCostModel,
    decode_context_tokens,
    fit_step_time,
    make_cost_model,
    nnls,
    step_features,
    token_segments,
)
from twinserve.simulator.hardware import (
    FittedParams,
    HardwareProfile,
    bundled_hardware_names,
    load_hardware,
)
from twinserve.simulator.model_spec import bundled_model_names, load_model_spec

MODELS_DIR = Path(__file__).resolve().parents[2] / "simulator" / "data" / "models"


def decode_step(batch: int, context: int) -> SchedulerOutput:
    """``batch`` decodes, each attending to ``context`` positions."""
    return SchedulerOutput(total_num_scheduled_tokens=batch, num_decode_tokens=batch, num_decode_seqs=batch,
                           sum_context_tokens=batch * context,
                           sum_decode_context_tokens=batch * context)


def prefill_step(tokens: int, cached: int = 0, chunks: int = 1) -> SchedulerOutput:
    """``chunks`` prompt chunks of ``tokens`` each after ``cached`` computed tokens (as the scheduler sums)."""
    ctx = chunks * (tokens * cached + tokens * (tokens + 1) // 2)
    return SchedulerOutput(total_num_scheduled_tokens=tokens * chunks, num_prefill_tokens=tokens * chunks,
                           num_prefill_seqs=chunks, sum_context_tokens=ctx)


def cost(model: str, hardware: str, tp: int = 1) -> CostModel:
    return CostModel(load_model_spec(model), load_hardware(hardware), tp)


# --- model specs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, published", [
    ("llama-2-7b", 6.74e9), ("llama-2-13b", 13.0e9), ("llama-2-70b", 68.98e9), ("llama-3-8b", 8.03e9),
    ("llama-3-70b", 70.6e9), ("mistral-7b-v0.1", 7.24e9), ("qwen2.5-7b", 7.62e9), ("smollm2-135m", 1.35e8),
    ("llama-3.1-8b", 8.03e9), ("llama-3.1-70b", 70.6e9), ("qwen3-8b", 8.19e9),
])
def test_bundled_param_counts_match_published_sizes(name: str, published: float) -> None:
    assert load_model_spec(name).num_params == pytest.approx(published, rel=0.03)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("name, params, context, kv_bytes, rope_scaling", [
    # exact counts: 8,030,261,248 and 70,553,706,496 are Meta's published tensor totals
    ("llama-3.1-8b", 8_030_261_248, 131072, 2 * 32 * 8 * 128 * 2, LLAMA3_ROPE),
    ("llama-3.1-70b", 70_553_706_496, 131072, 2 * 80 * 8 * 128 * 2, LLAMA3_ROPE),
    # Qwen3-8B: 36 layers of 4096 -> q 32 x 128, kv 8 x 128, MLP 12288, + q/k norms of 128 each
    ("qwen3-8b", 151936 * 4096 * 2 + 4096 + 36 * (4096 * (4096 + 2 * 1024) + 4096 * 4096
                                                  + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128),
     40960, 2 * 36 * 8 * 128 * 2, None),
])
def test_long_context_bundled_specs(name: str, params: int, context: int, kv_bytes: int,
                                    rope_scaling: dict | None) -> None:
    spec = load_model_spec(name)
    assert name in bundled_model_names()
    assert (spec.num_params, spec.max_position_embeddings) == (params, context)
    assert spec.kv_bytes_per_token == kv_bytes and spec.rope_scaling == rope_scaling
    assert spec.dtype == "bfloat16" and not spec.tie_word_embeddings


def test_hub_ids_of_the_long_context_specs_resolve() -> None:
    assert load_model_spec("meta-llama/Meta-Llama-3.1-8B").name == "llama-3.1-8b"
    assert load_model_spec("meta-llama/Llama-3.1-70B").name == "llama-3.1-70b"
    assert load_model_spec("Qwen/Qwen3-8B").architecture == "Qwen3ForCausalLM"


def test_simulate_runs_on_llama_3_1_8b(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from twinserve.entrypoints.cli.main import main
    out = tmp_path / "sim"
    assert main(["simulate", "--model", "llama-3.1-8b", "--num-requests", "50", "--out", str(out),
                 "--disable-tqdm"]) == 0
    assert "Successful requests:" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["completed"] == 50


def test_names_are_case_insensitive_and_hub_ids_resolve() -> None:
    assert load_model_spec("Llama-3-8B") == load_model_spec("llama-3-8b")
    assert load_model_spec("meta-llama/Meta-Llama-3-8B").num_params == load_model_spec("llama-3-8b").num_params
    assert load_model_spec("meta-llama/Llama-2-7b-hf").num_hidden_layers == 32
    assert load_model_spec("Mistral-7B").name == "mistral-7b-v0.1"


def test_derived_sizes_from_first_principles() -> None:
    spec = load_model_spec("smollm2-135m")
    assert (spec.head_dim, spec.num_key_value_heads, spec.tie_word_embeddings) == (64, 3, True)
    assert spec.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2
    assert spec.weight_bytes == spec.num_params * 2
    assert load_model_spec("llama-2-7b").kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    assert load_model_spec("llama-2-7b", dtype_bytes=4).weight_bytes == 4 * load_model_spec("llama-2-7b").num_params


def test_unknown_model_lists_valid_names() -> None:
    with pytest.raises(ValueError) as excinfo:
        load_model_spec("gpt-5-900b")
    for name in bundled_model_names():
        assert name in str(excinfo.value)


def test_loads_a_real_looking_config_directory(tmp_path: Path) -> None:
    config = json.loads((MODELS_DIR / "smollm2-135m.json").read_text())
    config.update({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "eos_token_id": 2, "head_dim": 64,
                   "mlp_bias": False, "pad_token_id": 2})
    model_dir = tmp_path / "SmolLM2-135M-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    (model_dir / "tokenizer.json").write_text("{}")
    from_dir, from_file = load_model_spec(model_dir), load_model_spec(model_dir / "config.json")
    bundled = load_model_spec("smollm2-135m")
    assert from_dir.name == from_file.name == "SmolLM2-135M-Instruct"
    assert from_dir.num_params == from_file.num_params == bundled.num_params == 134_515_008
    assert from_dir.kv_bytes_per_token == bundled.kv_bytes_per_token


def test_config_errors_name_the_field(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="num_attention_heads"):
        load_model_spec(tmp_path)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig(name="m", architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64,
                    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=3, head_dim=16, max_position_embeddings=128)
    with pytest.raises(ValueError, match="no config.json"):
        load_model_spec(tmp_path / "..")


# --- hardware profiles -----------------------------------------------------------------------------

def test_bundled_hardware_published_peaks() -> None:
    a40, a80, h100, h200 = (load_hardware(n) for n in ("A100-40GB", "a100-80gb", "H100-SXM", "h200"))
    assert (a40.peak_flops, a80.peak_flops, h100.peak_flops, h200.peak_flops) == (312e12, 312e12, 989e12, 989e12)
    assert a40.mem_bandwidth == pytest.approx(1.56e12, rel=0.01)
    assert (a80.mem_bandwidth, h100.mem_bandwidth, h200.mem_bandwidth) == pytest.approx((2.04e12, 3.35e12, 4.8e12),
                                                                                        rel=0.01)
    gib = 2**30  # marketing "40/80/141 GB" are ~GiB; the profiles hold what the device reports
    assert 39 * gib < a40.mem_capacity <= 40 * gib < 79 * gib < a80.mem_capacity <= 80 * gib
    assert 139 * gib < h200.mem_capacity <= 141 * gib
    assert load_hardware("cpu").name == "cpu"


def test_unknown_hardware_lists_valid_names() -> None:
    with pytest.raises(ValueError) as excinfo:
        load_hardware("tpu-v9")
    for name in bundled_hardware_names():
        assert name in str(excinfo.value)


def test_profile_validation_names_the_field() -> None:
    data = load_hardware("h100").to_dict()
    with pytest.raises(ValueError, match="eff_memory"):
        HardwareProfile.from_dict({**data, "eff_memory": 1.5})
    with pytest.raises(ValueError, match="peak_flops"):
        HardwareProfile.from_dict({**data, "peak_flops": 0})
    with pytest.raises(ValueError, match="bogus"):
        HardwareProfile.from_dict({**data, "bogus": 1})


def test_profile_round_trips_through_a_file(tmp_path: Path) -> None:
    profile = load_hardware("a100-80gb")
    assert load_hardware(profile.save(tmp_path / "mine.json")) == profile


# --- roofline --------------------------------------------------------------------------------------

@pytest.mark.parametrize("hardware", ["a100-80gb", "a100-40gb"])
def test_batch1_decode_is_weight_streaming(hardware: str) -> None:
    model = cost("llama-2-7b", hardware)
    floor = model.model.weight_bytes / model.hardware.mem_bandwidth
    seconds = model.step_time(decode_step(1, 128))
    assert floor < seconds <= 1.25 * floor
    assert not model.breakdown(decode_step(1, 128)).is_compute_bound


def test_step_time_monotone_in_tokens_and_context() -> None:
    model = cost("llama-3-8b", "h100")
    decodes = [model.step_time(decode_step(b, 512)) for b in (1, 2, 8, 32, 128, 256, 512)]
    contexts = [model.step_time(decode_step(32, c)) for c in (1, 64, 512, 2048, 8192)]
    prefills = [model.step_time(prefill_step(n)) for n in (16, 128, 512, 2048, 8192)]
    chunked = [model.step_time(prefill_step(512, cached=c)) for c in (0, 512, 2048, 6144)]
    for series in (decodes, contexts, prefills, chunked):
        assert series == sorted(series)
        assert series[-1] > series[0]


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(1, 1024), context=st.integers(1, 32768), prefill=st.integers(0, 8192),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_more_decodes_or_context_never_take_less_time(batch: int, context: int, prefill: int, tp: int) -> None:
    model = CostModel(load_model_spec("llama-3-70b"), load_hardware("h100"), tp)

    def mixed(b: int, c: int) -> SchedulerOutput:
        step = prefill_step(prefill) if prefill else SchedulerOutput()
        step.total_num_scheduled_tokens += b
        step.num_decode_tokens, step.num_decode_seqs = b, b
        step.sum_context_tokens += b * c
        return step

    base = model.step_time(mixed(batch, context))
    assert base > 0
    assert model.step_time(mixed(batch + 1, context)) >= base
    assert model.step_time(mixed(batch, context + 1)) >= base


def test_long_prefill_on_h100_is_compute_bound() -> None:
    step = cost("llama-2-7b", "h100").breakdown(prefill_step(4096))
    assert step.is_compute_bound
    assert step.compute_s > 5 * step.memory_s
    assert step.total_s == pytest.approx(step.compute_s + step.overhead_s, rel=0.05)


def test_tensor_parallel_splits_compute_and_adds_allreduce() -> None:
    one, two = cost("llama-3-70b", "h100", 1), cost("llama-3-70b", "h100", 2)
    for step in (prefill_step(2048), decode_step(64, 1024)):
        a, b = one.breakdown(step), two.breakdown(step)
        assert a.allreduce_s == 0.0 < b.allreduce_s
        assert b.compute_s == pytest.approx(a.compute_s / 2)
        assert b.linear_s + b.attention_s < a.linear_s + a.attention_s
        assert b.total_s < a.total_s
    assert two.kv_bytes_per_token_per_gpu * 2 == two.model.kv_bytes_per_token
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        cost("llama-3-8b", "h100", 3)


def test_swaps_are_timed_over_pcie() -> None:
    model = cost("llama-2-7b", "a100-80gb")
    blocks = 10
    expected = blocks * 16 * model.model.kv_bytes_per_token / model.hardware.pcie_bandwidth
    assert model.swap_time(blocks) == pytest.approx(expected)
    step = decode_step(4, 100)
    with_swaps = decode_step(4, 100)
    with_swaps.blocks_to_swap_out = [(i, i) for i in range(blocks)]
    assert model.step_time(with_swaps) == pytest.approx(model.step_time(step) + expected)
    assert model.step_time(SchedulerOutput()) == 0.0


def test_decode_context_split() -> None:
    fresh = prefill_step(100, chunks=3)
    mixed = SchedulerOutput(total_num_scheduled_tokens=fresh.total_num_scheduled_tokens + 8,
                            num_prefill_tokens=300, num_prefill_seqs=3, num_decode_tokens=8, num_decode_seqs=8,
                            sum_context_tokens=fresh.sum_context_tokens + 8 * 700,
                            sum_decode_context_tokens=8 * 700)
    assert decode_context_tokens(mixed) == 8 * 700  # fresh equal chunks: exact
    assert decode_context_tokens(decode_step(5, 40)) == 200
    assert step_features(mixed)["sum_decode_context_tokens"] == 5600


def test_step_time_matches_breakdown_and_is_positive() -> None:
    rng = random.Random(0)
    model = cost("qwen2.5-7b", "h200", 2)
    for _ in range(200):
        d, p, k = rng.randint(0, 64), rng.randint(0, 2048), rng.randint(1, 4)
        step = SchedulerOutput(total_num_scheduled_tokens=d + p, num_prefill_tokens=p,
                               num_prefill_seqs=k if p else 0, num_decode_tokens=d, num_decode_seqs=d,
                               sum_context_tokens=d * rng.randint(1, 4096) + p * (p + 1) // 2)
        seconds = model.step_time(step)
        assert seconds == pytest.approx(model.breakdown(step).total_s, rel=1e-12)
        assert (seconds > 0) == (d + p > 0)


# --- memory ----------------------------------------------------------------------------------------

def test_num_gpu_blocks_llama3_8b_on_h100() -> None:
    model = cost("llama-3-8b", "h100")
    h, layers, vocab, inter, kv_dim = 4096, 32, 128256, 14336, 8 * 128
    params = 2 * vocab * h + h + layers * (2 * h * h + 2 * h * kv_dim + 3 * h * inter + 2 * h)
    block_bytes = 16 * 2 * layers * kv_dim * 2  # 16 tokens, K and V, bf16: 2 MiB
    reserve = 2 * 2**30
    expected = int((model.hardware.mem_capacity * 0.9 - 2 * params - reserve) // block_bytes)
    assert model.num_gpu_blocks(0.9, 16, activation_reserve_bytes=reserve) == expected
    default = model.num_gpu_blocks(0.9, 16)
    assert 25_000 < default < 30_000  # ~430k tokens, what vLLM reports for this pair
    assert default >= expected
    assert model.num_gpu_blocks(0.9, 32) == default // 2


def test_70b_does_not_fit_on_one_a100_40gb() -> None:
    with pytest.raises(ValueError, match=r"llama-3-70b does not fit on A100-40GB.*GiB"):
        cost("llama-3-70b", "a100-40gb").num_gpu_blocks(0.9, 16)
    assert cost("llama-3-70b", "a100-80gb", 4).num_gpu_blocks(0.9, 16) > 0
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cost("llama-3-8b", "h100").num_gpu_blocks(1.5, 16)


# --- fitted model ----------------------------------------------------------------------------------

def synthetic_samples(truth: dict[str, float], intercept: float, n: int, noise: float = 0.0,
                      seed: int = 0) -> list[tuple[dict[str, float], float]]:
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(n):
        d, p, k = int(rng.integers(0, 128)), int(rng.integers(0, 4096)), int(rng.integers(1, 5))
        longest = int(rng.integers(1, 8192))
        decode_ctx = d * int(rng.integers(1, longest + 1))
        step = SchedulerOutput(total_num_scheduled_tokens=d + p, num_prefill_tokens=p, num_prefill_seqs=k,
                               num_decode_tokens=d, num_decode_seqs=d,
                               sum_context_tokens=decode_ctx + p * int(rng.integers(1, 4096)),
                               sum_decode_context_tokens=decode_ctx, max_decode_context=longest)
        features = step_features(step)
        seconds = intercept + sum(truth.get(f, 0.0) * v for f, v in features.items())
        samples.append((features, seconds * (1 + noise * rng.standard_normal())))
    return samples


TRUTH = {"num_tokens": 2e-5, "num_prefill_tokens": 0.0, "num_prefill_seqs": 1e-4, "num_decode_seqs": 3e-5,
         "sum_context_tokens": 1e-9, "sum_decode_context_tokens": 5e-9,
         "padded_decode_context_tokens": 2e-9}


def _predict(params: FittedParams, features: dict[str, float]) -> float:
    return params.intercept_s + sum(params.coefficients.get(f, 0.0) * v for f, v in features.items())


# identifiable: the token count is num_prefill_tokens + num_decode_seqs and the token segments
# add up to it, so only the coefficients of the other features are determined by the data
IDENTIFIABLE = ("num_prefill_seqs", "sum_context_tokens", "sum_decode_context_tokens",
                "padded_decode_context_tokens")


def test_fit_recovers_known_coefficients() -> None:
    params = fit_step_time(synthetic_samples(TRUTH, 4e-3, 300), model="llama-3-8b")
    for name in IDENTIFIABLE:
        assert params.coefficients[name] == pytest.approx(TRUTH[name], rel=1e-6, abs=1e-12)
    for features, seconds in synthetic_samples(TRUTH, 4e-3, 50, seed=9):
        assert _predict(params, features) == pytest.approx(seconds, rel=1e-6)
    assert params.rmse_s < 1e-9 and params.num_samples == 300


def test_fit_with_noise_stays_close_and_non_negative() -> None:
    params = fit_step_time(synthetic_samples(TRUTH, 4e-3, 2000, noise=0.01, seed=1))
    assert all(value >= 0 for value in params.coefficients.values())
    assert params.coefficients["sum_decode_context_tokens"] == pytest.approx(5e-9, rel=0.1)
    cost = FittedCostModel(params, CostModel(load_model_spec("llama-3-8b"), load_hardware("h100")))
    per_decode = (cost.step_time(decode_step(101, 512)) - cost.step_time(decode_step(1, 512))) / 100
    assert per_decode == pytest.approx(2e-5 + 3e-5 + 512 * (1e-9 + 5e-9 + 2e-9), rel=0.05)


def test_token_segments_split_the_count_over_the_knots() -> None:
    assert sum(token_segments(1)) == 0 and sum(token_segments(3000)) == 2999
    assert token_segments(6)[:4] == (1, 2, 2, 0)  # 1-2, 2-4, 4-6 of 4-8, none past 8
    assert token_segments(3000)[-1] == 3000 - TOKEN_KNOTS[-1]
    assert len(token_segments(7)) == len(TOKEN_SEGMENTS)


def test_fitted_step_time_follows_a_plateau_and_never_decreases() -> None:
    """Decode batches of 4-16 taking the same time (a padded kernel): the segments follow the
    plateau that a line cannot, and the fitted time never falls as tokens grow."""
    def seconds(tokens: int) -> float:
        return 0.07 + 0.01 * min(tokens, 4) + 0.004 * max(0, tokens - 16)
    samples = [(step_features(decode_step(b, 100)), seconds(b)) for b in range(1, 65)]
    params = fit_step_time(samples)
    cost = FittedCostModel(params, CostModel(load_model_spec("llama-3-8b"), load_hardware("h100")))
    for b in (1, 2, 4, 5, 8, 16, 32, 64):
        assert cost.step_time(decode_step(b, 100)) == pytest.approx(seconds(b), rel=1e-3), b
    times = [cost.step_time(decode_step(b, 100)) for b in range(1, 3000, 7)]
    assert all(a <= b + 1e-12 for a, b in zip(times, times[1:]))


def test_fitted_step_time_equals_the_sum_over_its_features() -> None:
    rng = np.random.default_rng(11)
    coefficients = {name: float(rng.uniform(0, 1e-4)) for name in ALL_FEATURE_NAMES}
    params = FittedParams(2e-3, coefficients, "llama-3-8b")
    cost = FittedCostModel(params, CostModel(load_model_spec("llama-3-8b"), load_hardware("h100")))
    for tokens in (1, 2, 3, 17, 1024, 1500, 5000):  # at, between and past the knots
        for step in (decode_step(tokens, 300),
                     SchedulerOutput(total_num_scheduled_tokens=tokens, num_prefill_tokens=tokens,
                                     num_prefill_seqs=1,
                                     sum_context_tokens=tokens * (tokens + 1) // 2)):
            assert cost.step_time(step) == pytest.approx(_predict(params, step_features(step)))


def test_nnls_clamps_and_satisfies_kkt() -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((50, 4))
    b = a @ np.array([1.0, -2.0, 0.5, 0.0]) + 0.01 * rng.standard_normal(50)
    x = nnls(a, b)
    gradient = a.T @ (a @ x - b)
    assert (x >= 0).all() and x[1] == 0.0
    assert np.allclose(gradient[x > 0], 0.0, atol=1e-8) and (gradient[x == 0] >= -1e-8).all()


def test_fit_rejects_unknown_features_and_bad_seconds() -> None:
    with pytest.raises(ValueError, match="num_tokenz"):
        fit_step_time([({"num_tokenz": 1.0}, 0.1)])
    with pytest.raises(ValueError, match="seconds"):
        fit_step_time([({"num_tokens": 1.0}, -1.0)])
    with pytest.raises(ValueError, match="samples"):
        fit_step_time([])


def test_calibrated_profile_plugs_in_by_name_or_path(tmp_path: Path) -> None:
    spec, profile = load_model_spec("llama-3-8b"), load_hardware("h100")
    assert isinstance(make_cost_model(spec, profile), CostModel)
    base = CostModel(spec, profile)
    fitted = FittedCostModel.fit(synthetic_samples(TRUTH, 4e-3, 100), base)
    path = profile.with_fitted(fitted.params).save(tmp_path / "h100-calibrated.json")
    loaded = make_cost_model(spec, load_hardware(path))
    assert isinstance(loaded, FittedCostModel)
    step = decode_step(16, 300)
    expected = 4e-3 + 2e-5 * 16 + 3e-5 * 16 + 1e-9 * 4800 + 5e-9 * 4800
    assert loaded.step_time(step) == pytest.approx(expected, rel=1e-6)
    assert loaded.num_gpu_blocks(0.9, 16) == base.num_gpu_blocks(0.9, 16)
    assert isinstance(make_cost_model(spec, load_hardware(path), 2), CostModel)  # fit was for tp=1
    assert isinstance(make_cost_model(load_model_spec("llama-2-13b"), load_hardware(path)), CostModel)


def test_unlabelled_fit_applies_to_any_model() -> None:
    params = FittedParams(1e-3, {"num_tokens": 1e-6})
    profile = load_hardware("cpu").with_fitted(params)
    model = make_cost_model(load_model_spec("smollm2-135m"), profile)
    assert model.step_time(decode_step(10, 5)) == pytest.approx(1e-3 + 1e-5)
    with pytest.raises(ValueError, match="coefficients"):
        FittedParams(1e-3, {"num_tokens": -1.0})
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        FittedCostModel(FittedParams(1e-3, {}, "llama-3-8b", 2), cost("llama-3-8b", "h100"))


def test_fitted_fast_path_equals_its_reference_with_every_term() -> None:
    """``step_time`` (inlined) against ``step_time_reference`` bit for bit, with a coefficient on
    every feature, the CPU kernels' longest-context and prefix-chunk terms included."""
    rng = np.random.default_rng(12)
    coefficients = {name: float(rng.uniform(0, 1e-4)) for name in ALL_FEATURE_NAMES}
    params = FittedParams(2e-3, coefficients, "llama-3-8b")
    cost = FittedCostModel(params, CostModel(load_model_spec("llama-3-8b"), load_hardware("h100")))
    for _ in range(500):
        decodes, chunks = int(rng.integers(0, 64)), int(rng.integers(0, 3))
        prefill = sum(int(rng.integers(1, 1024)) for _ in range(chunks))
        ctx = [int(rng.integers(2, 4096)) for _ in range(decodes)]
        if decodes + prefill == 0:
            continue
        prefill_ctx = prefill * int(rng.integers(1, 2048))
        out = SchedulerOutput(
            total_num_scheduled_tokens=decodes + prefill, num_prefill_tokens=prefill,
            num_decode_tokens=decodes, num_prefill_seqs=chunks, num_decode_seqs=decodes,
            sum_context_tokens=sum(ctx) + prefill_ctx, sum_decode_context_tokens=sum(ctx),
            max_decode_context=max(ctx, default=0),
            num_prefix_chunks=int(rng.integers(0, chunks + 1)),
            sum_prefix_context_tokens=int(rng.integers(0, 2048)) * bool(chunks),
            sum_prefill_attention_area=prefill_ctx + prefill * int(rng.integers(0, 512)))
        assert cost.step_time(out) == cost.step_time_reference(out)
