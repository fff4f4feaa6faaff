"""Policies that reorder the queue or watch the tokens, on tight KV caches: the twin's fast
paths (decode runs, lazy runs, lazy prompts) against the step-by-step reference, including a
step that only preempts (the current request its own victim) and a fair policy whose counters an
arrival reads while a decode run is in progress."""

from __future__ import annotations

import pytest

from twinserve.simulator import SimConfig, simulate
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

CASES = {
    # sjf's victim is the request with the most output left: the first running request may pick
    # itself, and the step then schedules nothing (the engine, as vLLM's, goes on next step)
    "sjf-lone": (dict(hardware="a100-80gb", max_num_seqs=256, max_num_batched_tokens=8192,
                      num_gpu_blocks_override=400, scheduling_policy="sjf"),
                 dict(request_rate=60.0, num_apps=15, zipf_s=1.2, system_len_min=16,
                      input_len=200, output_len=32, seed=615), 79),
    "sjf-fleet": (dict(hardware="h100-sxm", num_replicas=2, router="least-outstanding",
                       max_num_seqs=64, max_num_batched_tokens=512, num_gpu_blocks_override=150,
                       scheduling_policy="sjf"),
                  dict(request_rate=5.0, num_apps=9, zipf_s=0.8, system_len_min=200,
                       input_len=200, output_len=128, seed=335), 44),
    # fair (VTC) lifts an arriving tenant to a floor read off the counters the steps so far
    # charged: a run must have applied them by the arrival
    "fair-fleet": (dict(hardware="h100-sxm", num_replicas=2, router="cache-aware",
                        max_num_seqs=4, max_num_batched_tokens=2048, scheduling_policy="fair",
                        enable_prefix_caching=False),
                   dict(request_rate=20.0, num_apps=14, zipf_s=1.2, system_len_min=64,
                        input_len=200, output_len=128, seed=849), 59),
}


@pytest.mark.parametrize("case", CASES)
def test_fast_paths_equal_the_step_by_step_reference(case) -> None:
    engine, workload, n = CASES[case]
    trace = multi_app_trace(MultiAppConfig(num_requests=n, system_len_max=400, **workload))
    cfg = SimConfig(model="llama-3-8b", max_model_len=2048, **engine)
    fast = simulate(cfg, trace)
    reference = simulate(cfg, trace, decode_runs=False, lazy_prompts=False,
                         replicas_apart=False)
    assert len(fast.records) == n  # each one served or refused (overload), none lost
    assert sum(r.num_preemptions for r in reference.records) > 0 or case.startswith("fair")
    # (repr: a record's NaNs compare unequal; floats print exactly)
    assert repr(fast.records) == repr(reference.records)
    assert repr(list(fast.steps)) == repr(list(reference.steps))
