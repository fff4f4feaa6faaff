"""The twin's fast path (``core.decode_run``: runs of decode-only steps advanced in one call)
against its reference, the step-by-step loop: the same request records and step rows, float for
float, across the features a run must respect (prefix caching, sliding windows, preemption by
recompute and swap, tenants, priorities, replicas, structured-output costs), and runs that do
happen (a fast path never taken would pass any comparison)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from core_helpers import fake_execute, make_req, make_scheduler, step
from hypothesis import given, settings
from hypothesis import strategies as st

from twinserve.core import decode_run
from twinserve.core.decode_run import DecodeRun, plan_decode_run
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler
from twinserve.simulator import SimConfig, SimResult, simulate
from twinserve.simulator.structured_cost import StructuredWorkload
from twinserve.traces import SyntheticConfig, TraceRequest, first_n, load_trace, synthetic_trace

SMALL = {"model": "smollm2-135m", "hardware": "a100-80gb"}
# Llama-3-8B on the H100's plain roofline (the default before the default moved to a measured
# fit): decode runs need a plain roofline, and these figures were set on it
ROOFLINE = {"model": "llama-3-8b", "hardware": "h100-sxm"}
TOKEN = 17


def _rows(result: SimResult) -> tuple[list, list]:
    """Request records (nan as a marker: nan != nan) and step rows."""
    def marked(value):
        return "nan" if isinstance(value, float) and math.isnan(value) else value
    records = [tuple(map(marked, dataclasses.astuple(r))) for r in result.records]
    return records, [dataclasses.astuple(s) for s in result.steps]


def _assert_same(monkeypatch: pytest.MonkeyPatch, cfg: SimConfig, trace: list[TraceRequest],
                 min_share: float, **kw) -> None:
    """The fast path's results equal the reference's, and at least ``min_share`` of the steps
    were advanced inside decode runs."""
    reference = _rows(simulate(cfg, trace, decode_runs=False, **kw))
    in_runs = [0]
    apply, close = DecodeRun.apply, DecodeRun.close

    def counting_apply(self: DecodeRun, ends: list[float]) -> list[int]:
        in_runs[0] += len(ends)
        return apply(self, ends)

    def counting_close(self: DecodeRun, ends: list[float]) -> None:
        in_runs[0] += len(ends)
        close(self, ends)

    monkeypatch.setattr(decode_run.DecodeRun, "apply", counting_apply)
    monkeypatch.setattr(decode_run.DecodeRun, "close", counting_close)
    fast = simulate(cfg, trace, **kw)
    assert _rows(fast) == reference
    assert in_runs[0] >= min_share * len(fast.steps), (in_runs[0], len(fast.steps))


@pytest.fixture(scope="module")
def azure_slice() -> list[TraceRequest]:
    return first_n(load_trace("azure-conv"), 300)


def test_default_replay_of_an_azure_slice(monkeypatch, azure_slice) -> None:
    _assert_same(monkeypatch, SimConfig(**ROOFLINE), azure_slice, 0.5)


def test_a_lone_replica_schedules_in_full_only_the_steps_that_admit(monkeypatch,
                                                                     azure_slice) -> None:
    # runs end at finishes and take in the step an arrival comes during, then the step after,
    # which admits it beside their decodes (the run's closing step): nearly every step that
    # schedules in full or closes a run takes in a prompt (the rest: first decodes starting a
    # block), and most prompts come in closing steps
    calls = {"schedule": 0, "schedule_beside_run": 0}

    def counting(name: str):
        method = getattr(Scheduler, name)

        def counted(self: Scheduler, *args):
            calls[name] += 1
            return method(self, *args)
        return counted

    for name in calls:
        monkeypatch.setattr(Scheduler, name, counting(name))
    result = simulate(SimConfig(**ROOFLINE), azure_slice)
    prefills = sum(1 for s in result.steps if s.num_prefill_tokens)
    full, closing = calls["schedule"], calls["schedule_beside_run"]
    assert prefills <= full + closing <= prefills + 0.1 * len(azure_slice)
    assert closing > 2 * full
    assert len(result.steps) > 20 * (full + closing)


@pytest.mark.parametrize("changes", [
    {"enable_prefix_caching": False},
    {"num_gpu_blocks_override": 400, "preemption_mode": "recompute"},
    {"num_gpu_blocks_override": 400, "preemption_mode": "swap", "swap_space": 1},
    {"max_num_seqs": 8, "max_num_batched_tokens": 512},
    {"num_replicas": 3, "router": "least-outstanding"},
], ids=["no-prefix-cache", "recompute", "swap", "small-batches", "replicas"])
def test_engine_settings(monkeypatch, azure_slice, changes) -> None:
    _assert_same(monkeypatch, SimConfig(**SMALL).replace(**changes), azure_slice[:120], 0.3)


def test_sliding_window_model_frees_blocks_inside_runs(monkeypatch) -> None:
    # Mistral's 4,096-token window, outputs long enough to cross it: blocks are dropped in runs
    trace = [TraceRequest(f"r{i}", 0.5 * i, 3000 + 97 * i, 1500) for i in range(6)]
    _assert_same(monkeypatch, SimConfig(model="mistral-7b-v0.1", hardware="h100-sxm"), trace, 0.9)


def test_two_tenants_under_fair_and_priorities_under_priority(monkeypatch) -> None:
    tenants = synthetic_trace(SyntheticConfig(num_requests=100, input_len=300, output_len=120,
                                              range_ratio=0.5,
                                              tenant_rates={"heavy": 30.0, "light": 10.0}))
    _assert_same(monkeypatch, SimConfig(scheduling_policy="fair", **SMALL), tenants, 0.3)
    ranked = synthetic_trace(SyntheticConfig(num_requests=100, request_rate=40.0, input_len=300,
                                             output_len=120, range_ratio=0.5,
                                             priorities={0: 1.0, 1: 2.0}))
    _assert_same(monkeypatch, SimConfig(scheduling_policy="priority", **SMALL), ranked, 0.3)


def test_structured_output_mask_costs(monkeypatch, azure_slice) -> None:
    _assert_same(monkeypatch, SimConfig(**ROOFLINE), azure_slice[:120], 0.5,
                 structured=StructuredWorkload(0.5))


# ---- when a run may start, and how far it goes --------------------------------------------
def _decoding(num: int = 2, max_tokens: int = 10, num_blocks: int = 64,
              stop_token_ids: tuple[int, ...] = ()):
    """``num`` requests of 20 prompt tokens in 4-token blocks, after their prefill and first
    decode: every running request has its decode entry, 21 tokens computed, 2 out."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            stop_token_ids=list(stop_token_ids),
                            min_tokens=3 if stop_token_ids else 0)
    for i in range(num):
        sched.add_request(make_req(f"r{i}", 20, params=params))
    step(sched, 0.0, TOKEN)
    step(sched, 0.01, TOKEN)
    return sched


def test_a_run_covers_the_steps_up_to_the_last_finish() -> None:
    sched = _decoding(max_tokens=10)
    run = plan_decode_run(sched, TOKEN)
    assert run is not None and run.max_steps == 10 - 2  # the finishing step included
    assert run.lefts == [8, 8] and run.stops == [8]
    assert (run.out.num_decode_seqs, run.out.total_num_scheduled_tokens) == (2, 2)
    assert run.out.sum_decode_context_tokens == 2 * 22  # each decode attends to 21 + 1 positions
    run.next_step()
    assert (run.out.sum_context_tokens, run.out.max_decode_context) == (2 * 23, 23)


def _three_lengths(caching: bool = True):
    """r0 (8 tokens), r1 (13) and r2 (13) after two steps in 4-token blocks: r0 (19 prompt
    tokens) and r1 (30) have decoded once, r2 (25) finished its prompt in the second step."""
    sched = make_scheduler(num_blocks=64, block_size=4, enable_prefix_caching=caching)
    for rid, prompt, out in (("r0", 19, 8), ("r1", 30, 13), ("r2", 25, 13)):
        sched.add_request(make_req(rid, prompt, out))
    step(sched, 0.0, TOKEN)
    step(sched, 0.01, TOKEN)
    return sched


@pytest.mark.parametrize("path", ["at-once", "in-order"])
@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("k", [4, 6, 8, 11, 12])
def test_a_runs_segments_end_their_requests_as_the_steps_would(monkeypatch, path: str,
                                                               caching: bool, k: int) -> None:
    if path == "in-order":  # the per-event order: finishes are events of their steps
        monkeypatch.setattr(DecodeRun, "_block_events_at_once", lambda self, k, limits: None)
    fast, reference = _three_lengths(caching), _three_lengths(caching)
    run = plan_decode_run(fast, TOKEN)
    assert run is not None and run.lefts == [6, 11, 12] and run.stops == [6, 11, 12]
    assert run.max_steps == 12 and run.segment_steps() == 6
    run.next_steps(6)
    run.next_segment()  # r0 leaves: the two others at their 7th step
    assert run.out.num_decode_seqs == 2 and run.out.sum_context_tokens == 31 + 25 + 2 * 7
    assert run.out.max_decode_context == 31 + 7 and run.segment_steps() == 5
    ends = [0.02 + 0.01 * (j + 1) for j in range(k)]
    free_after = run.apply(ends)
    segments = run.segments(k)
    finished = []
    for j, end in enumerate(ends):
        out = reference.schedule(end - 0.01)
        (batch,) = [rs for a, b, rs, _ in segments if a <= j < b]
        assert [sr.request_id for sr in out.scheduled] == [r.request_id for r in batch]
        finished += [o.request_id for o in
                     reference.update_from_output(out, fake_execute(out, TOKEN), end)
                     if o.finished]
        assert reference.kv.num_free_blocks == free_after[j]
    assert [r.request_id for r in run.finished] == finished
    assert [r.finish_time for r in run.finished] == [ends[j] for j in (5, 10, 11) if j < k]
    expected, first = [], 0
    for stop, names in ((6, ["r0", "r1", "r2"]), (11, ["r1", "r2"]), (12, ["r2"])):
        end = min(stop, k)
        expected.append((first, end, names, int(end == stop)))
        if end == k:
            break
        first = end
    assert [(a, b, [r.request_id for r in rs], m) for a, b, rs, m in segments] == expected
    assert _kv_state(fast) == _kv_state(reference)
    assert fast._finished_ids == reference._finished_ids
    fast.kv.check_consistency()


def test_a_run_that_accounts_tokens_ends_at_its_first_finish() -> None:
    sched = make_scheduler(num_blocks=64, block_size=4, policy="fair")
    for rid, out in (("r0", 8), ("r1", 13)):
        sched.add_request(make_req(rid, 19, out))
    step(sched, 0.0, TOKEN)
    step(sched, 0.01, TOKEN)
    run = plan_decode_run(sched, TOKEN)
    assert run is not None and run.max_steps == 6 and run.stops == [6]


def test_a_run_cut_short_by_the_blocks_finishes_nothing() -> None:
    sched = _decoding(max_tokens=40, num_blocks=16)
    run = plan_decode_run(sched, TOKEN)
    assert run is not None and run.max_steps < 40 - 2 and run.stops == [run.max_steps]
    run.apply([0.02 + 0.01 * j for j in range(run.max_steps)])
    assert run.finished == [] and len(sched.running) == 2


@pytest.mark.parametrize("blocker", ["waiting", "stop-token", "multi-sample"])
def test_no_run_when_the_next_step_may_differ(blocker: str) -> None:
    sched = _decoding(max_tokens=10, stop_token_ids=(TOKEN,) if blocker == "stop-token" else ())
    token = TOKEN
    if blocker == "waiting":
        sched.add_request(make_req("late", 20))
    elif blocker == "multi-sample":
        sched.add_request(make_req("forked", 20, params=SamplingParams(n=2)))
        sched.finish_requests(["forked"], 0.02)  # gone, but an n > 1 request was seen
    assert plan_decode_run(sched, token) is None


def test_a_run_stops_where_the_free_blocks_end() -> None:
    sched = _decoding(max_tokens=40, num_blocks=16)
    free = sched.kv.num_free_blocks
    assert free == 16 - 2 * 6  # 5 prompt blocks and the block of position 20 each
    run = plan_decode_run(sched, TOKEN)
    assert run is not None
    # both start a block when position 24, 28, ... comes (steps 3, 7, ...): 2 blocks per 4 steps
    assert run.max_steps == 3 + 4 * (free // 2) < 40 - 2
    run.apply([0.02 + 0.01 * k for k in range(run.max_steps)])
    sched.kv.check_consistency()
    assert sched.kv.num_free_blocks == 0
    assert all(r.num_computed_tokens == 21 + run.max_steps
               and len(r.all_token_ids) == 22 + run.max_steps for r in sched.running)
    assert plan_decode_run(sched, TOKEN) is None  # the next step needs a block: no run


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 17).flatmap(lambda bs: st.tuples(
    st.just(bs), st.lists(st.tuples(st.integers(0, bs - 1), st.integers(0, 90)), max_size=14),
    st.integers(0, 200))))
def test_the_kth_block_start_is_the_sorted_starts_kth(case) -> None:
    """The step at which the free blocks run out, by rounds of ``block_size`` steps, is the
    sorted list of every block start's (the reference), past the last start too (None)."""
    bs, requests, k = case
    firsts, ends = [f for f, _ in requests], [e for _, e in requests]
    assert decode_run.kth_block_start(firsts, ends, bs, k) == \
        decode_run._kth_block_start_plain(firsts, ends, bs, k)


def _kv_state(sched) -> tuple:
    """Everything a later step could observe of the KV cache and the requests."""
    pool = sched.kv.pool
    return (sorted((h, b.block_id) for h, b in pool.cached.items()),
            [b.block_id for b in pool.free_queue],
            {rid: list(t.ids) for rid, t in sched.kv.tables.items()},
            [(r.request_id, r.num_computed_tokens, list(r.all_token_ids), r.token_times.times(),
              list(r.block_hashes), r.decode_entry and r.decode_entry.start,
              # (an entry's block ids are its table's live list, which the run's blocks join)
              r.decode_entry is None or r.decode_entry.block_ids is sched.kv.tables[r.request_id].ids)
             for r in sched.running],
            sched.num_generation_tokens)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("first_decode", [True, False], ids=["first-decode", "decoding"])
def test_apply_leaves_the_scheduler_as_the_steps_would(caching: bool, first_decode: bool) -> None:
    # mixed positions in 4-token blocks, a cache with cached-but-free blocks to evict; the run
    # starts right after the prefills (making the decode entries) or after a decode step
    def build():
        sched = make_scheduler(num_blocks=60, block_size=4, max_num_batched_tokens=128,
                               enable_prefix_caching=caching)
        lengths = [(13, 45 if first_decode else 3), (21, 40), (18, 35), (30, 50), (9, 44)]
        for i, (prompt, out) in enumerate(lengths):
            sched.add_request(make_req(f"r{i}", prompt, out))
        step(sched, 0.0, TOKEN)  # every prefill at once: 4 decodes ahead, none with an entry
        now = 0.01
        if not first_decode:
            while len(sched.running) != 4:  # r0 finishes after its third token
                step(sched, now, TOKEN)
                now += 0.01
        assert all((r.decode_entry is None) == first_decode for r in sched.running)
        return sched, now

    reference, now = build()
    fast, _ = build()
    run = plan_decode_run(fast, TOKEN)
    assert run is not None and run.max_steps >= 12 and len(fast.running) == 4 + first_decode
    ends = [now + 0.01 * (k + 1) for k in range(12)]
    free_after = run.apply(ends)
    for end in ends:
        out = reference.schedule(end - 0.01)
        assert out.num_decode_seqs == out.total_num_scheduled_tokens == len(reference.running)
        reference.update_from_output(out, fake_execute(out, TOKEN), end)
        assert reference.kv.num_free_blocks == free_after[ends.index(end)]
    assert _kv_state(fast) == _kv_state(reference)
    fast.kv.check_consistency()


# ---- the run's block events at once against their step-by-step order -----------------------
def _pool_state(sched) -> tuple:
    pool = sched.kv.pool
    return (_kv_state(sched), pool.num_evictions,
            {rid: t.num_cached_blocks for rid, t in sched.kv.tables.items()})


def _shared_prompts(twins: bool):
    """Five decoding requests in 4-token blocks with mixed positions and cached-but-free blocks
    to evict (a finished request's); ``twins``: two of them with one prompt, decoding together
    (their new blocks share hashes), and a third with that prompt too, finished before (its
    cached blocks hold those hashes)."""
    sched = make_scheduler(num_blocks=52 if twins else 56, block_size=4,
                           max_num_batched_tokens=256)
    shared = [5000 + i for i in range(17)]
    lengths = [(13, 45), (21, 40), (17, 35), (30, 50), (17, 44)]
    sched.add_request(make_req("early", 17, 30, prefix=shared if twins else None))
    now = 0.0
    while sched.has_unfinished_requests():
        step(sched, now, TOKEN)
        now += 0.01
    for i, (prompt, out) in enumerate(lengths):
        twin = twins and prompt == 17
        sched.add_request(make_req(f"r{i}", prompt, out, prefix=shared if twin else None))
    for _ in range(3):
        step(sched, now, TOKEN)
        now += 0.01
    return sched, now


@pytest.mark.parametrize("twins", [False, True], ids=["distinct", "shared-hashes"])
def test_block_events_at_once_equal_their_step_by_step_order(monkeypatch, twins: bool) -> None:
    taken = []
    at_once = DecodeRun._block_events_at_once

    def watched(self: DecodeRun, k: int, limits: list[int]) -> list[int] | None:
        free_after = at_once(self, k, limits)
        taken.append(free_after is not None)
        return free_after

    results = []
    for path in ("at-once", "in-order"):
        sched, now = _shared_prompts(twins)
        monkeypatch.setattr(DecodeRun, "_block_events_at_once",
                            watched if path == "at-once" else lambda self, k, limits: None)
        run = plan_decode_run(sched, TOKEN)
        assert run is not None and run.max_steps >= 20 and len(sched.running) == 5
        evicted = sched.kv.pool.num_evictions
        free_after = run.apply([now + 0.01 * (k + 1) for k in range(20)])  # 20 > 4-token blocks
        sched.kv.check_consistency()
        assert sched.kv.pool.num_evictions > evicted  # cached blocks were handed out in the run
        results.append((free_after, _pool_state(sched)))
    assert results[0] == results[1]
    assert taken == [not twins]  # equal hashes: the at-once path declines, the reference runs


RUN_CASES = [(12.5, 12.5, 13.0, 500), (7.25, 7.0, 99.0, 50), (3.0, 3.0, 3.001, 500),
             (1e6, 0.1, 2e6, 30)]  # (now, base, horizon, max_steps)


def _run_ends_lengths(cost, n: int, context: int) -> list[int]:
    """``cost.decode_run_ends`` against ``cost.step_time`` step by step, from a decode step of
    ``n`` sequences holding ``context`` tokens, in each of ``RUN_CASES``: equal end times, ``out``
    left as it was. Returns each case's number of steps."""
    run = plan_decode_run(_decoding(num=1), TOKEN)
    assert run is not None
    out = run.out
    out.total_num_scheduled_tokens = out.num_decode_tokens = out.num_decode_seqs = n
    out.sum_context_tokens = out.sum_decode_context_tokens = context
    lengths = []
    for now, base, horizon, max_steps in RUN_CASES:
        saved = (out.sum_context_tokens, out.sum_decode_context_tokens, out.max_decode_context)
        fast = cost.decode_run_ends(out, now, horizon, base, max_steps)
        assert (out.sum_context_tokens, out.sum_decode_context_tokens,
                out.max_decode_context) == saved  # left as it is
        ends, t = [], now
        for _ in range(max_steps):
            end = t + cost.step_time(out)
            if end >= horizon or base + (end - base) != end:
                break
            ends.append(end)
            t = end
            run.next_step()
        assert fast == ends
        lengths.append(len(ends))
        out.sum_context_tokens, out.sum_decode_context_tokens, out.max_decode_context = saved
    return lengths


@pytest.mark.parametrize("hardware", ["a100-80gb", "h200", "random"])
def test_a_fitted_models_run_ends_equal_its_step_time_loop(hardware: str) -> None:
    """The fitted model's decode-run shortcut (``FittedCostModel.decode_run_ends``) against its
    ``step_time`` step by step: the bundled fits, and one with random coefficients on every
    feature (the bundled fits leave some at zero)."""
    import random

    from twinserve.simulator.cost_model import ALL_FEATURE_NAMES, FittedCostModel
    from twinserve.simulator.run import SimConfig, build_engine_config
    cost = build_engine_config(SimConfig(hardware="h200" if hardware == "random" else hardware)
                               ).cost_model
    assert isinstance(cost, FittedCostModel)
    if hardware == "random":
        rng = random.Random(5)
        coefficients = {f: rng.uniform(0.0, 1e-5) for f in ALL_FEATURE_NAMES}
        cost = FittedCostModel(dataclasses.replace(cost.params, coefficients=coefficients),
                               cost.base)
    lengths = [k for n, context in [(1, 900), (37, 37 * 2100), (256, 256 * 700)]
               for k in _run_ends_lengths(cost, n, context)]
    assert min(lengths) == 0 and max(lengths) > 20


def test_a_fitted_profiles_runs_equal_the_step_by_step_reference(
        monkeypatch: pytest.MonkeyPatch, azure_slice: list[TraceRequest]) -> None:
    """The default profile (a measured fit) through whole runs: decode runs give the reference's
    records and steps."""
    _assert_same(monkeypatch, SimConfig(), azure_slice, 0.3)


def test_a_plain_rooflines_run_ends_equal_its_step_time_loop() -> None:
    from twinserve.simulator.cost_model import CostModel
    from twinserve.simulator.run import SimConfig, build_engine_config
    cost = build_engine_config(SimConfig(**ROOFLINE)).cost_model
    assert isinstance(cost, CostModel)
    lengths = []
    for n, context, cap in [(1, 900, 10**6), (37, 37 * 2100, 10**6), (256, 256 * 700, 10**6),
                            (64, 64 * 8100, 8192)]:
        cost._max_context, max_context = cap, cost._max_context  # the n * max_context cap
        try:
            lengths += _run_ends_lengths(cost, n, context)
        finally:
            cost._max_context = max_context
    assert min(lengths) == 0 and max(lengths) > 20  # cut by the horizon, by SimPy's sum, by none
    assert 30 in lengths


# ---- a run's closing step: the admission of the prompts that arrived during it --------------
def _closing_case(caching: bool):
    """Four decodes (one ending inside the run) in 4-token blocks, no prefix cache or one with
    blocks to evict; a prompt arrives for the run's fifth step, which admits it beside them."""
    sched = make_scheduler(num_blocks=60, block_size=4, max_num_batched_tokens=128,
                           enable_prefix_caching=caching)
    for i, (prompt, out) in enumerate([(13, 30), (21, 4), (18, 35), (30, 40)]):
        sched.add_request(make_req(f"r{i}", prompt, out))
    step(sched, 0.0, TOKEN)
    step(sched, 0.01, TOKEN)
    return sched, make_req("late", 23, 5, arrival=0.05)


@pytest.mark.parametrize("caching", [False, True])
def test_a_closing_step_leaves_the_scheduler_as_the_steps_would(caching: bool) -> None:
    reference, late_ref = _closing_case(caching)
    fast, late = _closing_case(caching)
    run = plan_decode_run(fast, TOKEN)
    assert run is not None and run.max_steps > 5
    ends = [0.02 + 0.01 * (k + 1) for k in range(4)]
    fast.add_request(late)  # arrives during the run's fourth step
    free_after = run.open_closing(ends)
    if caching:  # r1's blocks of its own tokens fill inside the run: they would be registered
        assert free_after is None
        return
    # r1 samples its last token in the run's second step: ended before the admission
    assert free_after is not None and run.requests[1] not in fast.running
    for _ in range(4):  # ``out`` to the closing step, as the twin times the steps before
        run.next_step()
        if run.taken == run.stops[run.segment]:
            run.next_segment()
    out = fast.schedule_beside_run(run.out, ends[-1])
    run.close([*ends, ends[-1] + 0.01])
    prompts = dataclasses.replace(out, scheduled=out.scheduled[out.num_decode_seqs:])
    fast.update_from_output(prompts, fake_execute(prompts, TOKEN), ends[-1] + 0.01)
    for k, end in enumerate([*ends, ends[-1] + 0.01]):
        if k == 4:  # (it arrived while step 3 ran: step 4 sees it)
            reference.add_request(late_ref)
        ref_out = reference.schedule(end - 0.01)
        reference.update_from_output(ref_out, fake_execute(ref_out, TOKEN), end)
        if k < 4:
            assert reference.kv.num_free_blocks == free_after[k]
    assert [(f, getattr(out, f)) for f in _AGGREGATES] == \
        [(f, getattr(ref_out, f)) for f in _AGGREGATES]
    assert [sr.request.request_id for sr in out.scheduled] == \
        [sr.request.request_id for sr in ref_out.scheduled]
    assert [r.request_id for r in run.finished] == ["r1"]
    assert _kv_state(fast) == _kv_state(reference)
    fast.kv.check_consistency()


_AGGREGATES = ("total_num_scheduled_tokens", "num_prefill_tokens", "num_prefill_seqs",
               "num_decode_tokens", "num_decode_seqs", "sum_context_tokens",
               "sum_decode_context_tokens", "max_decode_context", "num_prefix_chunks",
               "sum_prefix_context_tokens", "sum_prefill_attention_area")


def test_closing_steps_in_the_default_replay(monkeypatch, azure_slice) -> None:
    # the measured fit, chunked prompts (a small budget) and a round-robin fleet: the same
    # records and rows as step by step, with closing steps taken
    closings = [0]
    beside = Scheduler.schedule_beside_run

    def counted(self: Scheduler, decodes, now: float):
        closings[0] += 1
        return beside(self, decodes, now)

    monkeypatch.setattr(Scheduler, "schedule_beside_run", counted)
    for cfg in (SimConfig(), SimConfig(max_num_batched_tokens=512),
                SimConfig(num_replicas=2, router="round-robin")):
        closings[0] = 0
        _assert_same(monkeypatch, cfg, azure_slice, 0.3)
        assert closings[0] > 20, cfg
