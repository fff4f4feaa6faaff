"""The SimPy twin end to end: conservation, determinism (with a golden run), queueing theory
(M/D/1 and Little's law), the engine features the seed figures rest on (prefix caching, chunked
prefill, VTC fairness, replicas and routing, swap and recompute preemption), static batching, and
the errors for unknown names.

Every workload is small (a few hundred to a few thousand requests; the M/D/1 case runs ~40k cheap
steps) so the whole file runs in well under a minute and a half on a slow 2-core machine.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
import random
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pytest
import simpy
from core_helpers import make_req, make_scheduler, step

from twinserve.core import ModelRunnerOutput, SchedulerOutput
from twinserve.core.metrics import RequestRecord, StepRecord, jain_index
from twinserve.core.scheduler import Scheduler
from twinserve.core.step_driver import RunRecorder, StepDriver
from twinserve.policies import available_policies, get_policy
from twinserve.policies.static import StaticBatchingPolicy
from twinserve.routers import make_router
from twinserve.simulator import SimConfig, SimResult, simulate, write_sim_run
from twinserve.simulator.engine import Replica, arrival_process, engine_process
from twinserve.simulator.run import build_engine_config, to_request
from twinserve.simulator.step_time import StepTimeFunction
from twinserve.traces import SyntheticConfig, TraceRequest, first_n, load_trace, synthetic_trace

SMALL = {"model": "smollm2-135m", "hardware": "a100-80gb"}
# Queues that never say "not now": for the studies of queueing itself (floods, M/D/1).
UNBOUNDED = {"max_waiting_requests": 10**9, "max_waiting_tokens": 10**12}


# ---- helpers ---------------------------------------------------------------------------------
@dataclasses.dataclass(slots=True)
class EngineRun:
    """A simulation driven here (not through ``simulate``) so the schedulers can be audited."""

    recorder: RunRecorder
    replicas: list[Replica]
    block_ops: Counter


def run_engines(cfg: SimConfig, trace: list[TraceRequest], engine=engine_process) -> EngineRun:
    """``simulate`` without the summary, keeping the replicas, counting swap/copy block ops and
    checking that every scheduled token has a KV slot; ``engine`` is the engine process."""
    build = build_engine_config(cfg)
    cost, block_size = build.cost_model, cfg.engine.block_size
    sched_cfg, vocab = build.engine_config.scheduler, build.model.vocab_size
    ops: Counter = Counter()

    def step_time(out: SchedulerOutput) -> float:
        for sr in out.scheduled:  # every token computed this step has a KV slot
            slots = len(sr.block_ids) * block_size
            assert slots >= sr.start + sr.num_new_tokens, sr.request_id
        ops["swap_out"] += len(out.blocks_to_swap_out)
        ops["swap_in"] += len(out.blocks_to_swap_in)
        ops["copy"] += len(out.blocks_to_copy)
        return cost.step_time(out)

    env = simpy.Environment()
    recorder = RunRecorder(record_tenants=True)
    args = cfg.engine
    replicas = [Replica(i, StepDriver(Scheduler(sched_cfg, get_policy(args.scheduling_policy,
                                                                      **args.policy_options),
                                                stream_outputs=False), recorder, i),
                        StepTimeFunction(step_time))
                for i in range(cfg.num_replicas)]
    requests = (to_request(tr, vocab, block_size) for tr in trace)
    env.process(arrival_process(env, requests, replicas, make_router(cfg.router, block_size), recorder))
    for replica in replicas:
        env.process(engine(env, replica))
    env.run()
    return EngineRun(recorder, replicas, ops)


def assert_conserved(trace: list[TraceRequest], records: list[RequestRecord]) -> None:
    """Every trace request finished exactly once, successfully, with its own token counts."""
    ids = [r.request_id for r in records]
    assert len(ids) == len(set(ids)) == len(trace)
    by_id = {r.request_id: r for r in records}
    for tr in trace:
        rec = by_id[tr.request_id]
        assert rec.success and rec.finish_reason == "length"
        assert (rec.input_tokens, rec.output_tokens) == (tr.input_tokens, tr.output_tokens)
        assert len(rec.itls) == tr.output_tokens - 1
        assert rec.arrival_time <= rec.first_scheduled_time <= rec.first_token_time
        assert rec.first_token_time <= rec.finish_time
    assert sum(r.output_tokens for r in records) == sum(tr.output_tokens for tr in trace)
    assert sum(r.input_tokens for r in records) == sum(tr.input_tokens for tr in trace)


def assert_no_leaks(run: EngineRun) -> None:
    """Every replica ends empty: no request, no device or host block held, audit clean."""
    for replica in run.replicas:
        sched = replica.scheduler
        assert not replica.tokens.output.sampled_token_ids
        assert not sched.requests and not sched.running
        assert sched.num_waiting == 0 and not sched.has_unfinished_requests()
        kv = sched.kv
        assert not kv.tables
        assert kv.num_free_blocks == sched.config.num_gpu_blocks
        assert kv.host_pool.num_free == kv.host_pool.num_blocks
        kv.check_consistency()


@pytest.fixture(scope="module")
def azure_conv() -> list[TraceRequest]:
    """The bundled Azure LLM 2023 conversation trace (19,366 requests), loaded once."""
    return load_trace("azure-conv")


def at_once(trace: list[TraceRequest]) -> list[TraceRequest]:
    """Everything arrives at t=0: the engine is saturated from the first step."""
    return [dataclasses.replace(tr, arrival_time=0.0) for tr in trace]


def service_time_alone(cfg: SimConfig, input_tokens: int, output_tokens: int) -> float:
    """Sum of the cost model's step times for one request alone in the engine (no SimPy)."""
    build = build_engine_config(cfg)
    sched = Scheduler(build.engine_config.scheduler, get_policy(cfg.scheduling_policy),
                      stream_outputs=False)
    sched.add_request(to_request(TraceRequest("alone", 0.0, input_tokens, output_tokens),
                                 build.model.vocab_size, cfg.engine.block_size))
    now = 0.0
    while sched.has_unfinished_requests():
        out = sched.schedule(now)
        now += build.cost_model.step_time(out)
        tokens = {sr.request.request_id: [17] for sr in out.scheduled if sr.sample}
        sched.update_from_output(out, ModelRunnerOutput(tokens), now)
    return now


def batches_by_overlap(records: list[RequestRecord]) -> list[int]:
    """Sizes of the groups of requests whose service overlaps: a request starts a new group when
    every earlier-admitted request had finished by its admission."""
    sizes: list[int] = []
    busy_until = -math.inf
    for rec in sorted(records, key=lambda r: r.first_scheduled_time):
        if rec.first_scheduled_time >= busy_until:
            sizes.append(0)
        sizes[-1] += 1
        busy_until = max(busy_until, rec.finish_time)
    return sizes


# ---- (a) conservation ------------------------------------------------------------------------
def test_conservation_on_azure_slice_tokens_add_up_and_no_block_leaks(
        azure_conv: list[TraceRequest]) -> None:
    trace = first_n(azure_conv, 300)
    cfg = SimConfig()
    run = run_engines(cfg, trace)
    records = run.recorder.requests
    assert_conserved(trace, records)
    assert_no_leaks(run)
    steps = run.recorder.steps
    cached = sum(r.cached_tokens for r in records)
    assert sum(r.num_preemptions for r in records) == 0
    # Without preemption each prompt token is computed once (minus cache hits) and each output
    # token but the last is fed back once: the first token is sampled by the prefill step.
    assert sum(s.num_prefill_tokens for s in steps) == sum(tr.input_tokens for tr in trace) - cached
    assert sum(s.num_decode_tokens for s in steps) == sum(tr.output_tokens - 1 for tr in trace)
    # ... and the per-tenant split of the step records says the same.
    assert sum(o for s in steps for _, o in s.tenant_tokens.values()) == \
        sum(tr.output_tokens for tr in trace)


def test_simulate_summary_matches_the_trace(azure_conv: list[TraceRequest]) -> None:
    trace = first_n(azure_conv, 200)
    result = simulate(SimConfig(), trace)
    assert_conserved(trace, result.records)
    s = result.summary
    assert (s["completed"], s["failed"]) == (200, 0)
    assert s["total_input_tokens"] == sum(tr.input_tokens for tr in trace)
    assert s["total_output_tokens"] == sum(tr.output_tokens for tr in trace)
    assert result.steps[-1].kv_usage == 0.0 and result.steps[-1].num_running == 0


def test_requests_that_can_never_run_are_recorded_as_failed() -> None:
    trace = [TraceRequest("fits", 0.0, 100, 4), TraceRequest("too-long", 0.1, 9000, 4)]
    result = simulate(SimConfig(**SMALL, max_model_len=4096), trace)
    by_id = {r.request_id: r for r in result.records}
    assert by_id["fits"].success and not by_id["too-long"].success
    assert "maximum context length" in by_id["too-long"].error
    assert (result.summary["completed"], result.summary["failed"]) == (1, 1)


def test_a_request_longer_than_the_whole_cache_fails_alone() -> None:
    trace = [TraceRequest("huge", 0.0, 100, 100), TraceRequest("ok", 0.1, 20, 4),
             TraceRequest("exact", 0.2, 100, 61)]  # 160 tokens: the last KV is never written
    result = simulate(SimConfig(num_gpu_blocks_override=10), trace)  # 160 tokens of KV in all
    by_id = {r.request_id: r for r in result.records}
    assert not by_id["huge"].success and by_id["ok"].success and by_id["exact"].success
    assert "could never finish" in by_id["huge"].error


# ---- (b) determinism and a golden run --------------------------------------------------------
def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_inputs_give_byte_identical_run_folders(tmp_path: Path) -> None:
    wl = SyntheticConfig(num_requests=150, input_len=300, output_len=40,
                         range_ratio=0.8, prefix_len=128, prefix_share=0.5,
                         tenant_rates={"a": 20.0, "b": 10.0}, seed=11)
    cfg = SimConfig(**SMALL, scheduling_policy="fair", max_num_seqs=16, num_gpu_blocks_override=300)
    desc = {"trace": "synthetic", "seed": wl.seed}
    one = write_sim_run(simulate(cfg, synthetic_trace(wl)), tmp_path / "one", desc)
    two = write_sim_run(simulate(cfg, synthetic_trace(wl)), tmp_path / "two", desc)
    files_one, files_two = _files(one), _files(two)
    assert set(files_one) == {"config.json", "requests.csv", "steps.csv", "summary.json",
                              "tenants.csv"}
    assert files_one == files_two
    assert files_one["tenants.csv"].count(b"\n") > 10  # tenants really recorded


# Golden numbers of a tiny fixed workload. They change only when the cost model, the scheduler,
# the trace generator or the run-folder format change (on purpose, one hopes). To regenerate,
# run ``cd tests && python -c "from test_simulator import _golden; print(_golden())"`` and paste the
# printed values here, saying in the commit message what changed the numbers.
GOLDEN = {"completed": 40, "total_input_tokens": 10381, "total_output_tokens": 751,
          "num_steps": 750, "num_preemptions": 0,
          "requests_csv_sha256": "967850b0832d595144eea109dd5b1389663813556433370025cf797657bc1154"}


def _golden(tmp_dir: Path | None = None) -> dict[str, object]:
    import tempfile
    wl = SyntheticConfig(num_requests=40, request_rate=8.0, input_len=200, output_len=20,
                         range_ratio=0.5, prefix_len=64, prefix_share=0.5, seed=7)
    # the engine limits written out: the golden numbers do not move with the defaults
    result = simulate(SimConfig(**SMALL, max_num_seqs=8, max_num_batched_tokens=8192),
                      synthetic_trace(wl))
    folder = write_sim_run(result, Path(tmp_dir or tempfile.mkdtemp()) / "golden",
                           {"trace": "synthetic-golden"})
    csv_bytes = (folder / "requests.csv").read_bytes()
    return {"completed": result.summary["completed"],
            "total_input_tokens": result.summary["total_input_tokens"],
            "total_output_tokens": result.summary["total_output_tokens"],
            "num_steps": len(result.steps), "num_preemptions": result.summary["num_preemptions"],
            "requests_csv_sha256": hashlib.sha256(csv_bytes).hexdigest()}


def test_golden_tiny_workload(tmp_path: Path) -> None:
    assert _golden(tmp_path) == GOLDEN


@pytest.mark.parametrize("enabled", [True, False])
def test_simulate_restores_the_callers_garbage_collector_setting(enabled: bool) -> None:
    import gc
    trace = synthetic_trace(SyntheticConfig(num_requests=5, input_len=20, output_len=3, seed=1))
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        assert simulate(SimConfig(**SMALL), trace).summary["completed"] == 5
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_simulate_leaves_objects_the_caller_froze_frozen() -> None:
    import gc
    trace = synthetic_trace(SyntheticConfig(num_requests=5, input_len=20, output_len=3, seed=1))
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert simulate(SimConfig(**SMALL), trace).summary["completed"] == 5
        assert gc.get_freeze_count() >= frozen - 100  # a few may have been freed, none thawed
    finally:
        gc.unfreeze()


# ---- (c) queueing theory: M/D/1 and Little's law ---------------------------------------------
def test_md1_busy_fraction_queueing_delay_and_littles_law() -> None:
    """One sequence at a time and fixed lengths make every service time the same S; Poisson
    arrivals at rate lambda then make the engine an M/D/1 queue: busy fraction rho = lambda*S
    and mean wait in queue rho*S / (2*(1 - rho)) (Pollaczek-Khinchine). rho = 0.5 and 8,000
    requests put the sample mean within 6% of it for every seed tried (1-6), the busy fraction
    within 1%."""
    cfg = SimConfig(max_num_seqs=1, enable_prefix_caching=False, **UNBOUNDED)
    input_tokens, output_tokens, rho, n = 128, 4, 0.5, 8000
    service = service_time_alone(cfg, input_tokens, output_tokens)
    lam = rho / service
    wl = SyntheticConfig(num_requests=n, request_rate=lam, input_len=input_tokens,
                         output_len=output_tokens, seed=1)
    result = simulate(cfg, synthetic_trace(wl))
    records, steps = result.records, result.steps
    assert len(records) == n
    # Deterministic service: first schedule to finish is S for every request.
    assert all(math.isclose(r.finish_time - r.first_scheduled_time, service, rel_tol=1e-9)
               for r in records)
    horizon = max(r.finish_time for r in records)
    busy = sum(s.duration for s in steps) / horizon
    assert busy == pytest.approx(rho, rel=0.04)
    mean_wait = sum(r.queue_time for r in records) / n
    assert mean_wait == pytest.approx(rho * service / (2 * (1 - rho)), rel=0.15)
    # Little: L, the time average of the engine's own counts over its steps (idle time counts 0),
    # against lambda * W from the requests' timestamps. ``num_waiting`` is read at the end of a
    # step, so a request arriving during a step of length d is counted from its start: d/2 too
    # early on average, which adds lambda * sum(d^2) / 2 to the integral (~4% here); removed, the
    # two agree to ~0.1% for seeds 1-6.
    lam_measured = n / horizon
    counted = sum(s.duration * (s.num_seqs + s.num_waiting) for s in steps)
    early = lam_measured * sum(s.duration ** 2 for s in steps) / 2
    in_system = (counted - early) / horizon
    mean_sojourn = sum(r.e2el for r in records) / n
    assert in_system == pytest.approx(lam_measured * mean_sojourn, rel=0.01)


# ---- (d) prefix caching ----------------------------------------------------------------------
def test_prefix_caching_cuts_ttft_on_a_shared_system_prompt() -> None:
    wl = SyntheticConfig(num_requests=150, request_rate=5.0, input_len=64, output_len=16,
                         prefix_len=2048, seed=1)
    trace = synthetic_trace(wl)
    on = simulate(SimConfig(enable_prefix_caching=True), trace).summary
    off = simulate(SimConfig(enable_prefix_caching=False), trace).summary
    assert on["prefix_cache_hit_rate"] > 0.9
    assert off["prefix_cache_hit_rate"] == 0.0
    assert on["mean_ttft_ms"] < off["mean_ttft_ms"] / 3


# ---- (e) chunked prefill ---------------------------------------------------------------------
def test_chunked_prefill_lowers_p99_itl_on_a_mixed_workload() -> None:
    """Long prompts (300-5,700 tokens) keep arriving while earlier requests decode: an unchunked
    prompt stalls every decode for its whole prefill; 512-token chunks bound the stall."""
    wl = SyntheticConfig(num_requests=200, request_rate=6.0, input_len=3000, output_len=150,
                         range_ratio=0.9, seed=2)
    trace = synthetic_trace(wl)
    chunked = simulate(SimConfig(max_model_len=8192, max_num_batched_tokens=512), trace).summary
    whole = simulate(SimConfig(max_model_len=8192, max_num_batched_tokens=8192,
                               enable_chunked_prefill=False), trace).summary
    assert chunked["completed"] == whole["completed"] == 200
    assert chunked["p99_itl_ms"] < whole["p99_itl_ms"] / 3


# ---- (f) fairness: VTC against FCFS ----------------------------------------------------------
def _queue_lengths(records: list[RequestRecord], tenant: str, times: list[float]) -> list[int]:
    """Waiting (arrived, not yet admitted) requests of ``tenant`` at each of ``times``."""
    arrivals = sorted(r.arrival_time for r in records if r.tenant == tenant)
    admits = sorted(r.first_scheduled_time for r in records if r.tenant == tenant)
    return [bisect.bisect_right(arrivals, t) - bisect.bisect_right(admits, t) for t in times]


def backlogged_service(result: SimResult, tenants: tuple[str, str]) -> list[tuple[float, float]]:
    """Cumulative service (prefill + 2 * output tokens, VTC's weights) of two tenants after each
    step of the longest stretch during which both had requests waiting at the step start."""
    steps: list[StepRecord] = result.steps
    times = [s.time for s in steps]
    queues = [_queue_lengths(result.records, t, times) for t in tenants]
    both = [qa > 0 and qb > 0 for qa, qb in zip(*queues)]
    best: tuple[int, int] = (0, 0)
    start = None
    for i, flag in enumerate([*both, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            best = max(best, (start, i), key=lambda se: se[1] - se[0])
            start = None
    cum = [0.0, 0.0]
    out = []
    for s in steps[best[0]:best[1]]:
        for k, tenant in enumerate(tenants):
            p, o = s.tenant_tokens.get(tenant, (0, 0))
            cum[k] += p + 2 * o
        out.append((cum[0], cum[1]))
    return out


def _fair_trace(rates: dict[str, float], n: int) -> list[TraceRequest]:
    return synthetic_trace(SyntheticConfig(num_requests=n, tenant_rates=rates, input_len=256,
                                           output_len=64, range_ratio=0.5, seed=3))


def test_vtc_bounds_the_service_gap_between_backlogged_tenants() -> None:
    """Both tenants flood (60 and 30 req/s against ~40 req/s of capacity): FCFS serves them in
    proportion to their rates, so the gap grows with time; VTC serves them equally, the gap stays
    within a batch's worth of requests (max_num_seqs * the largest request's service)."""
    trace = _fair_trace({"heavy": 60.0, "light": 30.0}, 1000)
    max_service = max(tr.input_tokens + 2 * tr.output_tokens for tr in trace)
    gaps, jains = {}, {}
    for policy in ("fcfs", "fair"):
        cfg = SimConfig(scheduling_policy=policy, max_num_seqs=16, **UNBOUNDED)
        service = backlogged_service(simulate(cfg, trace), ("heavy", "light"))
        assert len(service) > 500  # a long backlogged stretch
        gaps[policy] = max(abs(a - b) for a, b in service)
        jains[policy] = jain_index(list(service[-1]))
    assert gaps["fair"] <= cfg.engine.max_num_seqs * max_service
    assert gaps["fcfs"] > 5 * cfg.engine.max_num_seqs * max_service
    assert jains["fair"] > 0.99 and jains["fair"] > jains["fcfs"]


def test_vtc_shields_a_light_tenant_from_a_flooding_one() -> None:
    trace = _fair_trace({"heavy": 120.0, "light": 10.0}, 600)
    light_ttft = {}
    for policy in ("fcfs", "fair"):
        records = simulate(SimConfig(scheduling_policy=policy, max_num_seqs=16, **UNBOUNDED),
                           trace).records
        light = [r.ttft for r in records if r.tenant == "light"]
        light_ttft[policy] = sum(light) / len(light)
    assert light_ttft["fcfs"] > 5.0  # seconds: stuck behind the heavy tenant's backlog
    assert light_ttft["fair"] < light_ttft["fcfs"] / 20


# ---- (g) replicas and routing ----------------------------------------------------------------
def test_two_round_robin_replicas_double_saturated_throughput() -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=400, input_len=256, output_len=64,
                                            range_ratio=0.5, seed=4))  # all at t=0
    one = run_engines(SimConfig(max_num_seqs=32, **UNBOUNDED), trace)
    two = run_engines(SimConfig(max_num_seqs=32, num_replicas=2, **UNBOUNDED), trace)
    assert_conserved(trace, two.recorder.requests)
    assert_no_leaks(two)

    def makespan(run: EngineRun) -> float:
        return max(r.finish_time for r in run.recorder.requests)

    assert 1.7 < makespan(one) / makespan(two) < 2.1  # throughput ratio at saturation
    # Round-robin: replica i served exactly the requests i, i + 2, i + 4, ... of the trace.
    for i, replica in enumerate(two.replicas):
        mine = trace[i::2]
        assert replica.scheduler.num_generation_tokens == sum(tr.output_tokens for tr in mine)
        assert replica.scheduler.num_prompt_tokens == sum(tr.input_tokens for tr in mine)
    assert {s.replica for s in two.recorder.steps} == {0, 1}


def _multi_prefix_trace(n: int, groups: int, prefix_tokens: int, rate: float,
                        seed: int) -> list[TraceRequest]:
    """``groups`` distinct system prompts of ``prefix_tokens`` tokens, drawn uniformly."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(rate)
        out.append(TraceRequest(f"mp-{i}", t, prefix_tokens + 64, 32,
                                prefix_blocks=(1000 + rng.randrange(groups),),
                                prefix_block_tokens=prefix_tokens))
    return out


def test_prefix_affinity_routing_beats_round_robin_on_cache_hits() -> None:
    """8 prompts of 1,024 tokens (64 blocks each) against 400 blocks per replica: round-robin
    makes both replicas cycle through all 8 and evict; affinity gives each replica about half."""
    trace = _multi_prefix_trace(400, groups=8, prefix_tokens=1024, rate=20.0, seed=5)
    hit = {}
    for router in ("round-robin", "prefix-affinity"):
        cfg = SimConfig(num_replicas=2, router=router, num_gpu_blocks_override=400)
        summary = simulate(cfg, trace).summary
        assert summary["completed"] == len(trace)
        hit[router] = summary["prefix_cache_hit_rate"]
    assert hit["prefix-affinity"] > hit["round-robin"] + 0.15
    assert hit["prefix-affinity"] > 0.8


# ---- (h) preemption under memory pressure ----------------------------------------------------
@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_memory_starved_engine_completes_everything_with_preemptions(mode: str) -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=300, input_len=256, output_len=64,
                                            range_ratio=0.5, seed=4))
    cfg = SimConfig(preemption_mode=mode, num_gpu_blocks_override=200, max_num_seqs=64,
                    **UNBOUNDED)
    run = run_engines(cfg, trace)
    records = run.recorder.requests
    assert_conserved(trace, records)
    assert_no_leaks(run)
    assert sum(r.num_preemptions for r in records) > 0
    assert sum(s.num_preempted for s in run.recorder.steps) == \
        sum(r.num_preemptions for r in records)
    if mode == "swap":
        assert run.block_ops["swap_out"] > 0
        assert run.block_ops["swap_in"] == run.block_ops["swap_out"]
    else:
        assert run.block_ops["swap_out"] == run.block_ops["swap_in"] == 0
        # recomputation: more prefill work than prompt tokens
        assert sum(s.num_prefill_tokens for s in run.recorder.steps) > \
            sum(tr.input_tokens for tr in trace)


# ---- static batching -------------------------------------------------------------------------
def _run_unit(sched: Scheduler, max_steps: int = 1000) -> dict[str, tuple[int, int]]:
    """Steps each request was first scheduled and finished in."""
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    for k in range(max_steps):
        if not sched.has_unfinished_requests():
            return {rid: (first[rid], done[rid]) for rid in first}
        out, outs = step(sched, float(k))
        for sr in out.scheduled:
            first.setdefault(sr.request_id, k)
        for o in outs:
            if o.finished:
                done[o.request_id] = k
    raise AssertionError("requests did not finish")


def test_static_batch_of_two_waits_for_its_longest_member() -> None:
    sched = make_scheduler(policy="static", policy_options={"batch_size": 2})
    for rid, n in (("a", 1), ("b", 10), ("c", 1), ("d", 1), ("e", 3)):
        sched.add_request(make_req(rid, 8, max_tokens=n))
    spans = _run_unit(sched)
    assert spans["a"][0] == spans["b"][0] == 0
    assert spans["a"][1] == 0  # a is done at once, yet its slot idles ...
    assert spans["c"][0] == spans["d"][0] == spans["b"][1] + 1  # ... until b ends
    assert spans["e"][0] == max(spans["c"][1], spans["d"][1]) + 1


def test_static_default_batch_is_as_many_as_fit() -> None:
    sched = make_scheduler(max_num_seqs=3, policy="static")
    for rid, n in (("a", 1), ("b", 2), ("c", 6), ("d", 1), ("e", 1)):
        sched.add_request(make_req(rid, 8, max_tokens=n))
    spans = _run_unit(sched)
    assert spans["a"][0] == spans["b"][0] == spans["c"][0] == 0  # three seats: three members
    assert spans["d"][0] == spans["e"][0] == spans["c"][1] + 1


def test_static_late_arrivals_wait_for_the_next_batch() -> None:
    sched = make_scheduler(policy="static")
    sched.add_request(make_req("first", 8, max_tokens=6))
    out, _ = step(sched, 0.0)
    sched.add_request(make_req("late", 8, max_tokens=1, arrival=0.5))
    for k in range(1, 5):
        out, _ = step(sched, float(k))
        assert [sr.request_id for sr in out.scheduled] == ["first"]
    out, outs = step(sched, 5.0)
    assert outs[0].request_id == "first" and outs[0].finished
    out, _ = step(sched, 6.0)
    assert [sr.request_id for sr in out.scheduled] == ["late"]


def test_static_aborts_leave_the_queue_and_the_batch_consistent() -> None:
    sched = make_scheduler(policy="static", policy_options={"batch_size": 2})
    for rid, n in (("a", 3), ("b", 3), ("c", 1), ("d", 1)):
        sched.add_request(make_req(rid, 8, max_tokens=n))
    step(sched, 0.0)  # a and b form the batch
    sched.abort_requests(["c", "b"], 0.5)  # a waiting request and a running member
    assert sched.num_waiting == 1
    out, _ = step(sched, 1.0)
    assert [sr.request_id for sr in out.scheduled] == ["a"]
    spans = _run_unit(sched)
    assert list(spans) == ["a", "d"] and spans["d"][0] == spans["a"][1] + 1


def test_static_policy_validates_batch_size_and_is_registered() -> None:
    assert available_policies()["static"] is StaticBatchingPolicy
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            get_policy("static", batch_size=bad)


def test_static_in_simulation_batches_never_grow_and_lose_to_continuous_batching(
        azure_conv: list[TraceRequest]) -> None:
    trace = at_once(first_n(azure_conv, 200))
    static = simulate(SimConfig(scheduling_policy="static", policy_options={"batch_size": 16},
                                max_num_seqs=64, **UNBOUNDED), trace)
    assert_conserved(trace, static.records)
    assert batches_by_overlap(static.records) == [16] * 12 + [8]
    continuous = simulate(SimConfig(max_num_seqs=16, **UNBOUNDED), trace)
    assert batches_by_overlap(continuous.records) == [200]
    assert continuous.summary["output_throughput"] > 1.3 * static.summary["output_throughput"]


def test_static_preempted_members_rejoin_their_batch() -> None:
    trace = synthetic_trace(SyntheticConfig(num_requests=200, input_len=256, output_len=64,
                                            range_ratio=0.5, seed=4))
    run = run_engines(SimConfig(scheduling_policy="static", num_gpu_blocks_override=200,
                                **UNBOUNDED), trace)
    assert_conserved(trace, run.recorder.requests)
    assert_no_leaks(run)
    assert sum(r.num_preemptions for r in run.recorder.requests) > 0


# ---- (i) unknown names -----------------------------------------------------------------------
TINY = [TraceRequest("t-0", 0.0, 8, 2)]


@pytest.mark.parametrize("field, value, listed", [
    ("scheduling_policy", "lifo", ["fcfs", "fair", "priority", "sjf", "static"]),
    ("model", "gpt-9", ["llama-3-8b", "smollm2-135m"]),
    ("hardware", "tpu-v9", ["h100-sxm", "a100-80gb"]),
])
def test_unknown_names_raise_value_error_listing_the_valid_ones(field: str, value: str,
                                                                listed: Iterable[str]) -> None:
    with pytest.raises(ValueError) as info:
        simulate(SimConfig(**{field: value}), TINY)
    message = str(info.value)
    assert value in message
    assert all(name in message for name in listed)


def test_unknown_router_and_preemption_mode_raise_value_error() -> None:
    with pytest.raises(ValueError, match="round-robin.*prefix-affinity"):
        SimConfig(router="random")
    with pytest.raises(ValueError, match="recompute"):
        simulate(SimConfig(preemption_mode="drop"), TINY)


def test_step_log_reads_back_the_step_records_it_was_given() -> None:
    from twinserve.core.metrics import StepLog
    records = [StepRecord(0.5 * k, 0.25, k, 2 * k, k + 1, 3, k % 2, 0.125 * k, 0, k % 3,
                          {"t": (k, 1)} if k % 2 else {}) for k in range(5)]
    log = StepLog(records)
    assert len(log) == 5 and list(log) == records and log[-1] == records[-1]
    assert log[1:3] == records[1:3] and log.column("num_seqs") == [0, 1, 2, 3, 4]
    with pytest.raises(IndexError):
        log[5]


def test_simulated_steps_are_a_step_log_matching_the_schedule() -> None:
    trace = [TraceRequest(f"r{i}", 0.01 * i, 40, 5) for i in range(6)]
    result = simulate(SimConfig(num_gpu_blocks_override=64), trace)
    assert sum(result.steps.column("num_seqs")) == sum(s.num_seqs for s in result.steps)
    assert sum(result.steps.column("num_decode_tokens")) == 6 * 4  # first tokens come from prefill
    assert all(isinstance(s, StepRecord) for s in result.steps)


def _one_event_per_step(env: simpy.Environment, replica: Replica):
    """The engine loop as the design states it, one SimPy timeout per step: the reference that
    ``engine_process`` (which skips the events no other process could observe) must match."""
    driver = replica.driver
    while True:
        if not driver.scheduler.has_unfinished_requests():
            replica.wakeup = env.event()
            yield replica.wakeup
            replica.wakeup = None
        start = env.now
        out = driver.schedule(start)
        result = driver.execute(replica.tokens, out)
        yield env.timeout(replica.cost.step_time(out))
        driver.complete(out, result, start, env.now)


def _replay(cfg: SimConfig, trace: list[TraceRequest], engine) -> tuple[list, list]:
    recorder = run_engines(cfg, trace, engine).recorder
    records = [dataclasses.astuple(r) for r in recorder.requests]
    return records, [dataclasses.astuple(s) for s in recorder.steps]


@pytest.mark.parametrize("num_replicas", [1, 3])
def test_engine_clock_running_ahead_of_simpy_matches_one_event_per_step(num_replicas: int) -> None:
    # Arrivals at 0, within a step of 0, in ties, in bursts and after idle gaps, and (second run)
    # exactly at step ends: every step time and record must be the same floats.
    rng = random.Random(7)
    times = [0.0, 0.0, 1e-9, 3e-4, 3e-4, 0.004]
    while len(times) < 160:
        times.append(times[-1] + rng.choice([0.0, 1e-6, rng.expovariate(40.0), 2.5]))
    trace = [TraceRequest(f"r{i}", t, rng.randint(1, 700), rng.randint(1, 90))
             for i, t in enumerate(times)]
    cfg = SimConfig(num_replicas=num_replicas, num_gpu_blocks_override=300)
    records, steps = _replay(cfg, trace, _one_event_per_step)
    assert _replay(cfg, trace, engine_process) == (records, steps)
    ends = sorted({s[0] + s[1] for s in steps})  # StepRecord starts with time, duration
    ties = [TraceRequest(f"tie{k}", ends[k], 50, 20) for k in (5, 40, 200)]
    trace = sorted(trace + ties, key=lambda tr: tr.arrival_time)
    assert _replay(cfg, trace, engine_process) == _replay(cfg, trace, _one_event_per_step)


# ---- admission: a server's twin says "not now" -------------------------------------------------
def test_a_flood_beyond_the_waiting_bounds_is_refused_and_counted() -> None:
    """Everything arrives at once: the free seats (max_num_seqs) and a queue of 4 x max_num_seqs
    (the server's default bound) take 20, the rest fail at arrival with the overload error, and
    the summary counts them as failed."""
    trace = [TraceRequest(f"r{i}", 0.0, 32, 4) for i in range(100)]
    result = simulate(SimConfig(**SMALL, max_num_seqs=4), trace)
    refused = [r for r in result.records if not r.success]
    assert len(refused) == 100 - 4 - 4 * 4
    assert all("overloaded" in r.error and "max_waiting_requests" in r.error for r in refused)
    assert (result.summary["completed"], result.summary["failed"]) == (20, 80)
    offline = simulate(SimConfig(**SMALL, max_num_seqs=4, usage_context="llm"), trace)
    assert offline.summary["completed"] == 100  # offline use queues without bound


def test_waiting_tokens_bound_refuses_only_while_others_wait() -> None:
    trace = [TraceRequest("big", 0.0, 600, 2), TraceRequest("next", 0.0, 600, 2),
             TraceRequest("later", 5.0, 600, 2)]
    result = simulate(SimConfig(**SMALL, max_waiting_tokens=1000), trace)
    by_id = {r.request_id: r for r in result.records}
    assert by_id["big"].success and by_id["later"].success  # an empty queue takes any request
    assert not by_id["next"].success and "max_waiting_tokens" in by_id["next"].error
