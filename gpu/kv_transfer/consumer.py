"""The consumer half of the PeerConnector: loads run on background threads while the engine's
steps go on (the requests wait in WAITING_FOR_REMOTE_KVS, holding their local blocks).

One load: ``read`` (pins the producer's blocks), one indexed copy from the producer's region
into this engine's, ``done`` (the producer may free them). A load that cannot finish by its
deadline, or whose producer is gone, unreachable, incompatible or has freed the blocks, fails:
the scheduler then applies ``kv_load_failure_policy``.

Cancellation (an aborted request): its local blocks go back to the pool when the scheduler
aborts it, and may be handed to another request at the next step; ``cancel`` therefore returns
only once no copy into them is in progress (each load copies under its own lock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from twinserve.gpu.kv_transfer.region import KVLayout, attach, copy_blocks
from twinserve.gpu.kv_transfer.side_channel import SideChannelClient

PENDING_RETRY_S = 0.002  # the producer has not published the request yet: ask again after this


@dataclass(slots=True)
class LoadJob:
    """One request's blocks to copy from a producer."""

    request_id: str
    remote_request_id: str
    remote_block_ids: list[int]
    local_block_ids: list[int]
    remote_host: str
    remote_port: int
    deadline: float
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True, frozen=True)
class LoadResult:
    """A finished load: ``ok`` or ``error``; the bytes copied, and its ``start`` and ``end`` on
    ``time.monotonic()`` (one clock for every process of the machine, so a front can set them
    beside its own times)."""

    request_id: str
    ok: bool
    num_bytes: int
    start: float
    end: float
    error: str | None = None

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(slots=True)
class _Peer:
    client: SideChannelClient
    engine_id: str
    region: torch.Tensor


class Consumer:
    """Copies remote blocks into ``local`` (this engine's region tensor) with ``max_workers``
    concurrent loads; ``on_result`` is called from the load threads."""

    def __init__(self, local: torch.Tensor, layout: KVLayout, max_workers: int,
                 on_result: Callable[[LoadResult], None]) -> None:
        self.local = local
        self.layout = layout
        self._on_result = on_result
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="twinserve-kv-load")
        self._peers = threading.local()  # each load thread keeps its own connections
        self._lock = threading.Lock()
        self._jobs: dict[str, LoadJob] = {}

    def submit(self, job: LoadJob) -> None:
        with self._lock:
            if job.request_id in self._jobs:
                return  # already loading
            self._jobs[job.request_id] = job
        self._pool.submit(self._run, job)

    def cancel(self, request_id: str) -> None:
        """Abandons a load; returns once no copy into its blocks is under way."""
        with self._lock:
            job = self._jobs.pop(request_id, None)
        if job is not None:
            job.cancelled = True
            with job.lock:
                pass

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._jobs)

    def _run(self, job: LoadJob) -> None:
        start = time.monotonic()
        try:
            copied = self._load(job)
        except Exception as exc:  # any failure fails this load only: the scheduler decides
            self.forget_peer((job.remote_host, job.remote_port))  # its protocol state is unknown
            result = LoadResult(job.request_id, False, 0, start, time.monotonic(),
                                f"{type(exc).__name__}: {exc}")
        else:
            result = LoadResult(job.request_id, True, copied, start, time.monotonic())
        with self._lock:
            mine = self._jobs.pop(job.request_id, None) is job
        if mine and not job.cancelled:
            self._on_result(result)

    def _load(self, job: LoadJob) -> int:
        # nothing to copy (the local cache held the prompt, or the request ended first): release
        op = "release" if not job.remote_block_ids else "read"
        peer = self._peer(job)
        try:
            reply = peer.client.call({"op": op, "request_id": job.remote_request_id},
                                     self._left(job))
        except OSError:  # a kept connection to a producer since restarted: connect once anew
            self.forget_peer((job.remote_host, job.remote_port))
            peer = self._peer(job)
            reply = peer.client.call({"op": op, "request_id": job.remote_request_id},
                                     self._left(job))
        if op == "release":
            return 0
        while reply.get("status") == "pending":
            if job.cancelled:  # nothing pinned yet: the producer frees once the send arrives
                peer.client.call({"op": "release", "request_id": job.remote_request_id},
                                 self._left(job))
                return 0
            time.sleep(PENDING_RETRY_S)
            reply = peer.client.call({"op": "read", "request_id": job.remote_request_id},
                                     self._left(job))
        if reply.get("status") != "ok":
            raise RuntimeError(f"the producer has no blocks for {job.remote_request_id!r} "
                               f"({reply.get('status')}: freed, timed out or never published).")
        remote_ids = reply["block_ids"]
        if not set(job.remote_block_ids) <= set(remote_ids):  # (local hits: a tail of them)
            raise RuntimeError(f"remote_block_ids: the producer published other blocks for "
                               f"{job.remote_request_id!r}.")
        with job.lock:
            if not job.cancelled:  # (cancelled: release the producer's blocks all the same)
                copy_blocks(peer.region, job.remote_block_ids, self.local, job.local_block_ids)
        done = peer.client.call({"op": "done", "request_id": job.remote_request_id},
                                self._left(job))
        if done.get("status") != "ok":
            raise RuntimeError(f"the producer freed {job.remote_request_id!r}'s blocks during "
                               "the copy (its transfer timeout passed).")
        return len(job.remote_block_ids) * self.layout.bytes_per_block

    def _peer(self, job: LoadJob) -> _Peer:
        peers: dict[tuple[str, int], _Peer] = self._peers.__dict__.setdefault("by_address", {})
        address = (job.remote_host, job.remote_port)
        peer = peers.get(address)
        if peer is not None:
            return peer
        client = SideChannelClient(job.remote_host, job.remote_port, self._left(job))
        try:
            hello = client.call({"op": "hello"}, self._left(job))
            handle = hello["handle"]
            self.layout.check_compatible(KVLayout.from_dict(handle["layout"]))
            region = attach(handle, self.local.device)
        except BaseException:
            client.close()
            raise
        peer = peers[address] = _Peer(client, str(hello["engine_id"]), region)
        return peer

    def forget_peer(self, address: tuple[str, int]) -> None:
        """Drops this thread's connection to ``address`` (after an error on it)."""
        peers: dict[tuple[str, int], Any] = self._peers.__dict__.get("by_address", {})
        peer = peers.pop(address, None)
        if peer is not None:
            peer.client.close()

    @staticmethod
    def _left(job: LoadJob) -> float:
        left = job.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the load of {job.remote_request_id!r} passed its transfer "
                               "timeout.")
        return left

    def close(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.cancelled = True
            self._jobs.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)
