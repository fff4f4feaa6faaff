"""The routers package: registry, the four routers, their bounded state, prompt hashing."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from core_helpers import make_req, make_scheduler, run_to_completion

from twinserve import routers as registry
from twinserve.core.block_hash import update_block_hashes
from twinserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from twinserve.core.outputs import ModelRunnerOutput
from twinserve.core.request import LazyPrompt, Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.routers import (
    ROUTERS,
    CacheAwareRouter,
    NoHealthyReplica,
    PrefixAffinityRouter,
    ReplicaLoad,
    cache_aware,
    make_router,
    uses_kv_events,
)
from twinserve.routers.hashing import prompt_block_hashes

BS = 4


def loads(*outstanding: int, usage: float = 0.0) -> list[ReplicaLoad]:
    return [ReplicaLoad(n, 0, usage) for n in outstanding]


def test_registry_names_and_errors() -> None:
    assert ROUTERS == ("round-robin", "least-outstanding", "prefix-affinity", "cache-aware")
    assert isinstance(make_router("cache-aware", BS), CacheAwareRouter)
    assert make_router("cache-aware", BS).block_size == BS
    assert uses_kv_events(make_router("cache-aware", BS))
    assert not uses_kv_events(make_router("round-robin", BS))
    with pytest.raises(ValueError, match="unknown router 'random'.*cache-aware"):
        make_router("random", BS)
    with pytest.raises(ValueError, match="bad options for router 'round-robin'"):
        make_router("round-robin", BS, bogus=1)
    with pytest.raises(ValueError, match="decode_weight"):
        make_router("cache-aware", BS, decode_weight=-1)
    with pytest.raises(ValueError, match="max_prefixes"):
        make_router("prefix-affinity", BS, max_prefixes=0)


def test_a_plugin_loads_from_the_entry_point_group(monkeypatch) -> None:
    class Fixed:
        def route(self, request, replicas):
            return len(replicas) - 1

        def on_kv_events(self, replica, events):
            pass

        def on_replica_reset(self, replica):
            pass

    point = SimpleNamespace(name="last", load=lambda: Fixed)
    monkeypatch.setattr(registry, "entry_points",
                        lambda group: [point] if group == "twinserve.routers" else [])
    assert "last" in registry.available_routers()
    assert make_router("last", BS).route(make_req("a", 8), loads(0, 0, 0)) == 2
    class NotARouter:
        pass

    point.load = lambda: NotARouter
    with pytest.raises(ValueError, match="router 'last' lacks route"):
        make_router("last", BS)
    point.load = lambda: len  # not a class
    with pytest.raises(ValueError, match="router 'last'"):
        make_router("last", BS)


def test_replica_load_validates() -> None:
    with pytest.raises(ValueError, match="num_waiting"):
        ReplicaLoad(1, -1, 0.5)
    with pytest.raises(ValueError, match="kv_usage"):
        ReplicaLoad(1, 0, 1.5)
    with pytest.raises(ValueError, match="num_prefill_tokens"):
        ReplicaLoad(1, 0, 0.5, num_prefill_tokens=-3)
    with pytest.raises(ValueError, match="last_step_s"):
        ReplicaLoad(1, 0, 0.5, last_step_s=-0.01)
    with pytest.raises(ValueError, match="step_elapsed_s"):
        ReplicaLoad(1, 0, 0.5, step_elapsed_s=float("nan"))


def test_a_step_in_progress_has_left_what_the_last_step_took_less_its_time() -> None:
    assert ReplicaLoad(4, 0, 0.1, step_elapsed_s=0.004, last_step_s=0.013).step_left_s \
        == pytest.approx(0.009)
    assert ReplicaLoad(4, 0, 0.1, step_elapsed_s=0.02, last_step_s=0.013).step_left_s == 0.0
    assert ReplicaLoad(0, 0, 0.0, step_elapsed_s=None, last_step_s=0.013).step_left_s == 0.0


def test_a_replicas_prefill_backlog_is_its_queued_and_unfinished_prompts() -> None:
    sched = make_scheduler(num_blocks=64, block_size=BS, max_num_batched_tokens=16)
    sched.add_request(make_req("a", 40))
    sched.add_request(make_req("b", 24))
    assert sched.num_prefill_tokens == 64 == sched.stats().num_prefill_tokens
    out = sched.schedule(0.0)  # a's first 16-token chunk (what the step computes still counts)
    assert sched.num_prefill_tokens == 64
    sched.update_from_output(out, ModelRunnerOutput({}), 0.1)
    assert sched.num_prefill_tokens == 40 + 24 - 16 == sched.stats().num_prefill_tokens


@pytest.mark.parametrize("name", ROUTERS)
def test_every_router_skips_unhealthy_replicas_and_raises_when_none_is(name: str) -> None:
    router = make_router(name, BS)
    replicas = loads(0, 0, 0)
    replicas[0].healthy = replicas[2].healthy = False
    for i in range(5):
        assert router.route(make_req(f"r{i}", 9), replicas) == 1
    for r in replicas:
        r.healthy = False
    with pytest.raises(NoHealthyReplica):
        router.route(make_req("x", 9), replicas)


def test_round_robin_cycles_and_least_outstanding_takes_the_emptiest() -> None:
    rr = make_router("round-robin", BS)
    assert [rr.route(make_req(f"r{i}", 5), loads(0, 0, 0)) for i in range(5)] == [0, 1, 2, 0, 1]
    assert make_router("least-outstanding", BS).route(make_req("a", 5), loads(3, 1, 1)) == 1


def test_prefix_affinity_keeps_a_home_and_stays_bounded() -> None:
    router = PrefixAffinityRouter(prefix_tokens=4, max_imbalance=2, max_prefixes=8)
    shared = [5, 6, 7, 8]
    assert router.route(make_req("a", 10, prefix=shared), loads(1, 0)) == 1
    assert router.route(make_req("b", 10, prefix=shared), loads(0, 2)) == 1  # within imbalance
    assert router.route(make_req("c", 10, prefix=shared), loads(0, 3)) == 0  # too loaded: moves
    for i in range(100):
        router.route(make_req(f"d{i}", 10, prefix=[i, i, i, i]), loads(i % 2, 1 - i % 2))
        assert len(router) <= 8
    router.on_replica_reset(0)
    assert len(router) == 4  # the homes on replica 0 are forgotten


def test_prompt_hashes_are_the_prefix_caches_keys() -> None:
    for lora in (None, "sql"):
        request = make_req("a", 23, prefix=list(range(9)), lora=lora)
        mine = list(prompt_block_hashes(request, BS))
        assert request.block_hashes == []  # the request is not touched
        assert mine == update_block_hashes(request, BS, 23)
        assert len(mine) == 5


def _stored(request, replica: int, router: CacheAwareRouter, blocks: int) -> None:
    hashes = list(prompt_block_hashes(request, BS))[:blocks]
    router.on_kv_events(replica, [BlockStored(hashes, None, None)])


def _queued(*prefill_tokens: int, running: int = 0) -> list[ReplicaLoad]:
    return [ReplicaLoad(running, 0, 0.0, num_prefill_tokens=p) for p in prefill_tokens]


def test_cache_aware_routes_to_the_replica_holding_the_longest_prefix() -> None:
    router = CacheAwareRouter(BS)
    shared = list(range(40))
    _stored(make_req("seed1", 48, prefix=shared), 1, router, 4)
    _stored(make_req("seed2", 48, prefix=shared), 2, router, 10)
    request = make_req("a", 48, prefix=shared)
    assert router.matched_blocks(request, [0, 1, 2]) == {0: 0, 1: 4, 2: 10}
    # costs 48, 32 + 10, 8 + 30 tokens: the 40 held tokens outweigh the 30 queued
    assert router.route(request, _queued(0, 10, 30)) == 2
    # 48, 32 + 10, 8 + 40: the queue now outweighs what replica 2 holds beyond replica 1
    assert router.route(request, _queued(0, 10, 40)) == 1
    # removal and reset forget the blocks
    hashes = list(prompt_block_hashes(request, BS))
    router.on_kv_events(2, [BlockRemoved(hashes[5:6])])
    assert router.matched_blocks(request, [2]) == {2: 5}
    router.on_kv_events(2, [AllBlocksCleared()])
    assert router.matched_blocks(request, [1, 2]) == {1: 4, 2: 0}
    assert router.holders(hashes[0]) == [1]


def test_cache_aware_balances_queued_work_when_every_replica_holds_the_prompt() -> None:
    router = CacheAwareRouter(BS, decode_weight=5.0)
    shared = list(range(40))
    for replica in range(3):
        _stored(make_req(f"seed{replica}", 48, prefix=shared), replica, router, 10)
    request = make_req("a", 48, prefix=shared)
    # round robin would take replica 0 first; the least queued prefill wins
    assert router.route(request, _queued(600, 50, 300)) == 1
    # decode batches count: 50 + 5 * 40 against 120 + 5 * 10
    loads = [ReplicaLoad(40, 0, 0.0, num_prefill_tokens=50),
             ReplicaLoad(10, 0, 0.0, num_prefill_tokens=120),
             ReplicaLoad(40, 0, 0.0, num_prefill_tokens=500)]
    assert router.route(request, loads) == 1
    # least-outstanding would take replica 0 (2 requests against 3): its queued prompt is longer
    loads = [ReplicaLoad(1, 1, 0.0, num_prefill_tokens=900),
             ReplicaLoad(3, 0, 0.0, num_prefill_tokens=0)]
    assert router.route(request, loads) == 1


def test_cache_aware_ties_go_round_robin() -> None:
    router = CacheAwareRouter(BS)
    picks = [router.route(make_req(f"r{i}", 12), _queued(0, 0, 0)) for i in range(5)]
    assert picks == [0, 1, 2, 0, 1]
    # 2's turn, but it costs more: of the tied 0 and 1, 0 comes first from 2 on
    assert router.route(make_req("x", 12), _queued(0, 0, 7)) == 0
    assert router.route(make_req("y", 12), _queued(0, 0, 0)) == 1


def test_cache_aware_sends_a_request_where_the_step_in_progress_ends_first() -> None:
    """Every replica holds the prompt and has the same queued work: only their steps in
    progress differ. Round robin's turn (the old tie-break) is replica 0, whose step has just
    begun; replica 2's ends in 1 ms, so the first token comes ~12 ms sooner there."""
    router = CacheAwareRouter(BS, prefill_tokens_per_s=50_000.0)
    shared = list(range(40))
    for replica in range(3):
        _stored(make_req(f"seed{replica}", 48, prefix=shared), replica, router, 10)
    request = make_req("a", 48, prefix=shared)

    def stepping(*elapsed: float | None) -> list[ReplicaLoad]:
        return [ReplicaLoad(30, 0, 0.2, num_prefill_tokens=100, step_elapsed_s=e,
                            last_step_s=0.013) for e in elapsed]

    assert router.route(request, stepping(0.0, 0.006, 0.012)) == 2
    assert router.route(request, stepping(0.012, 0.0, 0.006)) == 0
    assert router.route(request, stepping(0.003, None, 0.012)) == 1  # an idle one starts at once
    # the wait is priced against queued work: 12 ms is 600 prompt tokens at 50,000 a second
    loads = stepping(0.001, 0.013)
    loads[1].num_prefill_tokens = 100 + 590
    assert router.route(request, loads) == 1
    loads[1].num_prefill_tokens = 100 + 610
    assert router.route(request, loads) == 0
    # prefill_tokens_per_s=0 ignores the steps in progress: round robin among the tied
    blind = CacheAwareRouter(BS, prefill_tokens_per_s=0.0)
    assert [blind.route(request, stepping(0.0, 0.006, 0.012)) for _ in range(3)] == [0, 1, 2]


def test_cache_aware_options_are_checked() -> None:
    with pytest.raises(ValueError, match="decode_weight"):
        CacheAwareRouter(BS, decode_weight=-1.0)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        CacheAwareRouter(BS, prefill_tokens_per_s=float("inf"))
    with pytest.raises(ValueError, match="block_size"):
        CacheAwareRouter(0)


def test_cache_aware_index_stays_bounded() -> None:
    router = CacheAwareRouter(BS, max_blocks=50)
    for i in range(200):
        _stored(make_req(f"p{i}", 40), i % 3, router, 10)
        assert len(router) <= 50
    newest = make_req("p199", 40)
    assert router.matched_blocks(newest, [0, 1, 2])[199 % 3] == 10
    with pytest.raises(ValueError, match="events"):
        router.on_kv_events(0, ["stored"])  # type: ignore[list-item]


def test_cache_aware_follows_a_real_schedulers_events() -> None:
    sched = make_scheduler(num_blocks=12, block_size=BS, kv_events=True)
    router = CacheAwareRouter(BS)
    shared = list(range(16))
    sched.add_request(make_req("a", 20, prefix=shared))
    run_to_completion(sched)
    router.on_kv_events(0, sched.take_kv_events())
    assert router.matched_blocks(make_req("b", 20, prefix=shared), [0, 1]) == {0: 4, 1: 0}
    # other prompts evict it: the router learns that too
    for i in range(4):
        sched.add_request(make_req(f"x{i}", 40))
        run_to_completion(sched)
    router.on_kv_events(0, sched.take_kv_events())
    assert router.matched_blocks(make_req("c", 20, prefix=shared), [0]) == {0: 0}


def _lazy_req(rid: str, blocks: list[int]) -> Request:
    """A request whose prompt is a ``LazyPrompt`` of these blocks' contents (its keys chained
    over them, as a key covers its whole prefix), then one token."""
    keys, parent = [], 0
    for block in blocks:
        parent = hash((parent, block))
        keys.append(parent)
    length = len(keys) * BS + 1
    prompt = LazyPrompt(length, lambda a, b: [9] * (b - a), length - 1, [9], BS, keys)
    return Request(rid, prompt, SamplingParams(max_tokens=4, ignore_eos=True), 0.0, eos_token_id=2)


def _prompts(rng: random.Random) -> list[Request]:
    """Lazy prompts sharing system prompts (whole, cut short, or going on with other blocks, as
    conversations do) and plain prompts sharing prefixes of their ids."""
    systems = [[rng.randrange(1 << 40) for _ in range(24)] for _ in range(4)]
    turns = [[rng.randrange(1 << 40) for _ in range(6)] for _ in range(5)]
    requests = []
    for k in range(60):
        system = rng.choice(systems)
        blocks = system[:rng.choice((1, 8, 24, 24, 24))] + rng.choice(turns)[:rng.randrange(7)]
        requests.append(_lazy_req(f"lazy{k}", blocks))
    plain = [[rng.randrange(50) for _ in range(40)] for _ in range(2)]
    requests += [make_req(f"plain{k}", 40 + k % 5, prefix=rng.choice(plain)[:rng.randrange(41)])
                 for k in range(12)]
    return requests


def test_cache_aware_index_forgets_a_generation_at_a_time_and_keeps_what_matched() -> None:
    """Stored hashes fill the young generation; once it holds half the cap it becomes the old
    one and the old one is forgotten. A match moves its hashes up from the old generation, so a
    prompt in use outlives one stored and never read again."""
    router = CacheAwareRouter(BS, max_blocks=12)  # generations of 6
    hot, cold, filler = (_lazy_req(rid, list(range(k, k + 3))) for k, rid in
                         ((100, "hot"), (200, "cold"), (300, "filler")))
    more = _lazy_req("more", list(range(400, 406)))
    for request in (hot, cold):
        router.on_kv_events(0, [BlockStored(list(prompt_block_hashes(request, BS)), None, None)])
    assert len(router) == 6 and not router._young  # the sixth hash turned the young one old
    assert router.matched_blocks(hot, [0, 1]) == {0: 3, 1: 0}  # hot's hashes move up
    assert len(router._young) == 3 and len(router._old) == 3
    router.on_kv_events(1, [BlockStored(list(prompt_block_hashes(filler, BS)), None, None)])
    assert len(router) == 6  # the young one filled again: cold's generation is forgotten
    assert router.matched_blocks(hot, [0, 1]) == {0: 3, 1: 0}
    assert router.matched_blocks(cold, [0, 1]) == {0: 0, 1: 0}
    assert router.matched_blocks(filler, [0, 1]) == {0: 0, 1: 3}
    router.on_kv_events(1, [BlockStored(list(prompt_block_hashes(more, BS)), None, None)])
    assert len(router) <= 12 and router.matched_blocks(more, [1]) == {1: 6}
    # a hash in the old generation stored by another replica moves up with both bits
    first, second = list(prompt_block_hashes(more, BS))[:2]
    assert first in router._old and second in router._young
    router.on_kv_events(1, [BlockRemoved([second])])  # (room in the young one)
    assert router.holders(second) == [] and len(router._young) == 4
    router.on_kv_events(0, [BlockStored([first], None, None)])
    assert router._young[first] == 0b11 and first not in router._old
    router.on_kv_events(1, [BlockRemoved([first])])
    assert router.holders(first) == [0]


@pytest.mark.parametrize("seed", range(6))
def test_cache_aware_kept_walks_match_the_plain_loop(monkeypatch, seed: int) -> None:
    """``matched_blocks`` (walks kept until a mask they read changes) against the hash-by-hash
    loop, through stores, removals, resets and a capped index: the same matches for every
    request and replica set, and the same generations."""
    rng = random.Random(seed)
    fast, plain = CacheAwareRouter(BS, max_blocks=40), CacheAwareRouter(BS, max_blocks=40)
    requests = _prompts(rng)
    forgot = 0  # rounds in which a store forgot the old generation
    walked, went_on = [0], [0]  # full walks, and walks gone on past a kept one
    walk, go_on = CacheAwareRouter._walk, CacheAwareRouter._go_on

    def counting_walk(self, hashes):
        walked[0] += 1
        return walk(self, hashes)

    def counting_go_on(self, hashes, depth, alive, matched):
        went_on[0] += 1
        return go_on(self, hashes, depth, alive, matched)

    monkeypatch.setattr(CacheAwareRouter, "_walk", counting_walk)
    monkeypatch.setattr(CacheAwareRouter, "_go_on", counting_go_on)
    rounds = 600
    for _ in range(rounds):
        request = rng.choice(requests)
        roll = rng.random()
        if roll < 0.1:  # a replica stores some of a prompt's blocks (new ones: from any block
            # on, as a replica holding the ones before reports), or loses some
            hashes = list(prompt_block_hashes(request, BS))
            start = rng.choice((0, rng.randrange(len(hashes) + 1)))
            replica, kept = rng.randrange(5), hashes[start:rng.randrange(start, len(hashes) + 1)]
            events = [BlockStored(kept, None, None)] if rng.random() < 0.7 else \
                [BlockRemoved([h for h in kept if rng.random() < 0.3])]
            old = fast._old
            for router in (fast, plain):
                router.on_kv_events(replica, events)
            forgot += fast._old is not old
        elif roll < 0.11:
            replica = rng.randrange(5)
            for router in (fast, plain):
                router.on_replica_reset(replica)
        among = sorted(rng.sample(range(5), rng.randrange(1, 6)))
        got = fast.matched_blocks(request, among)
        assert got == plain._matched_blocks_plain(request, among), (request.request_id, among)
        assert fast._young == plain._young and fast._old == plain._old
        assert len(fast) <= 40
    # most walks reused a kept one; some went on past it; the cap forgot generations
    assert walked[0] < 0.6 * rounds and went_on[0] > 10 and forgot > 5, (walked, went_on, forgot)


def test_cache_aware_kept_walk_sees_the_blocks_stored_and_removed_past_it() -> None:
    """A replica reports only its new blocks: a store from the walk's first miss on, or a
    removal within it, changes the matches of the walk kept for that prompt."""
    router = CacheAwareRouter(BS)
    request = _lazy_req("a", list(range(10)))
    hashes = list(prompt_block_hashes(request, BS))
    router.on_kv_events(0, [BlockStored(hashes[:4], None, None)])
    assert router.matched_blocks(request, [0, 1]) == {0: 4, 1: 0}
    router.on_kv_events(0, [BlockStored(hashes[4:7], hashes[3], None)])  # from the first miss
    assert router.matched_blocks(request, [0, 1]) == {0: 7, 1: 0}
    router.on_kv_events(1, [BlockStored(hashes[:2], None, None)])
    assert router.matched_blocks(request, [0, 1]) == {0: 7, 1: 2}
    router.on_kv_events(0, [BlockRemoved(hashes[5:6])])
    assert router.matched_blocks(request, [0, 1]) == {0: 5, 1: 2}
    longer = _lazy_req("b", list(range(12)))  # the same blocks, then two more
    router.on_kv_events(1, [BlockStored(hashes[2:10], hashes[1], None)])
    assert router.matched_blocks(longer, [0, 1]) == {0: 5, 1: 10}
    assert router.matched_blocks(request, [1]) == {1: 10}


def test_cache_aware_kept_walk_outlives_a_store_of_its_first_miss(monkeypatch) -> None:
    """Each prompt of an application stores its first own block as it is prefilled: the walk
    kept for the application's system prompt, whose first miss that block was, goes on serving
    the application's next prompts (no new walk), and no longer trusts that block."""
    router = CacheAwareRouter(BS)
    system = list(range(6))
    first, second = _lazy_req("a", [*system, 100, 101]), _lazy_req("b", [*system, 200])
    hashes = list(prompt_block_hashes(first, BS))
    router.on_kv_events(0, [BlockStored(hashes[:6], None, None)])
    walks = [0]
    walk = CacheAwareRouter._walk

    def counting_walk(self, hashes):
        walks[0] += 1
        return walk(self, hashes)

    monkeypatch.setattr(CacheAwareRouter, "_walk", counting_walk)
    assert router.matched_blocks(first, [0, 1]) == {0: 6, 1: 0}
    router.on_kv_events(0, [BlockStored(hashes[6:8], hashes[5], None)])  # its own blocks
    assert router.matched_blocks(second, [0, 1]) == {0: 6, 1: 0}
    assert router.matched_blocks(first, [0, 1]) == {0: 8, 1: 0}
    assert walks[0] == 1
    router.on_kv_events(0, [BlockRemoved(hashes[3:4])])  # a block within the walk: walked anew
    assert router.matched_blocks(second, [0, 1]) == {0: 3, 1: 0}
    assert walks[0] == 2


def test_cache_aware_kept_walks_stay_bounded() -> None:
    router = CacheAwareRouter(BS)
    requests = [_lazy_req(f"p{i}", [i, i + 0.5, i + 0.25]) for i in range(2500)]
    for i, request in enumerate(requests):
        router.on_kv_events(i % 3, [BlockStored(list(prompt_block_hashes(request, BS))[:2],
                                                None, None)])
    sizes = []
    for i, request in enumerate(requests):
        assert router.matched_blocks(request, [0, 1, 2]) == {r: 2 * (r == i % 3) for r in range(3)}
        sizes.append(len(router._walks))
    assert max(sizes) == cache_aware._MAX_WALKS
    assert len(router._readers) <= cache_aware._MAX_READERS
