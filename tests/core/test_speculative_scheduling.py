"""Speculative decoding in the shared scheduler: property tests over random workloads with a
fake target model whose KV cache is simulated slot by slot, so a rolled-back draft that stayed
"computed", a cached block holding a rejected draft or a leaked lookahead block fails a test."""

from __future__ import annotations

import random

from core_helpers import make_req
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core import ModelRunnerOutput, SamplingParams, SchedulerConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.scheduler import Scheduler
from twinserve.policies import get_policy
from twinserve.policies.speculation import FixedSpeculation

VOCAB = 5  # small, so that stop tokens and draft hits happen


def true_token(rid: str, position: int) -> int:
    """The fake target model's greedy token at ``position`` (a function of the sequence)."""
    return 3 + (hash((rid, position)) % VOCAB)


class FakeTarget:
    """A greedy target model and a proposer that drafts the true token with ``hit_rate``.
    It keeps each KV slot's token and checks, before each forward pass, that every position an
    entry attends to holds the request's token there."""

    def __init__(self, block_size: int, hit_rate: float, seed: int,
                 window: int | None = None) -> None:
        self.bs = block_size
        self.window = window  # a sliding window: only positions inside it are read
        self.hit_rate = hit_rate
        self.rng = random.Random(seed)
        self.device: dict[int, list[int | None]] = {}
        self.host: dict[int, list[int | None]] = {}

    def _slot(self, store: dict, block: int) -> list[int | None]:
        return store.setdefault(block, [None] * self.bs)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for dev, host in out.blocks_to_swap_out:
            self.host[host] = list(self._slot(self.device, dev))
        for host, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self._slot(self.host, host))
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self._slot(self.device, src))
        result = ModelRunnerOutput()
        for sr in out.scheduled:
            req, bs = sr.request, self.bs
            first = 0 if self.window is None else max(0, sr.start - self.window + 1)
            for p in range(first, sr.start):  # the context this entry attends to
                assert self._slot(self.device, sr.block_ids[p // bs])[p % bs] == \
                    req.all_token_ids[p], f"{req.request_id}: stale KV at position {p}"
            for i, token in enumerate(sr.token_ids):
                p = sr.start + i
                self._slot(self.device, sr.block_ids[p // bs])[p % bs] = token
            if not sr.sample:
                continue
            rid = req.request_id
            # the first position sampled: after the entry's last real token
            base = sr.start + sr.num_new_tokens - len(sr.spec_token_ids)
            tokens = []
            for j, draft in enumerate(sr.spec_token_ids):
                if draft != true_token(rid, base + j):
                    break
                tokens.append(draft)
            tokens.append(true_token(rid, base + len(tokens)))
            result.sampled_token_ids[rid] = tokens
            if sr.num_draft_next:
                nxt = base + len(tokens)
                result.spec_token_ids[rid] = [
                    true_token(rid, nxt + j) if self.rng.random() < self.hit_rate else 0
                    for j in range(sr.num_draft_next)]
        return result


def make_spec_scheduler(k: int, **kwargs) -> Scheduler:
    config = SchedulerConfig(num_speculative_tokens=k, **kwargs)
    return Scheduler(config, get_policy("fcfs"), speculation=FixedSpeculation(k))


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 14), st.integers(0, 3),
              st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def run_ops(s: Scheduler, target: FakeTarget, ops, steps_cap: int = 3000):
    shared = list(range(300, 316))
    added, ended, outputs = [], [], {}
    now = 0.0

    def one_step():
        nonlocal now
        out = s.schedule(now)
        check_step(s, out)
        for o in s.update_from_output(out, target.execute(out), now + 0.5):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                ended.append(o.request_id)
        check_after_update(s)
        now += 1.0

    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, kind, n = o
            rid = f"r{len(added)}"
            stop = () if kind else (3,)
            s.add_request(make_req(rid, plen, prefix=shared[:min(plen, 4 + 4 * kind)],
                                   params=SamplingParams(n=n, max_tokens=max_tokens,
                                                         ignore_eos=True, stop_token_ids=stop),
                                   arrival=now))
            added.append(rid)
        elif o[0] == "abort" and added:
            victim = added[o[1] % len(added)]
            ended += [x.request_id for x in s.abort_requests([victim], now)]
        else:
            for _ in range(o[1] + 1):
                one_step()
    for _ in range(steps_cap):
        if not s.has_unfinished_requests():
            break
        one_step()
    return added, ended, outputs


def check_step(s: Scheduler, out: SchedulerOutput) -> None:
    cfg = s.config
    assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
    assert out.total_num_scheduled_tokens == sum(sr.num_new_tokens for sr in out.scheduled)
    assert out.num_spec_tokens == sum(len(sr.spec_token_ids) for sr in out.scheduled)
    for sr in out.scheduled:
        req, k = sr.request, len(sr.spec_token_ids)
        assert len(sr.block_ids) * cfg.block_size >= sr.start + sr.num_new_tokens
        assert k <= cfg.num_speculative_tokens
        if k:  # a verification: one decode of 1 + k tokens, within max_tokens
            assert sr.sample and sr.num_new_tokens == 1 + k
            assert sr.token_ids == req.all_token_ids[sr.start:sr.start + 1] + sr.spec_token_ids
            assert req.num_output_tokens + k + 1 <= req.max_output_tokens
        assert sr.num_draft_next <= cfg.num_speculative_tokens
    decodes = [sr for sr in out.scheduled if sr.spec_token_ids
               or (sr.num_new_tokens == 1 and sr.start >= sr.request.num_prompt_tokens)]
    assert out.num_decode_seqs == len(decodes)
    assert out.num_decode_tokens == sum(sr.num_new_tokens for sr in decodes)
    assert out.sum_decode_context_tokens == sum(
        sum(sr.start + i for i in range(1, sr.num_new_tokens + 1)) for sr in decodes)
    s.kv.check_consistency()


def check_after_update(s: Scheduler) -> None:
    """Blocks beyond the verified tokens (+1 slot) are released; only verified ones cached."""
    bs = s.config.block_size
    for rid, table in s.kv.tables.items():
        req = s.requests[rid]
        if req.swapped_out:
            continue
        assert len(table.blocks) <= -(-(req.num_computed_tokens + 1) // bs), rid
        # (a forked sample shares its parent's cached prompt blocks)
        verified = max(req.num_computed_tokens, req.num_prompt_tokens if req.parent_id else 0)
        assert table.num_cached_blocks * bs <= verified, rid
    s.kv.check_consistency()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=60), k=st.integers(1, 5),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans(),
       chunked=st.booleans(), hit=st.sampled_from([0.0, 0.5, 0.9, 1.0]), seed=st.integers(0, 9),
       layout=st.sampled_from(["full", "full", "sliding", "hybrid"]))
def test_rollback_never_leaks_and_outputs_equal_plain_decoding(ops, k, mode, caching, chunked,
                                                               hit, seed, layout):
    blocks = 40 if layout == "hybrid" else 24
    kwargs = dict(num_gpu_blocks=blocks, block_size=4, max_num_seqs=5, max_num_batched_tokens=48,
                  max_model_len=48, preemption_mode=mode, num_cpu_blocks=10,
                  enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    if layout == "sliding":
        kwargs["sliding_window"] = 8
    elif layout == "hybrid":
        kwargs["kv_cache_group_windows"] = (None, 8)
    window = 8 if layout == "sliding" else None
    s = make_spec_scheduler(k, **kwargs)
    added, ended, outputs = run_ops(s, FakeTarget(4, hit, seed, window), ops)
    assert not s.has_unfinished_requests()
    assert len(ended) == len(set(ended)), "a request ended twice"
    s.kv.check_consistency()
    null = 0 if layout == "full" else 1
    assert s.kv.num_free_blocks == blocks - null and s.kv.host_pool.num_free == 10
    assert not s.kv.tables
    # greedy: the same tokens as without speculation, aborts aside
    plain = Scheduler(SchedulerConfig(**kwargs), get_policy("fcfs"))
    _, _, plain_outputs = run_ops(plain, FakeTarget(4, 0.0, seed, window), ops)
    if not any(o[0] == "abort" for o in ops):  # (an abort lands at another point of a request)
        assert outputs == plain_outputs
    stats = s.stats()
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert sum(stats.spec_num_accepted_tokens_per_pos) == stats.spec_num_accepted_tokens
    if hit == 0.0:
        assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens // VOCAB * 3 + 5


def _pressure_ops():
    return [("add", 12, 14, 1, 1), ("add", 9, 14, 0, 2), ("add", 14, 14, 2, 1),
            ("add", 8, 14, 1, 1), ("step", 2), ("add", 11, 14, 3, 1), ("add", 6, 14, 2, 1)]


def test_preemption_under_speculation_keeps_outputs_and_blocks():
    """A deterministic run under memory pressure: preemptions happen, drafts are accepted, and
    the outputs equal plain decoding's, for both preemption modes."""
    for mode in ("recompute", "swap"):
        kwargs = dict(num_gpu_blocks=14, block_size=4, max_num_seqs=5, max_num_batched_tokens=32,
                      max_model_len=48, preemption_mode=mode, num_cpu_blocks=12)
        s = make_spec_scheduler(3, **kwargs)
        _, _, outputs = run_ops(s, FakeTarget(4, 0.9, 1), _pressure_ops())
        plain = Scheduler(SchedulerConfig(**kwargs), get_policy("fcfs"))
        _, _, plain_outputs = run_ops(plain, FakeTarget(4, 0.0, 1), _pressure_ops())
        stats = s.stats()
        assert stats.num_preemptions > 0, mode
        assert stats.spec_num_accepted_tokens > 0, mode
        assert outputs == plain_outputs, mode
        assert s.kv.num_free_blocks == 14 and not s.kv.tables


def test_drafts_are_clipped_to_budget_and_max_tokens():
    s = make_spec_scheduler(4, num_gpu_blocks=64, block_size=4, max_num_seqs=8,
                            max_num_batched_tokens=6, max_model_len=64)
    for i in range(3):
        s.add_request(make_req(f"q{i}", 3, params=SamplingParams(max_tokens=5, ignore_eos=True)))
    target = FakeTarget(4, 1.0, 0)
    seen_spec = False
    for step_no in range(40):
        if not s.has_unfinished_requests():
            break
        out = s.schedule(float(step_no))
        check_step(s, out)
        seen_spec |= out.num_spec_tokens > 0
        s.update_from_output(out, target.execute(out), step_no + 0.5)
        check_after_update(s)
    assert not s.has_unfinished_requests() and seen_spec
    assert s.num_generation_tokens == 15
