"""The P/D router: each pool routed by its own router over its own loads."""

from __future__ import annotations

import pytest
from core_helpers import make_req

from twinserve.core import SamplingParams
from twinserve.routers import ReplicaLoad
from twinserve.routers.disaggregated import (
    DisaggregatedRouter,
    prefill_kv_transfer_params,
    prefill_sampling_params,
)


def test_each_pool_goes_to_its_least_outstanding_instance():
    router = DisaggregatedRouter.of(2, 3, block_size=16)
    req = make_req("a", 10)
    prefill = [ReplicaLoad(3, 1, 0.5), ReplicaLoad(1, 0, 0.1)]
    decode = [ReplicaLoad(4, 0, 0.2), ReplicaLoad(2, 2, 0.2), ReplicaLoad(1, 0, 0.9)]
    assert router.route_prefill(req, prefill) == 1
    assert router.route_decode(req, {"remote_engine_id": "prefill-1"}, decode) == 2


def test_named_routers_per_pool_and_pool_sizes_are_checked():
    router = DisaggregatedRouter.of(2, 2, block_size=16, prefill_router="round-robin",
                                    decode_router="round-robin")
    loads = [ReplicaLoad(0, 0, 0.0)] * 2
    assert [router.route_prefill(make_req(f"r{i}", 4), loads) for i in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="route_decode: 3 loads for a pool of 2"):
        router.route_decode(make_req("x", 4), None, [ReplicaLoad(0, 0, 0.0)] * 3)
    with pytest.raises(ValueError, match="num_decode must be an integer >= 1"):
        DisaggregatedRouter.of(1, 0, block_size=16)
    with pytest.raises(ValueError, match="unknown router"):
        DisaggregatedRouter.of(1, 1, block_size=16, decode_router="nope")


def test_the_prefill_copy_samples_one_token_and_asks_for_a_remote_decode():
    params = prefill_sampling_params(SamplingParams(max_tokens=200, min_tokens=5, n=2))
    assert (params.max_tokens, params.min_tokens, params.n) == (1, 0, 1)
    first, second = prefill_kv_transfer_params(), prefill_kv_transfer_params()
    assert first == {"do_remote_decode": True} and first is not second
