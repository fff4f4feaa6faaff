"""The scheduler's fast paths (the inlined decode path of ``_schedule_running``, the one-token
path of ``update_from_output``, ``num_prefill_tokens`` off the requests that may have prompt
left) against ``ReferenceScheduler``, their plain version: random
workloads, both run in lockstep, every step's output and the final state compared."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core import ModelRunnerOutput, SamplingParams, SchedulerConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.scheduler import Scheduler
from twinserve.core.scheduler_reference import ReferenceScheduler
from twinserve.policies import get_policy

EOS = 2
op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3),
              st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def _snapshot(out: SchedulerOutput) -> tuple:
    entries = tuple((sr.request_id, sr.start, sr.num_new_tokens, tuple(sr.block_ids), sr.sample)
                    for sr in out.scheduled)
    totals = (out.total_num_scheduled_tokens, out.num_prefill_tokens, out.num_decode_tokens,
              out.num_prefill_seqs, out.num_decode_seqs, out.sum_context_tokens,
              out.sum_decode_context_tokens, out.max_decode_context)
    return (entries, totals, tuple(out.preempted_request_ids), tuple(out.finished_request_ids),
            tuple(out.blocks_to_swap_out), tuple(out.blocks_to_swap_in),
            tuple(out.blocks_to_copy))


def _token(request_id: str, position: int) -> int:
    """What the 'model' samples: deterministic per request and position, EOS now and then."""
    value = (sum(map(ord, request_id)) * 31 + position * 17) % 23
    return EOS if value == 0 else 100 + value


def _state(s: Scheduler) -> tuple:
    return (tuple(r.request_id for r in s.running), s.num_waiting, s.kv.num_free_blocks,
            s.num_preemptions, s.num_prompt_tokens, s.num_generation_tokens,
            s.kv.prefix_hits, s.kv.prefix_queries, s.num_prefill_tokens)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=50),
       policy=st.sampled_from(["fcfs", "priority", "fair"]),
       mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), chunked=st.booleans(), stream=st.booleans(),
       threshold=st.sampled_from([0, 8]), first=st.booleans())
def test_fast_scheduler_equals_the_reference(ops, policy, mode, caching, chunked, stream,
                                             threshold, first) -> None:
    config = SchedulerConfig(num_gpu_blocks=24, block_size=4, max_num_seqs=5,
                             max_num_batched_tokens=48, max_model_len=48,
                             enable_prefix_caching=caching, enable_chunked_prefill=chunked,
                             long_prefill_token_threshold=threshold, preemption_mode=mode,
                             num_cpu_blocks=10, prefill_first=first and not chunked)
    pair = [cls(config, get_policy(policy), stream_outputs=stream)
            for cls in (Scheduler, ReferenceScheduler)]
    shared = list(range(300, 316))
    now, added = 0.0, []
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prio, n = o
            rid = f"r{len(added)}"
            prefix = shared[:min(plen, 4 + 4 * prio)] if prio else []
            prompt = prefix + [1000 + 50 * len(added) + i for i in range(plen - len(prefix))]
            params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=prio == 3)
            for s in pair:
                s.add_request(Request(rid, list(prompt), params, now, eos_token_id=EOS,
                                      priority=prio, tenant=f"t{prio % 2}"))
            added.append(rid)
        elif o[0] == "abort" and added:
            victim = added[o[1] % len(added)]
            ends = [[x.request_id for x in s.abort_requests([victim, f"{victim}#1"], now)]
                    for s in pair]
            assert ends[0] == ends[1]
        else:
            for _ in range(o[1] + 1):
                _lockstep(pair, now)
                now += 1.0
    for _ in range(500):
        if not pair[0].has_unfinished_requests():
            break
        _lockstep(pair, now)
        now += 1.0
    assert not pair[1].has_unfinished_requests()
    assert _state(pair[0]) == _state(pair[1])


def _lockstep(pair: list[Scheduler], now: float) -> None:
    outs = [s.schedule(now) for s in pair]
    assert _snapshot(outs[0]) == _snapshot(outs[1])
    results = []
    for s, out in zip(pair, outs):
        tokens = {sr.request_id: [_token(sr.request_id, sr.request.num_tokens)]
                  for sr in out.scheduled if sr.sample}
        core = s.update_from_output(out, ModelRunnerOutput(tokens), now + 0.5)
        results.append([(c.request_id, tuple(c.new_token_ids), c.finished, c.finish_reason,
                         c.stop_reason, c.num_cached_tokens) for c in core])
    assert results[0] == results[1]
    assert _state(pair[0]) == _state(pair[1])
