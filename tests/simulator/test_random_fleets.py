"""Random deployments (policies, routers, replicas, tight KV caches, preemption by recompute
or swap, pipeline stages, a host KV tier, prefill and decode pools) on random multi-application
workloads: the twin's fast paths against its step-by-step reference, run for run. The seeds
include configurations a wider sweep of this generator found diverging or stopping."""

from __future__ import annotations

import random

import pytest

from twinserve.simulator import SimConfig, simulate
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

# 37, 306, 1123: sjf's self-preempting step, fair's counters, a prompt's first own id shared;
# 5377: prompts loaded from the host tier holding every block
SEEDS = [0, 3, 37, 306, 1123, 5377, 5021, 5130, 6001, 6017, 6100, 6233]


def _deployment(seed: int) -> tuple[SimConfig, MultiAppConfig] | None:
    rng = random.Random(seed)
    router = rng.choice(["round-robin", "least-outstanding", "prefix-affinity", "cache-aware"])
    replicas, n = rng.randint(1, 4), rng.randint(40, 250)
    workload = MultiAppConfig(
        num_requests=n, request_rate=rng.choice([5.0, 20.0, 60.0, 150.0]),
        num_apps=rng.randint(1, 30), zipf_s=rng.choice([0.0, 0.8, 1.2]),
        system_len_min=rng.choice([16, 64, 200]), system_len_max=400,
        input_len=rng.choice([8, 64, 200]), output_len=rng.choice([4, 32, 128]),
        seed=rng.randint(0, 999))
    args = dict(model="llama-3-8b", hardware=rng.choice(["h100-sxm", "a100-80gb"]),
                num_replicas=replicas, router=router, max_num_seqs=rng.choice([4, 16, 64, 256]),
                max_num_batched_tokens=rng.choice([512, 2048, 8192]),
                num_gpu_blocks_override=rng.choice([None, 60, 150, 400, 2000]),
                scheduling_policy=rng.choice(["fcfs", "fcfs", "priority", "sjf", "fair"]),
                enable_prefix_caching=rng.choice([True, True, False]), max_model_len=2048)
    if rng.random() < 0.3:
        args["max_waiting_requests"] = rng.choice([2, 8, 32])
    extra = rng.choice(["none", "pp", "offload", "pd"]) if seed >= 5000 else "none"
    if extra == "pp":
        args["pipeline_parallel_size"] = 2
    elif extra == "offload":
        args["kv_offloading_size"] = rng.choice([0.05, 0.2, 1])
    elif extra == "pd":
        args.update(prefill_instances=1, decode_instances=rng.choice([1, 2]))
        del args["num_replicas"], args["router"]
    if rng.random() < 0.2:
        args["preemption_mode"] = "swap"
    try:
        return SimConfig(**{k: v for k, v in args.items() if v is not None}), workload
    except ValueError:
        return None  # (a combination refused by name, as a user would see it)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_deployment_replays_as_its_reference(seed: int) -> None:
    made = _deployment(seed)
    if made is None:
        pytest.skip("a refused combination")
    cfg, workload = made
    trace = multi_app_trace(workload)
    try:
        fast = simulate(cfg, trace)
    except ValueError as exc:  # refused before it ran (a named limit), both ways
        with pytest.raises(ValueError, match=str(exc)[:40]):
            simulate(cfg, trace, decode_runs=False, lazy_prompts=False, replicas_apart=False)
        return
    reference = simulate(cfg, trace, decode_runs=False, lazy_prompts=False,
                         replicas_apart=False)
    assert len(fast.records) == len(trace)
    # (repr: a record's NaNs compare unequal; floats print exactly)
    assert repr(fast.records) == repr(reference.records)
    assert repr(list(fast.steps)) == repr(list(reference.steps))
