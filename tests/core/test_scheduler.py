import pytest
from core_helpers import make_req, make_scheduler, run_to_completion, step

from twinserve.core import ModelRunnerOutput, RequestStatus, SamplingParams, SchedulerConfig


def test_token_budget_and_chunked_prefill():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_req("a", 20, max_tokens=2))
    out, outs = step(s, 0.0)
    (sr,) = out.scheduled
    assert (sr.start, sr.num_new_tokens, sr.sample) == (0, 8, False) and outs == []
    out, _ = step(s, 1.0)
    out, outs = step(s, 2.0)
    assert (out.scheduled[0].start, out.scheduled[0].num_new_tokens) == (16, 4)
    assert out.scheduled[0].sample and outs[0].new_token_ids == [7]
    assert out.num_prefill_tokens == 4 and out.sum_context_tokens == 17 + 18 + 19 + 20
    # a chunk after the prompt's earlier chunks attends to a prefix: it is counted apart
    assert out.num_prefix_chunks == 1 and out.sum_prefix_context_tokens == 16


def test_prefix_chunks_are_the_chunks_after_computed_tokens():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(make_req("a", 20, max_tokens=2))
    out, _ = step(s, 0.0)  # the first chunk starts at position 0
    assert out.sum_context_tokens == sum(range(1, 17)) and out.num_prefix_chunks == 0
    s.add_request(make_req("b", 6, max_tokens=2))
    out, _ = step(s, 1.0)  # a's tokens 16..19 after 16 computed, and b's whole prompt
    assert out.num_prefill_seqs == 2 and out.num_prefix_chunks == 1
    assert out.sum_prefix_context_tokens == 16  # a's prefix; b's chunk starts at 0
    # each chunk's query-by-key rectangle: a's 4 x 20, b's 6 x 6
    assert out.sum_prefill_attention_area == 4 * 20 + 6 * 6


def test_decodes_first_then_waiting_fill_the_budget_in_the_same_step():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_req("a", 6, max_tokens=3))
    step(s, 0.0)
    s.add_request(make_req("b", 30))
    out, _ = step(s, 1.0)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 9
    assert out.sum_decode_context_tokens == 7 and out.max_decode_context == 7


def test_decode_context_sums_and_longest_over_mixed_lengths():
    s = make_scheduler(max_num_batched_tokens=64)
    for rid, n in (("a", 5), ("b", 17), ("c", 9)):  # 17: the decode crosses a block boundary
        s.add_request(make_req(rid, n, max_tokens=4))
    step(s, 0.0)
    out, _ = step(s, 1.0)
    assert out.num_decode_seqs == 3 and out.sum_decode_context_tokens == 6 + 18 + 10
    assert out.max_decode_context == 18 and out.sum_context_tokens == 34


def test_continuous_batching_finished_leave_waiting_join():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    s.add_request(make_req("a", 4, max_tokens=1))
    s.add_request(make_req("b", 4, max_tokens=5))
    s.add_request(make_req("c", 4, max_tokens=5))
    out, outs = step(s, 0.0)
    assert {x.request_id for x in out.scheduled} == {"a", "b"}
    assert [o.request_id for o in outs if o.finished] == ["a"]
    out, _ = step(s, 1.0)
    assert [x.request_id for x in out.scheduled] == ["b", "c"]
    assert out.finished_request_ids == ["a"]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(max_num_batched_tokens=32, max_model_len=32, enable_chunked_prefill=False)
    s.add_request(make_req("a", 20))
    s.add_request(make_req("b", 20))
    out, _ = step(s, 0.0)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 20)]
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(num_gpu_blocks=8, max_num_batched_tokens=16, max_model_len=32,
                        enable_chunked_prefill=False)


def test_long_prefill_threshold_caps_chunks():
    s = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=5)
    s.add_request(make_req("a", 12))
    out, _ = step(s, 0.0)
    assert out.scheduled[0].num_new_tokens == 5


@pytest.mark.parametrize("params,tokens,reason,length", [
    (SamplingParams(max_tokens=10), [5, 2, 5], "stop", 2),                       # eos
    (SamplingParams(max_tokens=10, ignore_eos=True), [2] * 10, "length", 10),
    (SamplingParams(max_tokens=10, stop_token_ids=[9]), [5, 9], "stop", 2),
    (SamplingParams(max_tokens=10, min_tokens=3), [2, 2, 2, 2], "stop", 3),
    (SamplingParams(max_tokens=3), [5] * 5, "length", 3),
    (SamplingParams(max_tokens=None), [5] * 50, "length", 12),                    # max_model_len
])
def test_stop_conditions(params, tokens, reason, length):
    s = make_scheduler(max_model_len=16)
    s.add_request(make_req("a", 4, params=params))
    now = 0.0
    for tok in tokens:
        out = s.schedule(now)
        if not out.scheduled:
            break
        outs = s.update_from_output(out, ModelRunnerOutput({"a": [tok]}), now)
        now += 1
        if outs and outs[0].finished:
            assert outs[0].finish_reason == reason
            break
    req = out.scheduled[0].request
    assert req.num_output_tokens == length and req.finish_reason == reason
    if params.stop_token_ids and reason == "stop":
        assert req.stop_reason == 9
    assert s.kv.num_free_blocks == s.config.num_gpu_blocks


def test_prompt_too_long_or_too_big_for_the_cache_is_rejected():
    s = make_scheduler(max_model_len=16, num_blocks=2, block_size=4)
    with pytest.raises(ValueError, match="maximum context length is 16 tokens.*20 input tokens"):
        s.add_request(make_req("a", 20))
    with pytest.raises(ValueError, match="KV-cache blocks"):
        s.add_request(make_req("b", 12))
    assert not s.has_unfinished_requests()


def test_recompute_preemption_picks_the_latest_admitted_and_everything_finishes():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    for i in range(3):
        s.add_request(make_req(f"r{i}", 7, max_tokens=9))
    out, _ = step(s, 0.0)
    assert len(out.scheduled) == 3  # 2 blocks each
    preempted = []
    now = 1.0
    while s.has_unfinished_requests():
        out, _ = step(s, now)
        preempted += out.preempted_request_ids
        _assert_live_block_tables(s, out)
        now += 1
    assert preempted and preempted[0] == "r2"
    assert s.num_preemptions == len(preempted)
    assert s.kv.num_free_blocks == 6
    s.kv.check_consistency()


def _assert_live_block_tables(s, out) -> None:
    """Entries (reused decode entries included) point at their request's current block table."""
    for sr in out.scheduled:
        table = s.kv.tables.get(sr.request_id)
        assert table is None or sr.block_ids is table.ids, sr.request_id


def test_swap_preemption_moves_blocks_and_resumes_without_recompute():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64,
                       preemption_mode="swap", num_cpu_blocks=8)
    reqs = [make_req(f"r{i}", 7, max_tokens=9) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    swapped_out = swapped_in = 0
    now = 0.0
    while s.has_unfinished_requests():
        out = s.schedule(now)
        swapped_out += len(out.blocks_to_swap_out)
        swapped_in += len(out.blocks_to_swap_in)
        for sr in out.scheduled:
            # a resumed request continues where it stopped: no prefill again
            if sr.request.num_output_tokens:
                assert sr.num_new_tokens == 1
        _assert_live_block_tables(s, out)  # before the update: swap-outs replace the tables
        s.update_from_output(out, ModelRunnerOutput(
            {sr.request_id: [7] for sr in out.scheduled if sr.sample}), now)
        now += 1
    assert swapped_out > 0 and swapped_in == swapped_out
    assert all(r.num_output_tokens == 9 for r in reqs)
    assert s.kv.num_free_blocks == 6 and s.kv.host_pool.num_free == 8


def test_abort_frees_blocks_wherever_the_request_is():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_req("a", 8, max_tokens=20))
    s.add_request(make_req("b", 8))
    step(s, 0.0)
    outs = s.abort_requests(["a", "b", "unknown"], 1.0)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "abort"), ("b", "abort")]
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == s.config.num_gpu_blocks
    out = s.schedule(2.0)
    assert sorted(out.finished_request_ids) == ["a", "b"] and not out.scheduled


def test_abort_while_the_step_runs_drops_its_result():
    s = make_scheduler()
    s.add_request(make_req("a", 8))
    out = s.schedule(0.0)
    s.abort_requests(["a"], 0.5)
    assert s.update_from_output(out, ModelRunnerOutput({"a": [3]}), 1.0) == []
    assert s.kv.num_free_blocks == s.config.num_gpu_blocks


def test_n_samples_fork_after_prefill_with_copy_on_write():
    s = make_scheduler(block_size=4, max_num_seqs=4)
    s.add_request(make_req("p", 6, params=SamplingParams(n=3, max_tokens=4, ignore_eos=True)))
    out, outs = step(s, 0.0)
    assert [o.request_id for o in outs] == ["p"]
    samples = [s.requests[k] for k in ("p", "p#1", "p#2")]
    out = s.schedule(1.0)
    ids = {sr.request_id: sr for sr in out.scheduled}
    assert set(ids) == {"p", "p#1", "p#2"}
    assert ids["p#1"].start == 5 and ids["p#1"].num_new_tokens == 1 and ids["p#1"].sample
    assert len(out.blocks_to_copy) == 2  # the shared partial block, once per child
    s.update_from_output(out, ModelRunnerOutput({k: [1] for k in ids}), 1.0)
    run_to_completion(s)
    assert [r.num_output_tokens for r in samples] == [4, 4, 4]
    assert s.kv.num_free_blocks == s.config.num_gpu_blocks


def test_n_samples_reserve_their_seats():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=8)
    s.add_request(make_req("p", 12, params=SamplingParams(n=2, max_tokens=2, ignore_eos=True)))
    s.add_request(make_req("q", 4))
    s.add_request(make_req("r", 4))
    out, _ = step(s, 0.0)  # p's prefill is chunked: its child's seat stays reserved
    assert [x.request_id for x in out.scheduled] == ["p"]
    run_to_completion(s)


def test_prefix_caching_skips_cached_prompt_tokens():
    s = make_scheduler(block_size=4, max_num_batched_tokens=64)
    shared = list(range(500, 516))
    s.add_request(make_req("a", 20, prefix=shared))
    run_to_completion(s)
    s.add_request(make_req("b", 20, prefix=shared))
    out, _ = step(s, 10.0)
    assert out.scheduled[0].start == 16 and out.scheduled[0].num_new_tokens == 4
    req = out.scheduled[0].request
    assert req.num_cached_tokens == 16
    assert s.stats().prefix_cache_hits == 16


def test_timestamps_for_metrics():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_req("a", 4, max_tokens=3, arrival=0.0))
    s.add_request(make_req("b", 4, max_tokens=3, arrival=0.0))
    reqs = dict(s.requests)
    now = 0.0
    while s.has_unfinished_requests():
        out = s.schedule(now)
        s.update_from_output(out, ModelRunnerOutput(
            {sr.request_id: [7] for sr in out.scheduled if sr.sample}), now + 0.5)
        now += 1.0
    a, b = reqs["a"], reqs["b"]
    assert (a.first_scheduled_time, a.first_token_time, a.finish_time) == (0.0, 0.5, 2.5)
    assert a.token_times.times() == [0.5, 1.5, 2.5]
    assert b.first_scheduled_time == 3.0 and b.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_running_decode_entry_is_updated_in_place_and_dropped_at_the_end():
    s = make_scheduler(block_size=4)
    s.add_request(make_req("a", 5, max_tokens=8))
    step(s, 0.0)  # prefill
    first, _ = step(s, 1.0)  # first decode: a fresh entry
    second, _ = step(s, 2.0)
    (e1,), (e2,) = first.scheduled, second.scheduled
    assert e2 is e1 and (e2.start, e2.num_new_tokens, e2.sample) == (6, 1, True)
    assert e2.block_ids is s.kv.block_ids(s.requests["a"])
    run_to_completion(s)
    assert e1.request.decode_entry is None  # a finished request keeps no entry behind


def test_a_decode_crossing_a_block_boundary_gets_one_block_and_caches_the_full_one():
    s = make_scheduler(block_size=4, enable_prefix_caching=True)
    a = make_req("a", 6, max_tokens=10)
    s.add_request(a)
    step(s, 0.0)  # prefill: 6 tokens in 2 blocks, the first one full and cached
    kv = s.kv
    for t in range(1, 9):  # decodes at positions 6..13 cross into blocks 2 and 3
        step(s, float(t))
        table = kv.tables["a"]
        assert len(table.blocks) == -(-a.num_computed_tokens // 4)
        assert table.num_cached_blocks == a.num_computed_tokens // 4 == len(a.block_hashes)
        for block, h in zip(table.blocks, a.block_hashes):
            assert block.block_hash == h and kv.pool.cached[h] is block
        kv.check_consistency()
    assert a.num_computed_tokens == 14 and len(kv.tables["a"].blocks) == 4
    step(s, 9.0)  # the last token: a finishes, its full blocks stay cached
    assert a.is_finished and "a" not in kv.tables
    b = make_req("b", 14, max_tokens=2, prefix=a.all_token_ids[:13])
    s.add_request(b)
    out, _ = step(s, 10.0)
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_new_tokens == 2
    assert out.num_prefix_chunks == 1  # after the 12 cached tokens
    kv.check_consistency()


@pytest.mark.parametrize("sampled", [{}, {"a": []}])
def test_a_backend_without_a_token_for_a_sampling_entry_is_an_error(sampled):
    s = make_scheduler()
    s.add_request(make_req("a", 5))
    out = s.schedule(0.0)
    with pytest.raises(RuntimeError, match="no token for 'a'"):
        s.update_from_output(out, ModelRunnerOutput(sampled), 1.0)


def test_several_tokens_at_once_are_appended_up_to_a_stop_and_counted():
    s = make_scheduler(max_num_batched_tokens=8)
    s.add_request(make_req("a", 12, params=SamplingParams(max_tokens=10, stop_token_ids=[9])))
    s.add_request(make_req("b", 4, max_tokens=6))
    out = s.schedule(0.0)  # b waits: a's prefill chunk fills the budget
    assert [(x.request_id, x.sample) for x in out.scheduled] == [("a", False)]
    s.update_from_output(out, ModelRunnerOutput({}), 0.5)
    out = s.schedule(1.0)
    outs = s.update_from_output(out, ModelRunnerOutput({"a": [5, 6], "b": [7]}), 1.5)
    assert [(o.request_id, o.new_token_ids) for o in outs] == [("a", [5, 6]), ("b", [7])]
    a, b = (x.request for x in out.scheduled)
    assert a.output_token_ids == [5, 6] and a.token_times.times() == [1.5, 1.5]
    assert s.num_generation_tokens == 3
    out = s.schedule(2.0)  # a has two new tokens to compute, b decodes
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 2), ("b", 1)]
    outs = s.update_from_output(out, ModelRunnerOutput({"a": [8, 9, 4], "b": [7]}), 2.5)
    assert outs[0].new_token_ids == [8, 9] and outs[0].finish_reason == "stop"
    assert a.output_token_ids == [5, 6, 8, 9] and s.num_generation_tokens == 3 + 2 + 1


def test_generated_tokens_are_counted_once_per_sampling_entry_only():
    s = make_scheduler(max_num_batched_tokens=8)
    for rid, n in (("a", 20), ("b", 3), ("c", 6)):
        s.add_request(make_req(rid, n, max_tokens=5))
    out = s.schedule(0.0)
    s.abort_requests(["a"], 0.5)  # its chunk's result is dropped
    s.update_from_output(out, ModelRunnerOutput({"a": [7]}), 1.0)
    run_to_completion(s)
    assert s.num_generation_tokens == 10 and s.num_prompt_tokens == 9


def test_append_slot_matches_allocate_slots_for_one_token():
    for computed in range(0, 13):
        results = []
        for use_append in (False, True):
            s = make_scheduler(num_blocks=4, block_size=4)
            r = make_req("a", 13)
            s.kv.allocate_slots(r, max(computed, 1))
            r.num_computed_tokens = computed
            table = s.kv.append_slot(r) if use_append else s.kv.allocate_slots(r, 1)
            results.append(None if table is None else (list(table.ids), s.kv.num_free_blocks))
        assert results[0] == results[1], computed
    s = make_scheduler(num_blocks=2, block_size=4)
    r = make_req("a", 9)
    s.kv.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    assert s.kv.append_slot(r) is None and s.kv.num_free_blocks == 0  # full pool: nothing changed
