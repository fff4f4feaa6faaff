"""Property tests: random add/schedule/update/abort sequences never break the block accounting or
the budgets, and every request ends exactly once."""

from core_helpers import make_req, make_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core import ModelRunnerOutput, SamplingParams

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3),
              st.integers(0, 2), st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(0, 9)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=60),
       policy=st.sampled_from(["fcfs", "priority", "fair", "sjf", "lora_affinity"]),
       mode=st.sampled_from(["recompute", "swap"]),
       caching=st.booleans(), chunked=st.booleans())
def test_random_workloads_keep_invariants(ops, policy, mode, caching, chunked):
    s = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=48,
                       max_model_len=48, policy=policy, preemption_mode=mode, num_cpu_blocks=10,
                       enable_prefix_caching=caching, enable_chunked_prefill=chunked)
    shared = list(range(300, 316))
    added, ended = [], []
    added_reqs = []
    now = 0.0
    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, prio, tenant, n = o
            rid = f"r{len(added)}"
            req = make_req(rid, plen, prefix=shared[:min(plen, 8 * (prio % 2) + 4)] if prio else None,
                           params=SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=prio != 3),
                           priority=prio, tenant=f"t{tenant}", arrival=now)
            s.add_request(req)
            added.append(rid)
            added_reqs.append(req)
        elif o[0] == "abort" and added:
            victim = added[o[1] % len(added)]
            ended += [x.request_id for x in s.abort_requests([victim, f"{victim}#1"], now)]
        else:
            for _ in range(o[1] + 1):
                ended += _one_step(s, now)
                now += 1.0
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        ended += _one_step(s, now)
        now += 1.0
    assert not s.has_unfinished_requests()
    assert len(ended) == len(set(ended)), "a request ended twice"
    forked = {f"{r.request_id}#1" for r in added_reqs
              if r.sampling_params.n == 2 and r.num_output_tokens > 0}
    assert set(ended) == set(added) | forked, "a request never ended"
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == 24 and s.kv.host_pool.num_free == 10
    assert not s.kv.tables


def _one_step(s, now):
    out = s.schedule(now)
    assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
    assert len(out.scheduled) <= s.config.max_num_seqs
    assert len({sr.request_id for sr in out.scheduled}) == len(out.scheduled)
    for sr in out.scheduled:  # every token computed this step has a slot in its block table
        assert len(sr.block_ids) * s.config.block_size >= sr.start + sr.num_new_tokens
        assert sr.start == sr.request.num_computed_tokens
        assert sr.sample == (sr.start + sr.num_new_tokens == sr.request.num_tokens)
    # the step's totals (what the twin's cost model reads) recount its entries, also after the
    # scheduler took entries back to preempt
    chunks = [sr for sr in out.scheduled
              if sr.num_new_tokens > 1 or sr.start < sr.request.num_prompt_tokens]
    assert out.total_num_scheduled_tokens == sum(sr.num_new_tokens for sr in out.scheduled)
    assert out.num_prefill_seqs == len(chunks)
    assert out.num_prefix_chunks == sum(sr.start > 0 for sr in chunks)
    assert out.sum_prefix_context_tokens == sum(sr.start for sr in chunks)
    assert out.sum_prefill_attention_area == sum(sr.num_new_tokens * (sr.start + sr.num_new_tokens)
                                                 for sr in chunks)
    s.kv.check_consistency()
    token = 2 if int(now) % 5 == 0 else 9  # eos now and then
    outs = s.update_from_output(out, ModelRunnerOutput(
        {sr.request_id: [token] for sr in out.scheduled if sr.sample}), now + 0.5)
    assert len(s.running) <= s.config.max_num_seqs
    return [o.request_id for o in outs if o.finished]
