"""Disaggregated prefill/decode through real engines in one process (the transport between
processes is tested in test_kv_transfer.py): greedy tokens equal one engine's, the producer
frees its blocks once read, aborts and failed loads leak no block, the failure policies."""

from __future__ import annotations

import time
from typing import Any

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.core.request_output import KVLoadTiming, RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.llm_engine import LLMEngine

# chunked prefill in 32-token chunks, prefix caching on (the defaults)
SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
             kv_cache_memory_bytes=16 << 20)
SHARED = "You are a terse assistant. Answer in one short sentence. "
PROMPTS = [SHARED + "The capital of France is", SHARED + "Count: 1, 2, 3, 4,",
           "Water boils at", SHARED + "The capital of France is"]  # the last: a prefix hit
GREEDY = SamplingParams(temperature=0, max_tokens=10)
PREFILL = SamplingParams(temperature=0, max_tokens=1)
PORTS = iter(range(15110, 15190))


def engine(role: str | None, **extra: Any) -> LLMEngine:
    kv = None if role is None else {"kv_role": role, "kv_port": next(PORTS), **extra}
    return LLMEngine(EngineArgs(**SMALL, kv_transfer_config=kv))


def run(eng: LLMEngine, rid: str, prompt: str, params: SamplingParams,
        loads: list[KVLoadTiming] | None = None, **kwargs: Any) -> RequestOutput:
    """The request's final output; ``loads`` gets the KV load timings its outputs carried."""
    eng.add_request(prompt, params, request_id=rid, **kwargs)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for out in eng.step():
            if out.request_id == rid and out.kv_load is not None and loads is not None:
                loads.append(out.kv_load)
            if out.finished and out.request_id == rid:
                return out
    raise AssertionError(f"{rid} did not finish")


def drain(eng: LLMEngine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, "transfers still pending"
        eng.step()


def free_blocks(eng: LLMEngine) -> int:
    return eng.scheduler.kv.pool.num_free


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    one = engine(None)
    try:
        return [run(one, f"r{i}", p, GREEDY).outputs[0].token_ids for i, p in enumerate(PROMPTS)]
    finally:
        one.shutdown()


def disaggregated(producers: list[LLMEngine], consumer: LLMEngine, i: int,
                  prompt: str, loads: list[KVLoadTiming] | None = None) -> RequestOutput:
    pre = producers[i % len(producers)]
    first = run(pre, f"p{i}", prompt, PREFILL, kv_transfer_params={"do_remote_decode": True})
    assert first.kv_transfer_params is not None and first.kv_transfer_params["do_remote_prefill"]
    pre.step()  # publishes the blocks (its next step's orders)
    return run(consumer, f"d{i}", prompt, GREEDY, loads,
               kv_transfer_params=first.kv_transfer_params)


@pytest.mark.slow
@pytest.mark.parametrize("num_producers", [1, 2])
def test_disaggregated_greedy_tokens_equal_one_engine(expected: list[list[int]],
                                                      num_producers: int) -> None:
    producers = [engine("kv_producer") for _ in range(num_producers)]
    consumer = engine("kv_consumer")
    try:
        free = [free_blocks(p) for p in producers], free_blocks(consumer)
        records: list[KVLoadTiming] = []
        for i, prompt in enumerate(PROMPTS):
            out = disaggregated(producers, consumer, i, prompt, records)
            assert out.error is None
            assert out.outputs[0].token_ids == expected[i], i
        # the repeated prompt's blocks were in the consumer's cache: nothing (or less) to copy
        assert [r.ok for r in records] == [True] * len(records) and len(records) >= 3
        assert records[0].num_bytes > 0
        for p in producers:
            drain(p)  # every read was reported: the producers freed their blocks
            assert not p.scheduler.sending
        drain(consumer)
        assert [free_blocks(p) for p in producers] == free[0]
        assert free_blocks(consumer) == free[1]  # (cached blocks are free, evictable)
        assert consumer.scheduler.kv.usage == 0.0
    finally:
        for e in (*producers, consumer):
            e.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_follows_the_policy_and_leaks_nothing(expected: list[list[int]],
                                                          policy: str) -> None:
    pre = engine("kv_producer")
    consumer = engine("kv_consumer", kv_load_failure_policy=policy,
                      kv_connector_extra_config={"transfer_timeout_s": 2.0})
    try:
        first = run(pre, "p0", PROMPTS[0], PREFILL, kv_transfer_params={"do_remote_decode": True})
        pre.shutdown()  # the producer is gone before the consumer reads
        out = run(consumer, "d0", PROMPTS[0], GREEDY, kv_transfer_params=first.kv_transfer_params)
        if policy == "recompute":
            assert out.error is None and out.outputs[0].token_ids == expected[0]
        else:
            assert out.outputs[0].finish_reason == "error"
            assert "engine" in (out.error or "")
        drain(consumer)
        assert consumer.scheduler.kv.usage == 0.0 and not consumer.scheduler.waiting_for_remote
    finally:
        consumer.shutdown()


@pytest.mark.slow
def test_abort_while_loading_and_unread_sends_leak_no_block() -> None:
    pre = engine("kv_producer", kv_connector_extra_config={"transfer_timeout_s": 1.0})
    consumer = engine("kv_consumer")
    try:
        free = free_blocks(pre)
        first = run(pre, "p0", PROMPTS[1], PREFILL, kv_transfer_params={"do_remote_decode": True})
        # the producer has not published yet (no step since): the consumer's load waits
        consumer.add_request(PROMPTS[1], GREEDY, request_id="d0",
                             kv_transfer_params=first.kv_transfer_params)
        consumer.step()
        assert "d0" in consumer.scheduler.waiting_for_remote
        consumer.abort_request("d0")
        consumer.step()  # hands the cancellation to its worker
        drain(consumer)
        time.sleep(0.1)  # the cancelled load's thread sees the flag at its next poll
        assert consumer.scheduler.kv.usage == 0.0
        assert consumer.runner.kv_connector.consumer.num_pending == 0
        t0 = time.monotonic()
        drain(pre)  # the cancelled load released the blocks: freed once published
        assert time.monotonic() - t0 < 0.5
        assert free_blocks(pre) == free and not pre.scheduler.sending
        # a send nobody reads or releases is freed at the producer's timeout
        run(pre, "p1", PROMPTS[0], PREFILL, kv_transfer_params={"do_remote_decode": True})
        t0 = time.monotonic()
        drain(pre)
        assert 0.5 < time.monotonic() - t0 < 10
        assert free_blocks(pre) == free and not pre.scheduler.sending
    finally:
        pre.shutdown()
        consumer.shutdown()


def test_what_the_connector_cannot_serve_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_role"):
        EngineArgs(kv_transfer_config={"kv_role": "decoder"})
    with pytest.raises(ValueError, match="speculative_config"):  # before any model loads
        LLMEngine(EngineArgs(**SMALL, kv_transfer_config={"kv_port": next(PORTS)},
                             speculative_config={"method": "ngram", "num_speculative_tokens": 2}))
