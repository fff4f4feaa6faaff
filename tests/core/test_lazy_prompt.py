"""Lazy prompts (``core.request.LazyPrompt``): a replay's synthetic prompts without their id lists,
their full blocks keyed from the request's identity (``traces.iter_prompt_parts``). Against the
plain path: the sequences read as the lists would, and simulations give the same run folders
with lazy prompts as with the plain id lists (``simulate(lazy_prompts=False)``)."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from twinserve.core.block_hash import _update_block_hashes_plain, update_block_hashes
from twinserve.core.request import LazyPrompt, LazyTokenIds, RepeatedTokenIds, Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.simulator import SimConfig, simulate, write_sim_run
from twinserve.simulator.engine import SIMULATED_TOKEN
from twinserve.simulator.run import _engine_requests
from twinserve.traces import LOWEST_TOKEN_ID, SyntheticConfig, TraceRequest, synthetic_trace
from twinserve.traces.trace_request import iter_prompt_parts, prompt_ids_slice

VOCAB = 49_152
SMALL = {"model": "smollm2-135m", "hardware": "a100-80gb"}


def _trace() -> list[TraceRequest]:
    """Shared system prompts of several lengths (prefix blocks of 24 tokens: not the KV block
    size), prompts ending within their prefix's last block, and requests of their own."""
    rng = random.Random(5)
    out, t = [], 0.0
    for i in range(120):
        t += rng.expovariate(30.0)
        blocks = tuple(rng.sample(range(4), rng.randint(0, 3)))
        low = max(1, (len(blocks) - 1) * 24 + 1)
        out.append(TraceRequest(f"lz-{i}", t, rng.randint(low, 140), rng.randint(1, 40),
                                prefix_blocks=blocks, prefix_block_tokens=24,
                                lora=rng.choice([None, None, "x"])))
    return out


def test_prompt_parts_and_slices_are_the_prompts_own_ids() -> None:
    trace = _trace()
    for tr, parts in zip(trace, iter_prompt_parts(trace, VOCAB, 16, batch_requests=7)):
        ids = tr.prompt_token_ids(VOCAB)
        assert parts.tail_start == len(ids) // 16 * 16
        assert parts.tail == ids[parts.tail_start:]
        assert len(parts.keys) == len(ids) // 16
        for a, b in ((0, len(ids)), (1, min(5, len(ids))), (len(ids) // 2, len(ids))):
            assert prompt_ids_slice(tr, VOCAB, a, b) == ids[a:b]


def test_a_block_holding_the_prefixs_end_is_shared_where_the_first_own_ids_are() -> None:
    """Keys equal exactly where the ids are, both ways, for the block that holds a shared
    prefix's end and a prompt's first own id: with 8 ids to draw from, such ids coincide."""
    vocab = LOWEST_TOKEN_ID + 8
    trace = [TraceRequest(f"c-{i}", 0.0, 40, 1, prefix_blocks=(1,), prefix_block_tokens=31)
             for i in range(40)]
    blocks = [(tuple(tr.prompt_token_ids(vocab)[:32]), parts.keys[1])
              for tr, parts in zip(trace, iter_prompt_parts(trace, vocab, 16))]
    pairs = [(a == b, ka == kb) for i, (a, ka) in enumerate(blocks) for b, kb in blocks[:i]]
    assert all(same_ids == same_key for same_ids, same_key in pairs)
    assert any(same for same, _ in pairs) and not all(same for same, _ in pairs)
    lazy = {r.request_id: r for r in _engine_requests(trace, vocab, 16)}
    assert {r.own_ids_from for r in lazy.values()} == {32}


def test_block_keys_are_equal_exactly_where_the_prefixes_are() -> None:
    trace = _trace()
    keys = {}
    for tr, parts in zip(trace, iter_prompt_parts(trace, VOCAB, 16)):
        ids = tr.prompt_token_ids(VOCAB)
        for i, k in enumerate(parts.keys):
            keys.setdefault(k, set()).add(tuple(ids[:(i + 1) * 16]))
    assert all(len(prefixes) == 1 for prefixes in keys.values())
    prefixes = [p for ps in keys.values() for p in ps]
    assert len(set(prefixes)) == len(prefixes) == len(keys)
    assert len(keys) < sum(tr.input_tokens // 16 for tr in trace)  # some are shared


def test_lazy_token_ids_read_and_grow_as_the_list() -> None:
    tr = TraceRequest("one", 0.0, 37, 5, prefix_blocks=(1,), prefix_block_tokens=16)
    (parts,) = iter_prompt_parts([tr], VOCAB, 16)
    prompt = LazyPrompt(37, lambda a, b: prompt_ids_slice(tr, VOCAB, a, b), parts.tail_start,
                        parts.tail, 16, parts.keys)
    ids = tr.prompt_token_ids(VOCAB)
    assert prompt == ids and list(prompt) == ids and len(prompt) == 37
    assert prompt[-1] == ids[-1] and prompt[3] == ids[3] and prompt[5:40:3] == ids[5:40:3]
    with pytest.raises(IndexError):
        prompt[37]
    outputs: list[int] = []
    lazy, plain = LazyTokenIds(prompt, outputs), list(ids)
    for tokens in ([7], [8, 9, 10], []):
        outputs += tokens  # (the engine's order: the outputs first)
        lazy += tokens
        plain += tokens
    outputs.append(11)
    lazy.append(11)
    plain.append(11)
    assert len(lazy) == len(plain) and list(lazy) == plain and lazy == plain
    for s in (slice(30, 42), slice(0, 5), slice(37, 41), slice(40, 100), slice(None, None, 2)):
        assert lazy[s] == plain[s]
    assert lazy[-1] == 11 and lazy[36] == ids[36]


@pytest.mark.parametrize("repeated", [True, False], ids=["repeated-outputs", "listed-outputs"])
def test_lazy_token_ids_refuse_tokens_their_outputs_do_not_hold(repeated: bool) -> None:
    """A lazy request's tokens after its prompt are its outputs, one sequence: a token added to
    ``all_token_ids`` alone, or two where the outputs got one, raises rather than vanishing;
    with the twin's outputs (a count of its one token) as with a list."""
    (request,) = _engine_requests(_trace()[:1], VOCAB, 16)
    if not repeated:
        request = Request("listed", request.prompt_token_ids, request.sampling_params, 0.0)
    assert isinstance(request.output_token_ids, RepeatedTokenIds) == repeated
    tokens = request.all_token_ids
    assert isinstance(tokens, LazyTokenIds) and tokens.outputs is request.output_token_ids
    n, t = len(tokens), SIMULATED_TOKEN
    request.append_output_token(t, 1.0)
    request.output_token_ids += [t, t]
    tokens += [t, t]
    assert len(tokens) == n + 3 and tokens[n:] == [t, t, t] and tokens[-1] == t
    with pytest.raises(RuntimeError, match="append to output_token_ids first"):
        tokens.append(t)
    request.output_token_ids.append(t)
    with pytest.raises(RuntimeError, match="3 tokens added after the prompt, 4 outputs"):
        tokens.extend([])
    request.output_token_ids.append(t)
    with pytest.raises(RuntimeError, match="6 tokens added after the prompt, 5 outputs"):
        tokens += [t, t]


def test_repeated_token_ids_read_as_the_list_of_that_id() -> None:
    """The twin's outputs, a count of one id: read, compared and grown as the list would be;
    another id is refused by name."""
    ids, listed = RepeatedTokenIds(17), []
    for grow in (lambda x: x.append(17), lambda x: x.extend([17, 17]), lambda x: x.__iadd__([17])):
        grow(ids)
        grow(listed)
    assert len(ids) == 4 and ids == listed and listed == ids and ids == tuple(listed)
    assert list(ids) == listed and ids[0] == ids[-1] == 17 and ids[1:3] == listed[1:3]
    assert ids[::2] == listed[::2] and ids[5:] == [] and 17 in ids and ids.count(17) == 4
    assert ids != [17, 17] and ids != [17, 17, 17, 18] and ids == RepeatedTokenIds(17, 4)
    with pytest.raises(IndexError):
        ids[4]
    for grow in (lambda: ids.append(18), lambda: ids.extend([17, 18]), lambda: ids.__iadd__([3])):
        with pytest.raises(ValueError, match=r"one repeated token id \(17\) cannot take token id (18|3)"):
            grow()
    assert len(ids) == 4  # (nothing of a refused extend was taken)
    assert repr(ids) == "RepeatedTokenIds(token=17, n=4)"
    with pytest.raises(ValueError, match="negative"):
        RepeatedTokenIds(17, -1)


def test_requests_chain_on_from_the_keys_over_their_ids() -> None:
    """A lazy request's hashes: its prompt's keys, then the plain chain from the last of them
    over the ids after (a decode's blocks hashed as the plain path hashes them)."""
    trace = _trace()
    for lazy, plain in zip(_engine_requests(trace, VOCAB, 16),
                           _engine_requests(trace, VOCAB, 16, lazy=False)):
        assert isinstance(lazy.all_token_ids, LazyTokenIds) and lazy.all_token_ids == plain.all_token_ids
        for r in (lazy, plain):
            r.output_token_ids += [17] * 40
            r.all_token_ids += [17] * 40
        n = len(plain.all_token_ids)
        update_block_hashes(lazy, 16, n)
        keys = lazy.block_hashes[:len(plain.prompt_token_ids) // 16]
        reference = Request(lazy.request_id, list(plain.prompt_token_ids), SamplingParams(),
                            0.0, lora=lazy.lora)
        reference.all_token_ids += [17] * 40
        reference.block_hashes = list(keys)  # the keys standing in for the prompt's chain
        assert lazy.block_hashes == _update_block_hashes_plain(reference, 16, n)


@pytest.mark.parametrize("settings", [
    {"scheduling_policy": "fair", "max_num_seqs": 16, "num_gpu_blocks_override": 120},
    {"preemption_mode": "recompute", "num_gpu_blocks_override": 60, "max_num_seqs": 32},
    {"num_replicas": 2, "router": "prefix-affinity", "num_gpu_blocks_override": 200},
    {"enable_lora": True, "max_loras": 2, "block_size": 32},
], ids=["fair", "recompute", "prefix-affinity", "lora-block-32"])
def test_lazy_prompts_give_the_run_folders_of_the_plain_lists(settings: dict,
                                                              tmp_path: Path) -> None:
    trace = _trace()
    if not settings.get("enable_lora"):
        trace = [dataclasses.replace(tr, lora=None) for tr in trace]
    wl = synthetic_trace(SyntheticConfig(num_requests=80, input_len=300, output_len=30,
                                         range_ratio=0.8, prefix_len=128, prefix_share=0.5,
                                         seed=11))
    for name, tr in (("mixed", trace), ("synthetic", wl)):
        cfg = SimConfig(**SMALL, **settings)
        folders = [write_sim_run(simulate(cfg, tr, lazy_prompts=lazy), tmp_path / f"{name}-{lazy}",
                                 {"trace": name}) for lazy in (True, False)]
        for f in ("requests.csv", "steps.csv", "summary.json", "tenants.csv"):
            assert (folders[0] / f).read_bytes() == (folders[1] / f).read_bytes(), (name, f)


@pytest.mark.parametrize("settings", [
    {"preemption_mode": "recompute"},
    {"preemption_mode": "swap"},
    {"preemption_mode": "swap", "swap_space": 0.0002},  # too little host memory: recompute
], ids=["recompute", "swap", "swap-falls-back"])
def test_own_blocks_registered_at_preemption_give_the_plain_run(settings: dict,
                                                                tmp_path: Path) -> None:
    """A lazy prompt's own blocks enter the prefix cache only when their request is preempted
    (``Request.own_ids_from``); the plain lists register every block as it fills. Preempted
    requests then find the same blocks again, so the run folders are the same."""
    wl = synthetic_trace(SyntheticConfig(num_requests=60, input_len=120, output_len=160,
                                         range_ratio=0.8, prefix_len=40, prefix_share=0.5,
                                         request_rate=50.0, seed=3))
    cfg = SimConfig(**SMALL, num_gpu_blocks_override=48, max_num_seqs=32, **settings)
    results = [simulate(cfg, wl, lazy_prompts=lazy) for lazy in (True, False)]
    assert results[0].summary["num_preemptions"] > 20
    folders = [write_sim_run(r, tmp_path / str(i), {"trace": "wl"}) for i, r in enumerate(results)]
    for f in ("requests.csv", "steps.csv", "summary.json"):
        assert (folders[0] / f).read_bytes() == (folders[1] / f).read_bytes(), f


def test_a_request_registers_its_own_blocks_only_when_preempted() -> None:
    from twinserve.core.kv_cache_manager import KVCacheManager
    tr = TraceRequest("mine", 0.0, 70, 5, prefix_blocks=(1,), prefix_block_tokens=24)
    (request,) = _engine_requests([tr], VOCAB, 16)
    assert request.own_ids_from == 32  # (block 1 holds the prefix's end: registered as it fills)
    short = dataclasses.replace(tr, request_id="short", input_tokens=30)
    assert next(_engine_requests([short], VOCAB, 16)).own_ids_from == 24  # outputs fill block 1
    kv = KVCacheManager(20, 16)
    kv.allocate_slots(request, 70)
    request.num_computed_tokens = 70
    kv.cache_full_blocks(request)  # 4 full blocks: 0 shared, 1 shared and own, 2-3 its own
    assert len(kv.pool.cached) == 2 and kv.tables["mine"].num_cached_blocks == 4
    kv.register_own(request)
    assert len(kv.pool.cached) == 4 and request.own_ids_from is None
    assert set(kv.pool.cached) == set(request.block_hashes[:4])
    (twin,) = _engine_requests([dataclasses.replace(tr, request_id="other")], VOCAB, 16)
    assert kv.get_computed_blocks(twin)[1] == 16  # another request: only the shared block
