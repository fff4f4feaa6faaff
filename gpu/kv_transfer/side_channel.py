"""The PeerConnector's side channel: JSON lines over a TCP socket on ``kv_ip:kv_port``.

A producer listens; a consumer sends one request line and reads one reply line at a time:

    {"op": "hello"}                   -> {"engine_id", "handle"}       (the region, its layout)
    {"op": "read", "request_id": R}   -> {"status": "ok", "block_ids"} | "pending" | "gone"
    {"op": "done", "request_id": R}   -> {"status": "ok"} | "gone"

``read`` pins R's blocks to this connection until ``done`` (the producer neither times them out
nor frees them meanwhile, up to its transfer timeout); ``done`` answers ``gone`` when the blocks
were freed during the copy, so the consumer never keeps blocks read after they were reused. A
connection that closes while it holds a read releases it: nobody else will read those blocks.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from collections.abc import Callable
from typing import Any

MAX_LINE = 1 << 20  # bytes of one message (a read's block ids for long prompts stay far below)

Handler = Callable[[dict[str, Any], object], dict[str, Any]]


def send_line(sock_file: Any, message: dict[str, Any]) -> None:
    sock_file.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    sock_file.flush()


def read_line(sock_file: Any) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection."""
    line = sock_file.readline(MAX_LINE + 1)
    if not line:
        return None
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ValueError("side channel: a message longer than MAX_LINE bytes.")
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ValueError("side channel: a message must be a JSON object.")
    return message


class SideChannelServer:
    """Serves ``handle(message, connection)`` on ``host:port`` (port 0: any free one) from a
    background thread; ``on_close(connection)`` runs when a connection ends."""

    def __init__(self, host: str, port: int, handle: Handler,
                 on_close: Callable[[object], None]) -> None:
        class _Handler(socketserver.StreamRequestHandler):
            disable_nagle_algorithm = True  # one short reply per request: send it at once

            def handle(self) -> None:
                connection = object()  # this connection's identity for pinned reads
                try:
                    while (message := read_line(self.rfile)) is not None:
                        send_line(self.wfile, handle(message, connection))
                except (OSError, ValueError):
                    pass  # a broken or misbehaving peer: its connection ends
                finally:
                    on_close(connection)

        class _Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        try:
            self._server = _Server((host, port), _Handler)
        except OSError as exc:
            raise ValueError(f"kv_port: cannot listen on {host}:{port} ({exc.strerror}); give "
                             "each producer its own kv_port.") from exc
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="twinserve-kv-side-channel", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class SideChannelClient:
    """One connection to a producer (used by one thread at a time)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._file = self._sock.makefile("rwb")

    def call(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Sends ``message`` and returns the reply; raises OSError when the producer is gone."""
        self._sock.settimeout(max(timeout_s, 1e-3))
        send_line(self._file, message)
        reply = read_line(self._file)
        if reply is None:
            raise ConnectionResetError("the producer closed the side channel.")
        return reply

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            self._sock.close()
