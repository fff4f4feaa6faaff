"""A fleet replica's decode run read by a router before it is applied (``simulator.fleet``):
the arrivals read the run in progress, and the run folder stays the step-by-step reference's."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from twinserve.core import scheduler as scheduler_module
from twinserve.core.block_pool import FreeKVCacheBlockQueue, KVCacheBlock
from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from twinserve.core.scheduler import Scheduler
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator import engine as engine_module
from twinserve.simulator import fleet as fleet_module
from twinserve.simulator.fleet import PendingRun, strike
from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace

SMALL = {"model": "smollm2-135m", "hardware": "a100-80gb"}


@pytest.fixture(scope="module")
def workload():
    return multi_app_trace(MultiAppConfig(num_requests=150, request_rate=30.0, num_apps=6,
                                          system_len_max=1024, input_len=200, output_len=120))


# A run goes on past its finishes (the arrivals read the ends and the blocks they freed);
# "server" also admits against the running count (max_waiting_requests 4096, far from reached).
@pytest.mark.parametrize("usage", ["server", "llm"])
@pytest.mark.parametrize("router", ["least-outstanding", "cache-aware"])
def test_arrivals_read_runs_in_progress_and_the_results_are_the_references(
        monkeypatch, workload, router, usage) -> None:
    cfg = SimConfig(num_replicas=3, router=router, num_gpu_blocks_override=300,
                    usage_context=usage, **SMALL)
    reference = simulate(cfg, workload, decode_runs=False)
    read, reported, ended, counted = [0], [0], [0], [0]
    refresh, evictions = PendingRun.refresh, PendingRun.evictions
    blocks_taken = PendingRun.blocks_taken

    def counting_refresh(self: PendingRun, *args) -> None:
        read[0] += 1
        ended[0] += self.num_ended() > 0
        refresh(self, *args)

    def counting_evictions(self: PendingRun):
        events = evictions(self)
        reported[0] += sum(len(e.block_hashes) for e in events)
        clean[0] += self.crossing < self._clean_below  # (found without reading a block)
        # every hash of the blocks the steps so far took off the queue's head, reported once
        queue = self.run.scheduler.kv.pool.free_queue
        assert self.reported == [b.block_hash for b in queue.peek(self._blocks_taken_plain())
                                 if b.block_hash is not None]
        return events

    def checked_blocks_taken(self: PendingRun) -> int:  # the step-by-step count's reference
        taken = blocks_taken(self)
        assert taken == self._blocks_taken_plain(), (self.crossing, self.run.lefts)
        counted[0] += self.run.stops[0] <= self.crossing and taken > 0
        return taken

    unhashed_at_head, clean = FreeKVCacheBlockQueue.unhashed_at_head, [0]

    def checked_unhashed_at_head(self: FreeKVCacheBlockQueue) -> int | None:
        ahead = unhashed_at_head(self)  # the head's blocks read only here, for the check
        assert all(b.block_hash is None
                   for b in self.peek(self.num_free if ahead is None else ahead))
        return ahead

    monkeypatch.setattr(FreeKVCacheBlockQueue, "unhashed_at_head", checked_unhashed_at_head)
    monkeypatch.setattr(fleet_module.PendingRun, "refresh", counting_refresh)
    monkeypatch.setattr(fleet_module.PendingRun, "evictions", counting_evictions)
    monkeypatch.setattr(fleet_module.PendingRun, "blocks_taken", checked_blocks_taken)
    schedule, steps = Scheduler.schedule, [0]

    def counting_schedule(self: Scheduler, now: float):
        steps[0] += 1
        return schedule(self, now)

    monkeypatch.setattr(scheduler_module.Scheduler, "schedule", counting_schedule)
    fast = simulate(cfg, workload)
    assert read[0] > len(workload)  # most arrivals found some replica mid-run
    if router == "cache-aware":  # evictions reported ahead, then struck from the run's events
        assert reported[0] > 0 and counted[0] > 0  # (blocks counted past some runs' ends)
        assert clean[0] > 0  # and reads that found no hash ahead, without reading a block
    assert ended[0] > 0
    assert fast.records == reference.records
    assert list(fast.steps) == list(reference.steps)
    # the scheduler's own steps: about one a request (its prefill), where stopping every
    # replica's run at every arrival steps each replica through the step in progress
    assert steps[0] < 1.5 * len(workload), steps[0]


@pytest.mark.parametrize("router", ["least-outstanding", "cache-aware"])
def test_a_full_waiting_queue_admits_as_the_reference_does(monkeypatch, router) -> None:
    """max_waiting_requests 1 and 4 seats: a run's ended requests still hold seats until it
    is applied, so a step with two arrivals (the second one queued behind the first) after a
    finish is not taken in by the run, and the requests the reference takes or refuses are
    the same; runs past finishes still go on through steps with fewer arrivals."""
    cfg = SimConfig(num_replicas=3, router=router, max_num_seqs=4, max_waiting_requests=1,
                    usage_context="server", **SMALL)
    burst = multi_app_trace(MultiAppConfig(num_requests=200, request_rate=300.0, num_apps=4,
                                           system_len_max=512, input_len=64, output_len=200))
    reference = simulate(cfg, burst, decode_runs=False)
    ended = [0]
    refresh = PendingRun.refresh

    def counting_refresh(self: PendingRun, *args) -> None:
        ended[0] += self.num_ended() > 0
        refresh(self, *args)

    monkeypatch.setattr(fleet_module.PendingRun, "refresh", counting_refresh)
    fast = simulate(cfg, burst)
    if router == "least-outstanding":  # (cache-aware keeps its runs short here: none past)
        assert ended[0] > 0
    assert 0 < sum(not r.success for r in reference.records) < len(burst)
    assert [repr(r) for r in fast.records] == [repr(r) for r in reference.records]  # (nan times)
    assert list(fast.steps) == list(reference.steps)


@pytest.mark.parametrize("router", ["least-outstanding", "cache-aware"])
def test_a_crossing_step_waits_in_one_event_with_the_references_results(
        monkeypatch, workload, router) -> None:
    """The crossing step's two waits (to its start, then its length) merged into one where
    SimPy lands on its end: the same results as the two waits, in fewer SimPy events."""
    cfg = SimConfig(num_replicas=3, router=router, **SMALL)
    events = [0]
    step = engine_module.simpy.Environment.step

    def counting_step(self):
        events[0] += 1
        return step(self)

    monkeypatch.setattr(engine_module.simpy.Environment, "step", counting_step)
    fast, fast_events = simulate(cfg, workload), events[0]
    monkeypatch.setattr(engine_module, "_wait_crossing", engine_module._wait_crossing_plain)
    events[0] = 0
    plain = simulate(cfg, workload)
    assert fast.records == plain.records
    assert list(fast.steps) == list(plain.steps)
    assert fast_events < 0.9 * events[0], (fast_events, events[0])


def test_free_queue_peek_is_what_popleft_n_would_take() -> None:
    rng = random.Random(3)
    blocks = [KVCacheBlock(i) for i in range(40)]
    queue = FreeKVCacheBlockQueue(blocks)
    for block in rng.sample(blocks, 12):  # stale entries in the middle
        queue.remove(block)
    for block in rng.sample([b for b in blocks if b not in list(queue)], 5):
        queue.append(block)  # revived at the tail
    for n in (0, 1, 7, queue.num_free, queue.num_free + 3):
        peeked = queue.peek(n)
        assert peeked == list(queue)[:n]
    free, expected = queue.num_free, queue.peek(9)
    assert queue.popleft_n(9) == expected and queue.num_free == free - 9


def test_strike_removes_each_reported_eviction_once() -> None:
    events = [BlockRemoved([1, 2, 3]), BlockStored([9], None, None), BlockRemoved([2, 4])]
    assert strike(events, [2, 3]) == [BlockRemoved([1]), BlockStored([9], None, None),
                                      BlockRemoved([2, 4])]
    assert strike(events, [1, 2, 3, 2]) == [BlockStored([9], None, None), BlockRemoved([4])]
    with pytest.raises(RuntimeError, match="reported ahead"):
        strike(events, [5])
    cleared = [AllBlocksCleared()]  # an overflowed buffer: nothing left to strike
    assert strike(cleared, [1]) == cleared


def test_lazy_fits_remembered_agrees_with_the_reference(monkeypatch, workload) -> None:
    """``LazyFits`` reads only the requests that joined the batch since the last run found to
    fit: its verdict is ``lazy_fits``' on every run, through preemptions (whose requests
    register their blocks from then on, and never fit again)."""
    cfg = SimConfig(num_replicas=3, router="least-outstanding", num_gpu_blocks_override=120,
                    **SMALL)
    verdicts = {True: 0, False: 0}
    read = [0, 0]  # requests ``LazyFits`` read, requests in the runs it was asked about
    call, all_fit = fleet_module.LazyFits.__call__, fleet_module._all_fit
    counting = [False]

    def checked(self: fleet_module.LazyFits, run) -> bool:
        counting[0] = True
        verdict = call(self, run)
        counting[0] = False
        assert verdict == fleet_module.lazy_fits(run)
        verdicts[verdict] += 1
        read[1] += len(run.requests)
        return verdict

    def counted(requests, kv) -> bool:
        read[0] += len(requests) if counting[0] else 0
        return all_fit(requests, kv)

    monkeypatch.setattr(fleet_module.LazyFits, "__call__", checked)
    monkeypatch.setattr(fleet_module, "_all_fit", counted)
    result = simulate(cfg, workload)
    assert result.summary["num_preemptions"] > 0
    assert verdicts[True] > 0 and verdicts[False] > 0, verdicts
    assert read[0] < read[1], read  # (fewer than all: most runs follow one found to fit)
    reference = simulate(cfg, workload, decode_runs=False)
    assert [repr(r) for r in result.records] == [repr(r) for r in reference.records]  # (nan)
    assert list(result.steps) == list(reference.steps)


def test_lazy_fits_reads_only_the_requests_that_joined_since_a_fit(monkeypatch) -> None:
    """Those that joined since the last run found to fit are read, from the batch's end (some
    may have left); a misfit is read again; a preemption has every request read."""
    read: list[list[str]] = []
    misfits: set[str] = set()

    def fake_all_fit(requests, kv) -> bool:
        read.append([r.request_id for r in requests])
        return not misfits.intersection(r.request_id for r in requests)

    monkeypatch.setattr(fleet_module, "_decided_by_manager", lambda kv: None)
    monkeypatch.setattr(fleet_module, "_all_fit", fake_all_fit)
    sched = SimpleNamespace(kv=None, num_preemptions=0, num_joined=0)
    made = {name: SimpleNamespace(request_id=name) for name in "abcdefg"}

    def fits(names: str, joined: int) -> bool:
        sched.num_joined += joined
        return fleet_module.LazyFits.__call__(memo, SimpleNamespace(
            scheduler=sched, requests=[made[n] for n in names]))

    memo = fleet_module.LazyFits()
    assert fits("abc", 3) and read[-1] == ["a", "b", "c"]
    assert fits("abcd", 1) and read[-1] == ["d"]
    assert fits("bd", 0) and len(read) == 2  # none joined: nothing read
    assert fits("bde", 2) and read[-1] == ["d", "e"]  # one of the two left before the run
    assert fits("e", 7) and read[-1] == ["e"]  # more joins than requests: all of them
    misfits.add("f")
    assert not fits("ef", 1) and read[-1] == ["f"]
    assert not fits("efg", 1) and read[-1] == ["f", "g"]  # a misfit is read again
    misfits.clear()
    sched.num_preemptions = 1
    assert fits("ab", 0) and read[-1] == ["a", "b"]  # a preemption: every request read
