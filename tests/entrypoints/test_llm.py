"""The LLM API and the engine loop on the bundled model (small workloads)."""

import pytest

from twinserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=64 * 2**20)


def test_generate_returns_outputs_in_input_order(llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=6)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    alone = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids  # batching changes nothing
    for o in outs:
        assert o.finished and len(o.outputs[0].token_ids) == 6
        assert o.outputs[0].finish_reason == "length" and o.outputs[0].text
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.config.num_gpu_blocks


def test_chat_answers_with_the_template(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text


def test_n_samples_stop_strings_and_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8)
    a = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in a.outputs)
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]  # seeded
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # the samples differ
    stop = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=["6"]),
                        use_tqdm=False)[0].outputs[0]
    assert stop.finish_reason == "stop" and stop.stop_reason == "6" and "6" not in stop.text
    assert llm.engine.scheduler.kv.num_free_blocks == llm.engine.config.num_gpu_blocks


def test_bad_input_is_a_clear_value_error(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate("hi", SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]], use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([[5] * (llm.engine.config.max_model_len + 1)], use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(max_num_seqz=3)
    assert not llm.engine.has_unfinished_requests()


def test_abort_frees_the_blocks_of_every_sample(llm):
    engine = llm.engine
    rid = engine.add_request("Tell me a story", SamplingParams(n=2, max_tokens=50, seed=1))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv.num_free_blocks < engine.config.num_gpu_blocks
    out = engine.abort_request(rid)
    assert out.finished and all(c.finish_reason is not None for c in out.outputs)
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.num_free_blocks == engine.config.num_gpu_blocks


def test_priority_policy_serves_urgent_requests_first():
    llm = LLM(scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=32 * 2**20)
    engine = llm.engine
    first = {}
    ids = [engine.add_request([20 + i] * 8, SamplingParams(max_tokens=2, temperature=0),
                              priority=p) for i, p in enumerate([5, 0, 3])]
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                first.setdefault(o.request_id, len(first))
    assert [first[i] for i in ids] == [2, 0, 1]
