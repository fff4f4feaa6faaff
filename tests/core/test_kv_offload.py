"""The host KV tier's scheduler side (core/kv_offload.py), driven by hand as a scheduler would."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kv_fakes import FakeKVBackend

from twinserve.core import Scheduler, SchedulerConfig
from twinserve.core.kv_connector import KVConnectorOutput, make_connector_scheduler
from twinserve.core.kv_offload import (
    HostBlockLRU,
    OffloadingConnectorMetadata,
    OffloadingConnectorScheduler,
    num_host_blocks,
    offloading_config,
)
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.core.metrics import kv_offload_summary
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import make_request
from twinserve.policies import get_policy

BS = 4


def _conn(num_cpu_blocks: int) -> OffloadingConnectorScheduler:
    return OffloadingConnectorScheduler(offloading_config(num_cpu_blocks), BS)


def _step(*entries: tuple) -> SchedulerOutput:
    out = SchedulerOutput()
    for request, start, n, block_ids in entries:
        out.scheduled.append(ScheduledRequest(request, start, n, block_ids,
                                              start + n == request.num_tokens))
    return out


def _done(conn: OffloadingConnectorScheduler, recving: set[str] = frozenset()) -> None:
    conn.update_connector_output(KVConnectorOutput(set(), set(recving), set()))


def test_num_host_blocks_from_gib_and_layout():
    assert num_host_blocks(1.0, 1 << 20) == 1024
    assert num_host_blocks(0.5, 3 << 20) == 170
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            num_host_blocks(bad, 1024)
    with pytest.raises(ValueError, match="holds no KV block"):
        num_host_blocks(1e-9, 1 << 20)


def test_stores_ordered_for_the_full_blocks_each_step_completes():
    conn = _conn(8)
    req = make_request("a", list(range(10)))
    table = [7, 3, 5]
    meta = conn.build_connector_meta(_step((req, 0, 6, table)))  # tokens 0..5: block 0 full
    assert meta.stores == [(7, 0)] and meta.loads == {} and meta.cancelled == []
    _done(conn)
    meta = conn.build_connector_meta(_step((req, 6, 4, table)))  # to 10: block 1 full
    assert meta.stores == [(3, 1)]
    _done(conn)
    req.append_output_token(99, 0.0)
    meta = conn.build_connector_meta(_step((req, 10, 1, table)))  # 11 tokens: nothing new
    assert meta.stores == []
    assert conn.stats.num_blocks_stored == 2


def test_blocks_host_already_holds_are_not_stored_again():
    conn = _conn(8)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 1])  # same first two blocks
    assert conn.build_connector_meta(_step((a, 0, 9, [0, 1, 2]))).stores == [(0, 0), (1, 1)]
    _done(conn)
    meta = conn.build_connector_meta(_step((b, 0, 13, [4, 5, 6, 8])))
    assert meta.stores == [(6, 2)]  # only its third block is new to the host


def test_speculative_drafts_never_complete_a_stored_block():
    conn = _conn(8)
    req = make_request("a", [1, 2, 3])
    out = _step((req, 0, 3, [0]))
    assert conn.build_connector_meta(out).stores == []
    _done(conn)
    out = SchedulerOutput()
    out.scheduled.append(ScheduledRequest(req, 2, 3, [0, 1], True, spec_token_ids=[5, 6]))
    assert conn.build_connector_meta(out).stores == []  # 3 tokens certain: block 0 not full


def test_lru_bound_never_exceeded_and_oldest_evicted():
    conn = _conn(3)
    reqs = [make_request(f"r{i}", [i] * 8) for i in range(3)]  # two distinct blocks each
    for i, req in enumerate(reqs):
        conn.build_connector_meta(_step((req, 0, 8, [2 * i, 2 * i + 1])))
        _done(conn)
        assert len(conn.lru) <= 3
    assert conn.stats.num_blocks_stored == 6 and conn.stats.num_blocks_evicted == 3
    # r2's blocks are the newest two; r1's second block survived, its first was evicted
    assert conn.get_num_new_matched_tokens(make_request("x", [2] * 8 + [5]), 0) == (8, True)
    assert conn.get_num_new_matched_tokens(make_request("y", [0] * 8 + [5]), 0) == (0, False)
    conn.lru.check_consistency()


def test_lookup_past_device_hits_whole_blocks_last_token_recomputed():
    conn = _conn(8)
    first = make_request("a", list(range(12)))
    conn.build_connector_meta(_step((first, 0, 12, [0, 1, 2])))
    _done(conn)
    same = make_request("b", list(range(12)))  # 12 tokens: at most 11 hit -> 2 whole blocks
    assert conn.get_num_new_matched_tokens(same, 0) == (8, True)
    assert conn.get_num_new_matched_tokens(same, 4) == (4, True)  # past one device block
    assert conn.get_num_new_matched_tokens(same, 8) == (0, False)
    longer = make_request("c", [*range(12), 50, 51])
    assert conn.get_num_new_matched_tokens(longer, 4) == (8, True)
    skip = make_request("d", list(range(12)), sampling_params=SamplingParams(prompt_logprobs=1))
    assert conn.get_num_new_matched_tokens(skip, 0) == (0, False)


def test_matched_blocks_load_into_the_new_blocks_and_stay_pinned_until_reported():
    conn = _conn(2)
    a = make_request("a", list(range(9)))
    conn.build_connector_meta(_step((a, 0, 9, [0, 1, 2])))
    _done(conn)
    b = make_request("b", [*range(8), 40, 41])
    assert conn.get_num_new_matched_tokens(b, 4) == (4, True)
    conn.update_state_after_alloc(b, [0, 5, 6], 4)  # block 0 a device hit, 5 and 6 new
    meta = conn.build_connector_meta(SchedulerOutput())
    assert meta.loads == {"b": [(1, 5)]}
    assert conn.stats.external_prefix_cache_hits == 4
    assert conn.stats.external_prefix_cache_queries == 10
    # host full (2 blocks), slot 1 pinned by the load: a new block can only evict slot 0, and
    # then every slot is pinned (the load, c's store): d's store waits for the next step
    c, d = make_request("c", [9] * 4), make_request("d", [8] * 4)
    assert conn.build_connector_meta(_step((c, 0, 4, [3]), (d, 0, 4, [4]))).stores == [(3, 0)]
    assert conn.lru.num_pinned == 2
    _done(conn, {"b"})
    assert conn.lru.num_pinned == 0
    assert conn.build_connector_meta(_step((d, 0, 4, [4]))).stores == [(4, 1)]


def test_abort_cancels_a_load_in_flight_and_unpins():
    conn = _conn(4)
    a = make_request("a", list(range(9)))
    conn.build_connector_meta(_step((a, 0, 9, [0, 1, 2])))
    _done(conn)
    b = make_request("b", list(range(9)))
    assert conn.get_num_new_matched_tokens(b, 0) == (8, True)
    conn.update_state_after_alloc(b, [3, 4, 5], 8)
    assert conn.build_connector_meta(SchedulerOutput()).loads == {"b": [(0, 3), (1, 4)]}
    conn.request_aborted("b")
    assert conn.lru.num_pinned == 0
    assert conn.build_connector_meta(SchedulerOutput()).cancelled == ["b"]
    _done(conn, {"b"})  # a late report of the cancelled load changes nothing
    assert conn.lru.num_pinned == 0
    # aborted before its load was sent: the load is dropped, nothing to cancel
    c = make_request("c", list(range(9)))
    conn.get_num_new_matched_tokens(c, 0)
    conn.update_state_after_alloc(c, [6, 7, 8], 8)
    conn.request_finished(c, [6, 7, 8])
    meta = conn.build_connector_meta(SchedulerOutput())
    assert meta.loads == {} and meta.cancelled == [] and conn.lru.num_pinned == 0


def test_a_query_counts_once_per_admission():
    conn = _conn(4)
    a = make_request("a", list(range(6)))
    for _ in range(3):  # admission retried (no blocks): one query
        conn.get_num_new_matched_tokens(a, 0)
    conn.build_connector_meta(_step((a, 0, 6, [0, 1])))
    assert (conn.stats.external_prefix_cache_queries, conn.stats.external_prefix_cache_hits) == (6, 0)


def test_bad_alloc_report_names_the_tokens():
    conn = _conn(4)
    with pytest.raises(ValueError, match="num_external_tokens"):
        conn.update_state_after_alloc(make_request("a", [1] * 9), [0, 1, 2], 4)


def test_size_comes_from_the_config_checked_by_name():
    for bad in ({}, {"num_cpu_blocks": 0}, {"num_cpu_blocks": 2.5}):
        cfg = KVTransferConfig(kv_connector="OffloadingConnector", kv_connector_extra_config=bad)
        with pytest.raises(ValueError, match="num_cpu_blocks"):
            OffloadingConnectorScheduler(cfg, BS)
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        KVTransferConfig(kv_connector="OffloadingConnector",
                         kv_connector_extra_config={"transfer_timeout_s": 1.0})
    assert isinstance(make_connector_scheduler(offloading_config(3), BS), OffloadingConnectorScheduler)


def test_host_lru_validation_and_pins():
    with pytest.raises(ValueError, match="num_host_blocks"):
        HostBlockLRU(0)
    lru = HostBlockLRU(1)
    slot, evicted = lru.insert(11)
    assert (slot, evicted) == (0, None)
    lru.pin(slot)
    lru.pin(slot)
    assert lru.insert(12) is None
    lru.unpin(slot)
    assert lru.insert(12) is None  # still pinned once
    lru.unpin(slot)
    assert lru.insert(12) == (0, 11) and lru.get(11) is None and lru.get(12) == 0
    lru.check_consistency()


# ---- with the real scheduler and a fake worker over token-id caches ---------------------------
class FakeHostWorker:
    """The host tier's worker side over a ``FakeKVBackend``: host blocks are token-id lists;
    loads before the step, stores after it (as the real worker orders them)."""

    def __init__(self, backend: FakeKVBackend) -> None:
        self.backend = backend
        self.host: dict[int, list[int | None]] = {}
        self._stores: list[tuple[int, int]] = []
        self._done: set[str] = set()

    def start(self, meta: OffloadingConnectorMetadata) -> None:
        for rid, pairs in meta.loads.items():
            for slot, block in pairs:
                self.backend.slots[block] = list(self.host[slot])
            self._done.add(rid)
        self._stores = list(meta.stores)

    def get_finished(self) -> KVConnectorOutput:
        for block, slot in self._stores:
            self.host[slot] = list(self.backend.block(block))
        done, self._done = self._done, set()
        return KVConnectorOutput(set(), done, set())


class Engine:
    """A scheduler with (or without) the host tier, its fake cache and worker."""

    def __init__(self, host_blocks: int | None, num_gpu_blocks: int = 24, max_num_seqs: int = 4,
                 max_num_batched_tokens: int = 32, preemption_mode: str = "recompute") -> None:
        config = SchedulerConfig(num_gpu_blocks=num_gpu_blocks, block_size=BS, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, max_model_len=128,
                                 preemption_mode=preemption_mode, num_cpu_blocks=16)
        self.conn = None if host_blocks is None else _conn(host_blocks)
        self.sched = Scheduler(config, get_policy("fcfs"), kv_connector=self.conn)
        self.backend = FakeKVBackend(BS)
        self.worker = FakeHostWorker(self.backend)
        self.swapped: dict[int, list[int | None]] = {}  # the swap pool (not the tier)
        self.now = 0.0
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str | None] = {}

    def add(self, rid: str, prompt: list[int], max_tokens: int = 6) -> Request:
        req = make_request(rid, prompt, self.now, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.sched.add_request(req)
        return req

    def step(self) -> None:
        self.now += 1.0
        out = self.sched.schedule(self.now)
        slots = self.backend.slots
        for block, host in out.blocks_to_swap_out:
            self.swapped[host] = list(self.backend.block(block))
        for host, block in out.blocks_to_swap_in:
            slots[block] = list(self.swapped[host])
        if out.kv_connector_metadata is not None:
            self.worker.start(out.kv_connector_metadata)
        result = self.backend.execute(out)
        if self.conn is not None:
            result.kv_connector_output = self.worker.get_finished()
        for o in self.sched.update_from_output(out, result, self.now):
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                self.reasons[o.request_id] = o.finish_reason

    def run(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("requests did not finish")

    def check(self) -> None:
        self.sched.kv.check_consistency()
        if self.conn is not None:
            self.conn.lru.check_consistency()
            assert len(self.conn.lru) <= self.conn.lru.capacity


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 7) % 50 + 1 for i in range(n)]


def test_a_prefix_evicted_from_the_device_reloads_from_host_same_tokens():
    eng = Engine(host_blocks=64, num_gpu_blocks=12)
    shared = _prompt(1, 20)
    eng.add("first", shared)
    eng.run()
    for i in range(4):  # other prompts take every device block: the first's prefix is evicted
        eng.add(f"other{i}", _prompt(10 + i, 20))
        eng.run()
    assert eng.sched.kv.get_computed_blocks(make_request("probe", shared))[1] == 0
    again = eng.add("again", shared)
    eng.run()
    assert eng.tokens["again"] == eng.tokens["first"]
    assert again.num_cached_tokens == 0  # nothing from the device cache...
    assert eng.conn.stats.external_prefix_cache_hits == 16  # ...4 whole blocks from host (19 max)
    assert eng.conn.stats.num_blocks_loaded == 4
    eng.check()
    assert eng.conn.lru.num_pinned == 0 and not eng.sched.kv.tables


def test_a_preempted_request_reloads_its_stored_blocks_instead_of_recomputing():
    def run(host_blocks):
        eng = Engine(host_blocks, num_gpu_blocks=10, max_num_seqs=2, max_num_batched_tokens=64)
        reqs = [eng.add("a", _prompt(1, 14), 16), eng.add("b", _prompt(2, 14), 16)]
        eng.run()
        eng.check()
        return eng, reqs

    plain, plain_reqs = run(None)
    tier, reqs = run(64)
    assert sum(r.num_preemptions for r in reqs) > 0
    assert {r: plain.tokens[r] for r in "ab"} == {r: tier.tokens[r] for r in "ab"}
    assert tier.conn.stats.external_prefix_cache_hits > 0
    # the reloaded tokens were not computed again
    assert tier.sched.num_prompt_tokens < plain.sched.num_prompt_tokens


# found by this property: a swapped-out request ahead of one holding loaded blocks, neither able
# to move (the scheduler now lets the loaded one go first)
@example([(0, 7, 3, 1, 0), (1, 28, 5, 3, 0), *[(0, 1, 1, 0, 0)] * 7, (1, 8, 1, 3, 0)], 3, 10, "swap")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 30), st.integers(1, 8),
                          st.integers(0, 40), st.integers(0, 12)), min_size=1, max_size=10),
       st.integers(1, 24), st.integers(10, 12), st.sampled_from(["recompute", "swap"]))
def test_random_admissions_evictions_preemptions_aborts(specs, host_blocks, gpu_blocks, mode):
    """Requests arrive over time (sharing prefixes, so the device cache evicts what host keeps),
    some are aborted: no device block leaks, the host tier stays within its bound and unpinned,
    every request ends, and the survivors' tokens equal those of an engine without the tier."""
    eng = Engine(host_blocks, num_gpu_blocks=gpu_blocks, max_num_seqs=3, preemption_mode=mode)
    ref = Engine(None, num_gpu_blocks=64, max_num_seqs=3)
    arrivals: dict[int, list[tuple[str, list[int], int]]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (family, length, max_tokens, arrive_at, abort_after) in enumerate(specs):
        rid, prompt = f"r{i}", _prompt(family, 30)[:length] + [i % 5 + 60] * (i % 2)
        ref.add(rid, prompt, max_tokens)
        arrivals.setdefault(arrive_at, []).append((rid, prompt, max_tokens))
        if abort_after:
            aborts.setdefault(arrive_at + abort_after, []).append(rid)
    last_arrival = max(arrivals)
    for step in range(3000):
        for rid, prompt, max_tokens in arrivals.get(step, ()):
            eng.add(rid, prompt, max_tokens)
        for o in eng.sched.abort_requests(aborts.get(step, []), eng.now):
            eng.reasons[o.request_id] = o.finish_reason
        if step > last_arrival and not eng.sched.has_unfinished_requests():
            break
        eng.step()
        eng.check()
    else:
        raise AssertionError("requests did not finish")
    ref.run()
    assert not eng.sched.kv.tables and eng.sched.kv.num_free_blocks == gpu_blocks
    assert eng.conn.lru.num_pinned == 0
    assert set(eng.reasons) == set(ref.reasons)
    for rid, reason in eng.reasons.items():
        if reason != "abort":
            assert eng.tokens[rid] == ref.tokens[rid], rid


def test_host_hits_reach_scheduler_stats_and_metrics_under_vllm_names():
    from prometheus_client import CollectorRegistry, generate_latest

    from twinserve.entrypoints.openai.server_metrics import SchedulerCollector
    eng = Engine(host_blocks=64, num_gpu_blocks=12)
    shared = _prompt(1, 20)
    for rid, prompt in (("a", shared), ("b", _prompt(2, 20)), ("c", _prompt(3, 20)), ("d", shared)):
        eng.add(rid, prompt)
        eng.run()
    stats = eng.sched.stats()
    assert (stats.external_prefix_cache_queries, stats.external_prefix_cache_hits) == (80, 16)
    registry, collector = CollectorRegistry(), SchedulerCollector("m")
    collector.stats = stats
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'vllm:external_prefix_cache_queries_total{model_name="m"} 80.0' in text
    assert 'vllm:external_prefix_cache_hits_total{model_name="m"} 16.0' in text
    summary = kv_offload_summary([eng.conn.stats, eng.conn.stats])  # two replicas' counts add
    assert summary["external_prefix_cache_hits"] == 32
    assert summary["external_prefix_cache_hit_rate"] == pytest.approx(0.2)
    assert Engine(None).sched.stats().external_prefix_cache_hits == 0
