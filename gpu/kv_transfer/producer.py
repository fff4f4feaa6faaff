"""The producer half of the PeerConnector: the blocks it publishes for readers, and when it may
free them.

The scheduler keeps a finished ``do_remote_decode`` request's blocks until the worker reports
the request in ``finished_sending``; this table decides when: once its reader says ``done``,
once the reader's connection closes mid-read (nobody else will read them), or once
``transfer_timeout_s`` passes since publication (a consumer that never came, or a read that
never ended: the pin holds no longer than the timeout either).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from twinserve.gpu.kv_transfer.region import SharedKVRegion
from twinserve.gpu.kv_transfer.side_channel import SideChannelServer

MAX_GONE = 4096  # ended publications remembered, to answer "gone" rather than "pending"


@dataclass(slots=True)
class _Published:
    block_ids: list[int]
    deadline: float
    reader: object | None = None  # the connection reading it


class Publications:
    """Published requests (``request_id -> blocks``), shared by the engine thread and the side
    channel's connection threads: every method takes the lock."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"transfer_timeout_s must be > 0, got {timeout_s!r}.")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Published] = {}
        self._finished: set[str] = set()
        self._gone: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def publish(self, request_id: str, block_ids: list[int], now: float) -> None:
        with self._lock:
            if request_id not in self._entries:
                self._entries[request_id] = _Published(list(block_ids), now + self.timeout_s)

    def cancel(self, request_id: str) -> None:
        """The scheduler abandoned the send (it frees the blocks itself): forget it."""
        with self._lock:
            if self._entries.pop(request_id, None) is not None:
                self._remember_gone(request_id)

    def begin_read(self, request_id: str, reader: object) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return {"status": "gone" if request_id in self._gone else "pending"}
            if entry.reader is not None and entry.reader is not reader:
                return {"status": "gone"}  # one consumer per request: a second reader is refused
            entry.reader = reader
            return {"status": "ok", "block_ids": entry.block_ids}

    def end_read(self, request_id: str, reader: object) -> dict[str, Any]:
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None or entry.reader is not reader:
                return {"status": "gone"}
            self._end(request_id)
            return {"status": "ok"}

    def drop_reader(self, reader: object) -> None:
        """``reader``'s connection closed: the reads it held end (their blocks are freed)."""
        with self._lock:
            for rid in [rid for rid, e in self._entries.items() if e.reader is reader]:
                self._end(rid)

    def take_finished(self, now: float) -> set[str]:
        """Requests whose blocks may be freed: read, abandoned by their reader, or timed out."""
        with self._lock:
            for rid in [rid for rid, e in self._entries.items() if e.deadline <= now]:
                self._end(rid)
            taken, self._finished = self._finished, set()
            return taken

    def _end(self, request_id: str) -> None:
        del self._entries[request_id]
        self._finished.add(request_id)
        self._remember_gone(request_id)

    def _remember_gone(self, request_id: str) -> None:
        self._gone[request_id] = None
        if len(self._gone) > MAX_GONE:
            self._gone.popitem(last=False)


class Producer:
    """Publishes this engine's region and blocks on ``host:port``."""

    def __init__(self, engine_id: str, region: SharedKVRegion, host: str, port: int,
                 timeout_s: float) -> None:
        self.engine_id = engine_id
        self.region = region
        self.publications = Publications(timeout_s)
        self._server = SideChannelServer(host, port, self._handle, self.publications.drop_reader)

    @property
    def port(self) -> int:
        return self._server.port

    def _handle(self, message: dict[str, Any], reader: object) -> dict[str, Any]:
        op, rid = message.get("op"), message.get("request_id")
        if op == "hello":
            return {"status": "ok", "engine_id": self.engine_id, "handle": self.region.handle()}
        if not isinstance(rid, str):
            return {"status": "error", "message": "request_id must be a string."}
        if op == "read":
            return self.publications.begin_read(rid, reader)
        if op == "done":
            return self.publications.end_read(rid, reader)
        return {"status": "error", "message": f"unknown op {op!r}."}

    def close(self) -> None:
        self._server.close()
