"""The Peer connector's load times: each load's start and end on ``time.monotonic()`` and its
bytes, carried to the request's output (``RequestOutput.kv_load``) for a front to time."""

from __future__ import annotations

import math
import socket
import time

import pytest
import torch

from tests.gpu.test_pd_engine import GREEDY, PREFILL, SMALL
from twinserve.core.engine_args import EngineArgs
from twinserve.core.request_output import KVLoadTiming
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.gpu.kv_transfer.consumer import Consumer, LoadJob, LoadResult
from twinserve.gpu.kv_transfer.region import KVLayout

PORT = 15491  # (apart from test_pd_engine's ports: that file may run beside this one)


def engine(role: str, port: int) -> LLMEngine:
    return LLMEngine(EngineArgs(**SMALL, kv_transfer_config={"kv_role": role, "kv_port": port}))


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_failed_load_reports_its_start_and_end_on_the_monotonic_clock() -> None:
    layout = KVLayout(2, 16, 1, 8, "float32", 4)
    local = torch.zeros(layout.shape, dtype=layout.torch_dtype)
    results: list[LoadResult] = []
    consumer = Consumer(local, layout, 1, results.append)
    before = time.monotonic()
    try:
        consumer.submit(LoadJob("r", "r", [0], [0], "127.0.0.1", _unused_port(), before + 10))
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        consumer.close()
    after = time.monotonic()
    (result,) = results
    assert not result.ok and result.num_bytes == 0 and result.error
    assert before <= result.start <= result.end <= after
    assert result.seconds == pytest.approx(result.end - result.start)


@pytest.mark.slow
def test_the_load_rides_on_the_first_output_with_its_times_and_bytes() -> None:
    producer, consumer = engine("kv_producer", PORT), engine("kv_consumer", PORT + 1)
    prompt = list(range(100, 150))  # 50 tokens: 4 blocks of 16, the last partly full
    try:
        producer.add_request(prompt, PREFILL, request_id="p",
                             kv_transfer_params={"do_remote_decode": True})
        params = None
        while params is None and producer.has_unfinished_requests():
            params = next((o.kv_transfer_params for o in producer.step() if o.finished), None)
        assert params is not None
        producer.step()  # publishes the blocks
        added = time.monotonic()
        consumer.add_request(prompt, GREEDY, request_id="d", kv_transfer_params=params)
        carried: list[tuple[int, KVLoadTiming | None, float]] = []
        deadline = time.monotonic() + 120
        while consumer.has_unfinished_requests() or producer.has_unfinished_requests():
            assert time.monotonic() < deadline, "the request or its send did not end"
            for out in consumer.step():
                carried.append((len(out.outputs[0].token_ids), out.kv_load, time.monotonic()))
            producer.step()
        loads = [(n, load, seen) for n, load, seen in carried if load is not None]
        assert len(loads) == 1  # once, on the output with the first token
        n, load, seen = loads[0]
        assert n == 1 and carried[0][1] is load
        assert load.ok and added <= load.start < load.end <= seen
        layout = consumer.runner.kv_connector.region.layout
        assert load.num_bytes == math.ceil(len(prompt) / 16) * layout.bytes_per_block
        assert not consumer._kv_loads  # nothing held for a request that ended
    finally:
        producer.shutdown()
        consumer.shutdown()
