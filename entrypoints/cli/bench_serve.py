"""``twinserve bench serve``: replay a workload in real time against an OpenAI-compatible server.

    twinserve bench serve --base-url http://127.0.0.1:8000 --trace synthetic --num-requests 200 \\
        --request-rate 8 --max-concurrency 32 --goodput ttft:500 tpot:50

The client side of vLLM's ``benchmark_serving``, for twinserve's server or vLLM's own:

- each request is sent at its ``arrival_time`` (seconds from the benchmark start; the pacing comes from
  the trace or the synthetic ``--request-rate``/``--burstiness``/``--time-scale`` flags), always
  streaming; ``--max-concurrency N`` caps the requests in flight (a semaphore, as vLLM's benchmark:
  a request waiting for a slot is sent late and its latencies count from when it is sent);
- bodies and records: :mod:`twinserve.entrypoints.cli.bench_request`; the stream: :mod:`.sse_client`;
- a request that fails (HTTP error, reset, malformed stream) is a failed record with its error; a
  server that cannot be reached at the start stops the command with one line of explanation; Ctrl-C
  stops it, writing the requests finished so far (``config.json``: ``"interrupted": true``);
- the run folder (``twinserve.core.run_dir``, no steps) goes to ``--out`` (default
  ``runs/bench-<timestamp>``) and vLLM's result table is printed (:mod:`.result_printout`).

Summary keys beyond ``metrics.summarize``: ``max_concurrent_requests`` (peak in flight, client side),
``max_output_tokens_per_s`` (busiest whole second), and ``max_concurrency`` / ``request_rate`` when set.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from tqdm import tqdm

from twinserve.core.metrics import RequestRecord, peak_output_throughput, summarize
from twinserve.core.run_dir import write_run
from twinserve.entrypoints.cli.bench_request import request_body, to_record
from twinserve.entrypoints.cli.result_printout import format_result
from twinserve.entrypoints.cli.sse_client import http_error_message, one_line, stream_completion
from twinserve.traces import (
    LOWEST_TOKEN_ID,
    TraceRequest,
    add_trace_args,
    trace_desc,
    trace_from_args,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_ENDPOINT = "/v1/completions"
DEFAULT_VOCAB_SIZE = 32000  # below every Llama-family vocabulary size
DEFAULT_TIMEOUT_S = 3600.0
CONNECT_TIMEOUT_S = 10.0
MODELS_TIMEOUT_S = 30.0
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
EXIT_INTERRUPTED = 130

_T = TypeVar("_T")


class BenchmarkInterrupted(Exception):
    """The replay was stopped (Ctrl-C) before every request finished."""


class ServerUnavailableError(ConnectionError):
    """The server cannot be reached, or does not answer ``GET /v1/models`` as OpenAI's API does."""


# ----------------------------------------------------------------------------------------- flags


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """Adds the ``bench serve`` flags, the workload flags (``add_trace_args``) included."""
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=DEFAULT_BASE_URL,
                   help=f"server root, without /v1 (default {DEFAULT_BASE_URL})")
    g.add_argument("--endpoint", default=DEFAULT_ENDPOINT,
                   help="/v1/completions (token-id prompts, default) or /v1/chat/completions "
                        "(approximate 'hi hi ...' text prompts)")
    g.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="sent as Authorization: Bearer KEY (default: $OPENAI_API_KEY; never "
                        "written to the run folder)")
    g.add_argument("--backend-label", default="twinserve",
                   help="what serves the requests, written as config 'backend' (twinserve, vllm, ...)")
    g.add_argument("--request-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help=f"seconds to wait for each chunk of an answer (default {DEFAULT_TIMEOUT_S:g})")
    b = parser.add_argument_group("benchmark")
    b.add_argument("--max-concurrency", type=int, help="cap on requests in flight (default: none)")
    b.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs of goodput, vLLM's syntax: ttft:MS tpot:MS e2el:MS")
    b.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                   help=f"token ids of prompts are below this (default {DEFAULT_VOCAB_SIZE})")
    b.add_argument("--send-priority", action="store_true",
                   help="send each request's priority (vLLM's 'priority' field)")
    b.add_argument("--out", help="run folder (default runs/bench-<timestamp>)")
    b.add_argument("--label", help="run name shown by reports (default: the folder name)")
    b.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_trace_args(parser)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        key = key.strip().lower()
        if not sep:
            raise ValueError(f"--goodput takes KEY:MS pairs ({', '.join(GOODPUT_KEYS)}), got {item!r}.")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput: unknown key {key!r} in {item!r}; "
                             f"valid keys: {', '.join(GOODPUT_KEYS)}.")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {value!r} in {item!r} is not a number of ms.") from None
        if not (math.isfinite(ms) and ms >= 0):
            raise ValueError(f"--goodput: {key} must be a finite number of ms >= 0, got {value!r}.")
        slos[key] = ms
    return slos


def check_base_url(url: str) -> str:
    """The URL without its trailing slash; ValueError naming ``--base-url`` if it is not http(s)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) \
            or not url.split("://", 1)[1].strip("/"):
        raise ValueError(f"--base-url must be an http:// or https:// URL, got {url!r}.")
    return url.rstrip("/")


def check_options(endpoint: str, max_concurrency: int | None, vocab_size: int,
                  request_timeout_s: float) -> None:
    """ValueError naming the flag for a bad endpoint, concurrency cap, vocabulary size or timeout."""
    if not isinstance(endpoint, str) or not endpoint.startswith("/") \
            or not endpoint.rstrip("/").endswith("/completions"):
        raise ValueError(f"--endpoint must be a path ending in /completions, e.g. /v1/completions "
                         f"or /v1/chat/completions, got {endpoint!r}.")
    if max_concurrency is not None and (isinstance(max_concurrency, bool)
                                        or not isinstance(max_concurrency, int) or max_concurrency < 1):
        raise ValueError(f"--max-concurrency must be an integer >= 1, got {max_concurrency!r}.")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= LOWEST_TOKEN_ID:
        raise ValueError(f"--vocab-size must be an integer > {LOWEST_TOKEN_ID}, got {vocab_size!r}.")
    if not (isinstance(request_timeout_s, (int, float)) and 0 < request_timeout_s < math.inf):
        raise ValueError(f"--request-timeout must be a number of seconds > 0, got {request_timeout_s!r}.")


# ------------------------------------------------------------------------------------ the server


def auth_headers(api_key: str | None) -> dict[str, str]:
    """``Authorization: Bearer KEY`` for ``api_key``, else for ``$OPENAI_API_KEY`` (as vLLM's
    benchmark and the openai client do); none without either."""
    key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


async def resolve_model(base_url: str, model: str | None, api_key: str | None = None) -> str:
    """``model``, or the first id of ``GET /v1/models``; that request also checks the server is up."""
    url = f"{base_url}/v1/models"
    timeout = httpx.Timeout(MODELS_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    try:
        async with httpx.AsyncClient(timeout=timeout, headers=auth_headers(api_key)) as client:
            response = await client.get(url)
    except httpx.HTTPError as exc:
        reason = one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        raise ServerUnavailableError(
            f"cannot reach the server at {base_url} (GET /v1/models: {reason}). "
            f"Is it running? Check --base-url.") from None
    if response.status_code == 401:
        raise ServerUnavailableError(
            f"GET {url} answered {http_error_message(401, response.content)}: the server "
            "wants an API key (--api-key, or $OPENAI_API_KEY).")
    if model:
        return model
    if response.status_code != 200:
        raise ServerUnavailableError(
            f"GET {url} answered {http_error_message(response.status_code, response.content)}; "
            f"pass --model.")
    return _first_model_id(response, url)


def _first_model_id(response: httpx.Response, url: str) -> str:
    try:
        data = response.json().get("data")
        model_id = data[0]["id"]
    except (ValueError, AttributeError, LookupError, TypeError):
        raise ServerUnavailableError(f"GET {url} lists no model; pass --model.") from None
    if not isinstance(model_id, str) or not model_id:
        raise ServerUnavailableError(f"GET {url} lists no model id; pass --model.")
    return model_id


# --------------------------------------------------------------------------------- the benchmark


@dataclass(slots=True)
class _Sender:
    """Sends one request at a time on behalf of the benchmark; counts what is in flight."""

    client: httpx.AsyncClient
    url: str
    endpoint: str
    model: str
    vocab_size: int
    send_priority: bool
    clock: Callable[[], float]
    semaphore: asyncio.Semaphore | None
    bar: tqdm
    sink: list[RequestRecord]
    in_flight: int = 0
    peak_in_flight: int = 0

    async def send(self, req: TraceRequest) -> RequestRecord:
        if self.semaphore is None:
            return await self._send(req)
        async with self.semaphore:
            return await self._send(req)

    async def _send(self, req: TraceRequest) -> RequestRecord:
        body = request_body(req, endpoint=self.endpoint, model=self.model,
                            vocab_size=self.vocab_size, send_priority=self.send_priority)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            result = await stream_completion(self.client, self.url, body, self.clock)
        finally:
            self.in_flight -= 1
        record = to_record(req, result)
        self.sink.append(record)
        self.bar.update(1)
        return record


async def benchmark(
    base_url: str,
    requests: Sequence[TraceRequest],
    *,
    model: str | None = None,
    endpoint: str = DEFAULT_ENDPOINT,
    max_concurrency: int | None = None,
    goodput_slos_ms: dict[str, float] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    send_priority: bool = False,
    request_timeout_s: float = DEFAULT_TIMEOUT_S,
    disable_tqdm: bool = True,
    api_key: str | None = None,
    collected: list[RequestRecord] | None = None,
    stop: asyncio.Event | None = None,
) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Replays ``requests`` against ``base_url`` in real time; returns the records (in arrival
    order) and the summary. Finished records are also appended to ``collected`` as they come, so
    a caller keeps them if the run is stopped: setting ``stop`` cancels the requests in flight and
    raises :class:`BenchmarkInterrupted`. Raises :class:`ServerUnavailableError` if the server
    cannot be reached at the start."""
    base_url = check_base_url(base_url)
    check_options(endpoint, max_concurrency, vocab_size, request_timeout_s)
    model = await resolve_model(base_url, model, api_key)
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S)
    bar = tqdm(total=len(ordered), unit="req", desc="bench serve", disable=disable_tqdm)
    try:
        async with httpx.AsyncClient(limits=limits, timeout=timeout,
                                     headers=auth_headers(api_key)) as client:
            start = time.perf_counter()
            sender = _Sender(client, base_url + endpoint, endpoint, model, vocab_size, send_priority,
                             lambda: time.perf_counter() - start,
                             asyncio.Semaphore(max_concurrency) if max_concurrency else None,
                             bar, collected if collected is not None else [])
            records = await _replay(ordered, sender, stop or asyncio.Event())
            duration = sender.clock()
    finally:
        bar.close()
    return records, _summary(records, duration, goodput_slos_ms, sender.peak_in_flight, max_concurrency)


async def _replay(ordered: list[TraceRequest], sender: _Sender,
                  stop: asyncio.Event) -> list[RequestRecord]:
    """Starts each request at its arrival time and waits for all of them, or until ``stop`` is set."""
    tasks: list[asyncio.Task[RequestRecord]] = []
    stopped = asyncio.create_task(stop.wait())
    try:
        for req in ordered:
            delay = req.arrival_time - sender.clock()
            if delay > 0:
                await asyncio.wait([stopped], timeout=delay)
            if stop.is_set():
                raise BenchmarkInterrupted
            tasks.append(asyncio.create_task(sender.send(req)))
        everything = asyncio.gather(*tasks)
        await asyncio.wait([everything, stopped], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            raise BenchmarkInterrupted
        return list(everything.result())
    finally:
        stopped.cancel()
        for task in tasks:  # only unfinished ones, when stopped or cancelled
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _summary(records: list[RequestRecord], duration: float, goodput_slos_ms: dict[str, float] | None,
             peak_in_flight: int, max_concurrency: int | None) -> dict[str, Any]:
    summary: dict[str, Any] = summarize(records, duration, goodput_slos_ms or None)
    summary["max_concurrent_requests"] = peak_in_flight
    summary["max_output_tokens_per_s"] = peak_output_throughput(records)
    if max_concurrency is not None:
        summary["max_concurrency"] = max_concurrency
    return summary


# ------------------------------------------------------------------------------------ the command


def run_bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark the flags describe, writes its run folder, prints vLLM's result table and
    returns the summary. Bad flags raise ValueError naming the flag; an unreachable server and
    Ctrl-C end the command with ``SystemExit`` (a message, no traceback)."""
    base_url = check_base_url(args.base_url)
    slos = parse_goodput(args.goodput)
    check_options(args.endpoint, args.max_concurrency, args.vocab_size, args.request_timeout)
    requests = trace_from_args(args)
    out_dir = Path(args.out) if args.out else default_out_dir()
    model = args.model or ""
    collected: list[RequestRecord] = []
    stop = asyncio.Event()
    try:
        model = asyncio.run(resolve_model(base_url, args.model, args.api_key))
        records, summary = asyncio.run(_until_ctrl_c(benchmark(
            base_url, requests, model=model, endpoint=args.endpoint,
            max_concurrency=args.max_concurrency, goodput_slos_ms=slos, vocab_size=args.vocab_size,
            send_priority=args.send_priority, request_timeout_s=args.request_timeout,
            disable_tqdm=args.disable_tqdm, api_key=args.api_key, collected=collected,
            stop=stop), stop))
    except ServerUnavailableError as exc:
        raise SystemExit(f"twinserve bench serve: error: {exc}") from None
    except (KeyboardInterrupt, BenchmarkInterrupted):
        _write_interrupted(args, model, len(requests), collected, slos, out_dir)
        raise SystemExit(EXIT_INTERRUPTED) from None
    _add_configured(summary, args)
    write_run(out_dir, run_config(args, model, len(requests), slos), records, summary)
    print(format_result(summary))
    print(f"Run folder: {out_dir}")
    return summary


async def _until_ctrl_c(replay: Coroutine[Any, Any, _T], stop: asyncio.Event) -> _T:
    """Runs ``replay`` with Ctrl-C setting ``stop``: the replay ends itself with
    :class:`BenchmarkInterrupted`, rather than relying on a task cancellation that a library in
    the stack could absorb (which once let an interrupted run finish as if complete)."""
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError):  # no loop signal handlers here (Windows, a thread)
        return await replay
    try:
        return await replay
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _write_interrupted(args: argparse.Namespace, model: str, num_requests: int,
                       records: list[RequestRecord], slos: dict[str, float], out_dir: Path) -> None:
    if not records:
        print("\nInterrupted before any request finished; nothing written.", file=sys.stderr)
        return
    records = sorted(records, key=lambda r: r.arrival_time)
    summary: dict[str, Any] = summarize(records, None, slos or None)
    _add_configured(summary, args)
    config = run_config(args, model, num_requests, slos, interrupted=True)
    write_run(out_dir, config, records, summary)
    print(format_result(summary, title="Serving Benchmark Result (interrupted)"))
    print(f"\nInterrupted: {len(records)} of {num_requests} requests finished; "
          f"partial results in {out_dir}", file=sys.stderr)


def _add_configured(summary: dict[str, Any], args: argparse.Namespace) -> None:
    """The configured load, as vLLM's result JSON carries it."""
    if args.max_concurrency is not None:
        summary["max_concurrency"] = args.max_concurrency
    if args.request_rate is not None and math.isfinite(args.request_rate):
        summary["request_rate"] = args.request_rate


def run_config(args: argparse.Namespace, model: str, num_requests: int, slos: dict[str, float],
               interrupted: bool = False) -> dict[str, Any]:
    """``config.json`` of a client-side run: the server, the load and the workload flags given
    (flags left unset are omitted, as the simulator's run folders do)."""
    config: dict[str, Any] = {
        "backend": args.backend_label, "base_url": check_base_url(args.base_url),
        "endpoint": args.endpoint, "model": model, "max_concurrency": args.max_concurrency,
        "goodput_slos_ms": slos, "vocab_size": args.vocab_size, "send_priority": args.send_priority,
        "request_timeout_s": args.request_timeout, "num_prompts": num_requests,
        "interrupted": interrupted,
    }
    config.update(trace_desc(args))
    if args.label:
        config["label"] = args.label
    return config


def default_out_dir() -> Path:
    return Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m twinserve.entrypoints.cli.bench_serve [flags]`` (the same as ``twinserve bench serve``)."""
    parser = argparse.ArgumentParser(
        prog="twinserve bench serve",
        description="Replay a workload in real time against an OpenAI-compatible server.")
    add_bench_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        run_bench_serve(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
