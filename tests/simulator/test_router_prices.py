"""The routers' constants read off the twin's step-time model: per hardware, handed to the routers
that take them, the same in the twin and in front of ``validate``'s real replicas."""

from __future__ import annotations

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.entrypoints.cli.validate_dp import profile_prices
from twinserve.routers import CacheAwareRouter, RoundRobinRouter, make_router
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator.router_prices import router_prices
from twinserve.simulator.run import build_engine_config
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace


def prices_on(hardware: str, model: str = "llama-3-8b") -> dict[str, float]:
    build = build_engine_config(SimConfig(EngineArgs(model=model), hardware=hardware))
    return router_prices(build.cost_model, build.engine_config.scheduler)


def test_prices_follow_the_hardware() -> None:
    h100, a100 = prices_on("h100-sxm"), prices_on("a100-80gb")
    assert set(h100) == {"prefill_tokens_per_s", "decode_weight"}
    # Llama-3-8B prefills several times faster on an H100 than on an A100 (the profiles' fits)
    assert 30_000 < h100["prefill_tokens_per_s"] < 200_000
    assert 2.5 < h100["prefill_tokens_per_s"] / a100["prefill_tokens_per_s"] < 10
    assert 0 < a100["decode_weight"] < h100["decode_weight"] < 20
    small = prices_on("h100-sxm", "smollm2-135m")  # a small model: more tokens per second
    assert small["prefill_tokens_per_s"] > h100["prefill_tokens_per_s"]


def test_make_router_hands_prices_only_to_routers_that_take_them() -> None:
    prices = {"prefill_tokens_per_s": 1234.0, "decode_weight": 0.5}
    aware = make_router("cache-aware", 16, prices)
    assert isinstance(aware, CacheAwareRouter)
    assert (aware.prefill_tokens_per_s, aware.decode_weight) == (1234.0, 0.5)
    assert isinstance(make_router("round-robin", 16, prices), RoundRobinRouter)
    chosen = make_router("cache-aware", 16, prices, decode_weight=2.0)  # options win
    assert isinstance(chosen, CacheAwareRouter) and chosen.decode_weight == 2.0
    with pytest.raises(ValueError, match="decode_weight"):
        make_router("cache-aware", 16, {"decode_weight": -1.0})


def test_the_twin_prices_its_router_on_its_own_hardware() -> None:
    trace = multi_app_trace(MultiAppConfig(num_requests=120, request_rate=40.0, num_apps=6,
                                           system_len_max=1024, input_len=200, output_len=60))
    cfg = SimConfig(EngineArgs(model="smollm2-135m"), hardware="a100-80gb", num_replicas=3,
                    router="cache-aware")
    build = build_engine_config(cfg)
    prices = router_prices(build.cost_model, build.engine_config.scheduler)
    assert prices["prefill_tokens_per_s"] != 50_000.0  # not the class's Llama-3-8B/H100 default
    priced = make_router("cache-aware", cfg.engine.block_size, prices)
    assert simulate(cfg, trace).records == simulate(cfg, trace, router=priced).records


def test_validate_prices_the_real_front_as_its_twin() -> None:
    engine = EngineArgs(model="smollm2-135m", data_parallel_size=2, router="cache-aware")
    assert profile_prices(engine, "cpu") == prices_on("cpu", "smollm2-135m")
