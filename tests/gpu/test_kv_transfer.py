"""The PeerConnector's transport: a region shared between processes, the side channel's
publication table (read, done, timeouts, a reader that goes away) and the consumer's loads."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch

from twinserve.gpu.kv_transfer.consumer import Consumer, LoadJob, LoadResult
from twinserve.gpu.kv_transfer.producer import Producer, Publications
from twinserve.gpu.kv_transfer.region import KVLayout, SharedKVRegion, attach, copy_blocks

CPU = torch.device("cpu")
LAYOUT = KVLayout(num_slots=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  num_blocks=16)


def _producer_main(layout: KVLayout, ports: Any, publish: list[tuple[str, list[int]]],
                   timeout_s: float, port: int = 0) -> None:
    region = SharedKVRegion(layout, CPU)
    for b in range(layout.num_blocks):
        region.tensor[:, :, b] = float(b)  # block b holds the value b everywhere
    producer = Producer("prefill-0", region, "127.0.0.1", port, timeout_s)
    for rid, blocks in publish:
        producer.publications.publish(rid, blocks, time.monotonic())
    ports.put(producer.port)
    time.sleep(120)  # serves until the test kills it


@pytest.fixture()
def remote_producer():
    """A producer in another process publishing ``req-a`` (blocks 3, 5, 7); yields its port."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    process = ctx.Process(target=_producer_main,
                          args=(LAYOUT, ports, [("req-a", [3, 5, 7])], 30.0), daemon=True)
    process.start()
    try:
        yield ports.get(timeout=60), process
    finally:
        process.kill()
        process.join(5)


def _consumer(layout: KVLayout = LAYOUT) -> tuple[Consumer, SharedKVRegion, list[LoadResult],
                                                   threading.Event]:
    region = SharedKVRegion(layout, CPU)
    results: list[LoadResult] = []
    event = threading.Event()

    def on_result(result: LoadResult) -> None:
        results.append(result)
        event.set()
    return Consumer(region.tensor, layout, 2, on_result), region, results, event


def _job(rid: str, port: int, remote: list[int], local: list[int], timeout_s: float = 10.0,
         ) -> LoadJob:
    return LoadJob(rid, rid, remote, local, "127.0.0.1", port, time.monotonic() + timeout_s)


def test_layout_mismatch_is_refused_by_name() -> None:
    other = KVLayout(3, 4, 2, 16, "float32", 8)
    with pytest.raises(ValueError, match="head_dim"):
        LAYOUT.check_compatible(other)
    LAYOUT.check_compatible(KVLayout(3, 4, 2, 8, "float32", 99))  # block counts may differ
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(3, 4, 2, 8, "int8", 8)
    with pytest.raises(ValueError, match="num_slots"):
        KVLayout(0, 4, 2, 8, "float32", 8)


def test_region_is_shared_read_only_within_the_process() -> None:
    region = SharedKVRegion(LAYOUT, CPU)
    region.tensor.normal_()
    peer = attach(region.handle(), CPU)
    assert torch.equal(peer, region.tensor)
    dst = torch.zeros(LAYOUT.shape)
    copy_blocks(peer, [3, 5], dst, [0, 9])
    assert torch.equal(dst[:, :, 9], region.tensor[:, :, 5])
    assert torch.equal(dst[:, :, 0], region.tensor[:, :, 3])
    assert not dst[:, :, 1].any()
    keys, values = region.slots()[2]
    assert keys.data_ptr() == region.tensor[2, 0].data_ptr() and keys.is_contiguous()
    with pytest.raises(ValueError, match="remote_block_ids"):
        copy_blocks(peer, [1, 2], dst, [0])


def test_load_from_another_process_copies_the_blocks(remote_producer) -> None:
    port, _ = remote_producer
    consumer, region, results, event = _consumer()
    try:
        consumer.submit(_job("req-a", port, [3, 5, 7], [0, 1, 2]))
        assert event.wait(30)
        assert results[0].ok, results[0].error
        assert results[0].num_bytes == 3 * LAYOUT.bytes_per_block
        for local, remote in ((0, 3), (1, 5), (2, 7)):
            assert torch.all(region.tensor[:, :, local] == remote)
        assert not region.tensor[:, :, 3:].any()
        # read once: a second load of the same request finds it gone, at once
        event.clear()
        consumer.submit(_job("req-a", port, [3, 5, 7], [4, 5, 6]))
        assert event.wait(30)
        assert not results[1].ok and "gone" in results[1].error
    finally:
        consumer.close()


def test_a_restarted_producer_is_reconnected(remote_producer) -> None:
    port, process = remote_producer
    region = SharedKVRegion(LAYOUT, CPU)
    results: list[LoadResult] = []
    consumer = Consumer(region.tensor, LAYOUT, 1, results.append)  # one thread: one connection
    ctx = mp.get_context("spawn")
    try:
        consumer.submit(_job("req-a", port, [3], [0]))
        _wait(lambda: len(results) == 1)
        process.kill()
        process.join(5)
        ports = ctx.Queue()
        again = ctx.Process(target=_producer_main,
                            args=(LAYOUT, ports, [("req-b", [9])], 30.0, port), daemon=True)
        again.start()
        assert ports.get(timeout=60) == port
        consumer.submit(_job("req-b", port, [9], [1]))  # on the kept, now broken, connection
        _wait(lambda: len(results) == 2)
        assert [r.ok for r in results] == [True, True], results[1].error
        assert torch.all(region.tensor[:, :, 1] == 9)
    finally:
        consumer.close()
        if "again" in locals():
            again.kill()


def _wait(predicate: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_load_fails_when_the_producer_dies(remote_producer) -> None:
    port, process = remote_producer
    process.kill()
    process.join(5)
    consumer, _, results, event = _consumer()
    try:
        consumer.submit(_job("req-a", port, [3, 5, 7], [0, 1, 2]))
        assert event.wait(30)
        assert not results[0].ok
    finally:
        consumer.close()


def test_load_of_an_unpublished_request_times_out(remote_producer) -> None:
    port, _ = remote_producer
    consumer, _, results, event = _consumer()
    try:
        t0 = time.monotonic()
        consumer.submit(_job("never", port, [1], [1], timeout_s=0.3))
        assert event.wait(30)
        assert not results[0].ok and "timeout" in results[0].error
        assert time.monotonic() - t0 < 5
    finally:
        consumer.close()


def test_incompatible_producer_is_refused_by_name(remote_producer) -> None:
    port, _ = remote_producer
    consumer, _, results, event = _consumer(KVLayout(3, 4, 2, 16, "float32", 16))
    try:
        consumer.submit(_job("req-a", port, [3, 5, 7], [0, 1, 2]))
        assert event.wait(30)
        assert not results[0].ok and "head_dim" in results[0].error
    finally:
        consumer.close()


def test_publications_end_when_read_timed_out_or_abandoned() -> None:
    pubs = Publications(timeout_s=1.0)
    reader, other = object(), object()
    pubs.publish("a", [1, 2], now=0.0)
    pubs.publish("b", [3], now=0.0)
    pubs.publish("c", [4], now=0.5)
    assert pubs.begin_read("x", reader) == {"status": "pending"}
    assert pubs.begin_read("a", reader) == {"status": "ok", "block_ids": [1, 2]}
    assert pubs.begin_read("a", other) == {"status": "gone"}  # one reader per request
    assert pubs.take_finished(now=0.1) == set()
    assert pubs.end_read("a", reader) == {"status": "ok"}
    assert pubs.begin_read("b", other)["status"] == "ok"
    pubs.drop_reader(other)  # b's reader went away mid-read
    assert pubs.take_finished(now=0.2) == {"a", "b"}
    assert pubs.begin_read("a", reader) == {"status": "gone"}
    assert pubs.take_finished(now=1.4) == set()
    assert pubs.take_finished(now=1.6) == {"c"}  # never read: freed at its timeout
    assert len(pubs) == 0
    pubs.publish("d", [5], now=2.0)
    pubs.cancel("d")
    assert pubs.take_finished(now=9.0) == set() and pubs.begin_read("d", reader)["status"] == "gone"
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        Publications(timeout_s=0)


def test_cancel_waits_for_a_copy_in_progress() -> None:
    consumer, _, results, _ = _consumer()
    job = _job("z", 1, [1], [1])
    consumer._jobs["z"] = job  # as submit does, without a load thread
    job.lock.acquire()  # a copy under way
    done = threading.Event()
    threading.Thread(target=lambda: (consumer.cancel("z"), done.set()), daemon=True).start()
    assert not done.wait(0.2)  # cancel waits for the copy
    job.lock.release()
    assert done.wait(5) and job.cancelled and consumer.num_pending == 0
    consumer.close()
    assert results == []
