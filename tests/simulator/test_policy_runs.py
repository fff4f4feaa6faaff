"""Policies that reorder the queue or watch the tokens, on tight KV caches: the twin's fast
paths (decode runs, lazy runs, lazy prompts) against the step-by-step reference, including a
step that only preempts (the current request its own victim), a fair policy whose counters an
arrival reads while a decode run is in progress, and prompts loaded from a host KV tier that
hold every block between them."""

from __future__ import annotations

import pytest

from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler
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
    # with a host KV tier, prompts loaded ahead of their admission hold their blocks: on a
    # small cache they can hold them all, none able to get the rest it needs
    "fair-host-tier": (dict(hardware="a100-80gb", max_num_seqs=256, max_num_batched_tokens=8192,
                            num_gpu_blocks_override=60, scheduling_policy="fair",
                            kv_offloading_size=1),
                       dict(request_rate=20.0, num_apps=17, zipf_s=0.8, system_len_min=200,
                            input_len=64, output_len=32, seed=267), 40),
}


@pytest.mark.parametrize("case", CASES)
def test_fast_paths_equal_the_step_by_step_reference(monkeypatch, case) -> None:
    engine, workload, n = CASES[case]
    released = [0]
    release = Scheduler._release_a_loaded

    def counting_release(self: Scheduler, request: Request) -> bool:
        done = release(self, request)
        released[0] += done
        return done

    monkeypatch.setattr(Scheduler, "_release_a_loaded", counting_release)
    trace = multi_app_trace(MultiAppConfig(num_requests=n, system_len_max=400, **workload))
    cfg = SimConfig(model="llama-3-8b", max_model_len=2048, **engine)
    fast = simulate(cfg, trace)
    reference = simulate(cfg, trace, decode_runs=False, lazy_prompts=False,
                         replicas_apart=False)
    assert len(fast.records) == n  # each one served or refused (overload), none lost
    assert sum(r.num_preemptions for r in reference.records) > 0 or case.startswith("fair")
    if case == "fair-host-tier":
        assert released[0] > 0  # the loaded prompts' deadlock came, and was broken
    # (repr: a record's NaNs compare unequal; floats print exactly)
    assert repr(fast.records) == repr(reference.records)
    assert repr(list(fast.steps)) == repr(list(reference.steps))
