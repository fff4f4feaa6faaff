"""A live ``twinserve serve``-equivalent server in a subprocess, for tests.

    with live_server(["--scheduling-policy", "fcfs"], api_key="k") as srv:
        httpx.get(srv.url("/health"))

The server runs ``python -m twinserve.entrypoints.openai.server`` (the same ``run_server`` the CLI calls)
on 127.0.0.1 and a free port, with the default model and small settings (``SMALL_SERVER_ARGS``).
Its output goes to a log file whose tail is shown if it fails to start.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

# float32: exact to the checkpoint, as the HF comparisons need.
SMALL_SERVER_ARGS: tuple[str, ...] = (
    "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "256",
    "--max-num-batched-tokens", "2048", "--kv-cache-memory-bytes", str(256 << 20), "--seed", "0",
)
STARTUP_TIMEOUT_S = 240.0


@dataclass(slots=True)
class LiveServer:
    base_url: str
    api_key: str | None
    process: subprocess.Popen
    log_path: Path

    def url(self, path: str) -> str:
        return self.base_url + path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra_args: list[str] | tuple[str, ...] = (), api_key: str | None = None,
                 small: bool = True, timeout_s: float = STARTUP_TIMEOUT_S) -> LiveServer:
    """Starts the server and waits until ``/health`` answers 200."""
    port = free_port()
    args = [sys.executable, "-m", "twinserve.entrypoints.openai.server", "--host", "127.0.0.1",
            "--port", str(port), *(SMALL_SERVER_ARGS if small else ()), *extra_args]
    if api_key:
        args += ["--api-key", api_key]
    env = {k: v for k, v in os.environ.items() if k not in ("TWINSERVE_API_KEY", "VLLM_API_KEY")}
    log = tempfile.NamedTemporaryFile(prefix="twinserve-server-", suffix=".log", delete=False)
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    server = LiveServer(f"http://127.0.0.1:{port}", api_key, process, Path(log.name))
    try:
        _wait_healthy(server, timeout_s)
    except BaseException:
        stop_server(server)
        raise
    return server


def _wait_healthy(server: LiveServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n"
                               f"{server.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url("/health"), timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s}s:\n{server.log_tail()}")


def stop_server(server: LiveServer, timeout_s: float = 20.0) -> None:
    """SIGINT (uvicorn's graceful stop), then SIGKILL if it lingers."""
    process = server.process
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=timeout_s)
    with contextlib.suppress(OSError):
        server.log_path.unlink()


@contextlib.contextmanager
def live_server(extra_args: list[str] | tuple[str, ...] = (), api_key: str | None = None,
                small: bool = True) -> Iterator[LiveServer]:
    server = start_server(extra_args, api_key=api_key, small=small)
    try:
        yield server
    finally:
        stop_server(server)
