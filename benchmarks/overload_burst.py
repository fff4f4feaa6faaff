"""A burst of streaming requests arriving at once against ``twinserve serve`` on loopback: how many
were served, how many were refused at once (503/429) and how fast, time to response headers, and
whether the KV cache is back to empty afterwards; then the same burst (the same prompt lengths,
max_tokens and engine flags) through the twin of this machine, whose admission rule is the same
code: its served and refused counts beside the server's. In the twin the burst arrives at once
(every request at t=0): the server's engine thread takes queued requests only between steps, so
a burst sent within its first step reaches the scheduler all together. ``--twin-arrivals sent``
uses the client's send times instead (the twin then steps between arrivals a real engine thread
never sees one by one).

    python -m twinserve.benchmarks.overload_burst --num-requests 2000          # starts a server
    python -m twinserve.benchmarks.overload_burst --base-url http://127.0.0.1:8000 --no-twin

Loopback only, bounded: every request has a deadline and the whole burst ``--timeout-s``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(slots=True)
class Outcome:
    status: int  # HTTP status; 0: no response (client timeout or connection error)
    sent_s: float  # when the request was sent, seconds after the burst began
    headers_s: float  # time to response headers (NaN without a response)
    done: bool  # a 200 stream that ended with data: [DONE] and no error event
    tokens: int


def prompt(i: int) -> str:
    return f"Request {i}: once upon a time"


async def one(client: httpx.AsyncClient, url: str, i: int, max_tokens: int,
              deadline_s: float, start: float) -> Outcome:
    body = {"prompt": prompt(i), "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    sent = t0 - start
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                headers_s = time.monotonic() - t0
                if r.status_code != 200:
                    await r.aread()
                    return Outcome(r.status_code, sent, headers_s, False, 0)
                tokens, done, error = 0, False, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        error |= "error" in chunk
                        tokens += sum(1 for c in chunk.get("choices", []) if c.get("text"))
                return Outcome(200, sent, headers_s, done and not error, tokens)
    except (httpx.HTTPError, TimeoutError):
        return Outcome(0, sent, float("nan"), False, 0)


def kv_usage(url: str) -> tuple[float, float, float]:
    """(running, waiting, KV usage) from /metrics."""
    text = httpx.get(url + "/metrics", timeout=60).text
    values = {}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        values[name] = float(match.group(1)) if match else float("nan")
    return (values["vllm:num_requests_running"], values["vllm:num_requests_waiting"],
            values["vllm:kv_cache_usage_perc"])


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(x for x in xs if not math.isnan(x))
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def burst(url: str, num: int, max_tokens: int, deadline_s: float) -> list[Outcome]:
    limits = httpx.Limits(max_connections=num, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=60),
                                 limits=limits) as client:
        start = time.monotonic()
        return await asyncio.gather(*(one(client, url, i, max_tokens, deadline_s, start)
                                      for i in range(num)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def local_server(server_args: list[str], startup_s: float = 300.0) -> Iterator[str]:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="overload-burst-", suffix=".log",
                                     delete=False) as log:
        proc = subprocess.Popen([sys.executable, "-m", "twinserve.entrypoints.openai.server", "--host",
                                 "127.0.0.1", "--port", str(port), *server_args],
                                stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited; see {log.name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not healthy; see {log.name}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        if proc.poll() is None:
            proc.kill()


def run(url: str, args: argparse.Namespace) -> dict:
    t0 = time.monotonic()
    outcomes = asyncio.run(asyncio.wait_for(
        burst(url, args.num_requests, args.max_tokens, args.request_timeout_s),
        timeout=args.timeout_s))
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 60
    while True:  # the engine must drain to nothing
        running, waiting, kv = kv_usage(url)
        if (running == waiting == kv == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    served = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status in (429, 503)]
    return {
        "outcomes": outcomes,
        "num_requests": len(outcomes), "wall_s": round(wall, 2),
        "served": len(served), "served_complete": sum(o.done for o in served),
        "refused_503": sum(o.status == 503 for o in outcomes),
        "refused_429": sum(o.status == 429 for o in outcomes),
        "other_status": sorted({o.status for o in outcomes} - {200, 429, 503}),
        "p50_refusal_s": round(percentile([o.headers_s for o in refused], 50), 4),
        "p99_refusal_s": round(percentile([o.headers_s for o in refused], 99), 4),
        "p50_headers_s": round(percentile([o.headers_s for o in served], 50), 4),
        "p99_headers_s": round(percentile([o.headers_s for o in served], 99), 4),
        "tokens": sum(o.tokens for o in served),
        "after": {"running": running, "waiting": waiting, "kv_cache_usage": kv},
        "example": asdict(outcomes[0]) if outcomes else None,
    }


def twin(outcomes: list[Outcome], args: argparse.Namespace) -> dict:
    """The burst through the twin of this machine: the server's engine flags (resolved for a
    server on this CPU, as the real one was), each request with its prompt's token count and
    max_tokens, arriving at once or at its send time (``--twin-arrivals``)."""
    from twinserve.entrypoints.engine_args import add_engine_args, engine_args_from
    from twinserve.gpu.engine.tokenizer import Tokenizer
    from twinserve.gpu.models.default_model import resolve_model_path
    from twinserve.simulator import SimConfig, simulate
    from twinserve.traces import TraceRequest
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--model", default=None)
    add_engine_args(flags)
    known, _ = flags.parse_known_args(args.server_args.split())
    model = str(resolve_model_path(known.model))
    tokenizer = Tokenizer.from_dir(resolve_model_path(known.model))
    def arrival(o: Outcome) -> float:
        return o.sent_s if args.twin_arrivals == "sent" else 0.0

    trace = sorted((TraceRequest(f"r{i}", arrival(o), len(tokenizer.encode(prompt(i))),
                                 args.max_tokens) for i, o in enumerate(outcomes)),
                   key=lambda tr: tr.arrival_time)
    result = simulate(SimConfig(engine_args_from(known, model=model), hardware="cpu"), trace)
    served = sum(r.success for r in result.records)
    return {"served": served, "refused": len(result.records) - served}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default=None, help="a running server (loopback only); "
                        "default: start one with --server-args")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--timeout-s", type=float, default=1200.0, help="the whole burst")
    parser.add_argument("--server-args", default="--max-model-len 256",
                        help="flags for the server this script starts (one string)")
    parser.add_argument("--no-twin", dest="twin", action="store_false",
                        help="skip the twin's replay of the burst")
    parser.add_argument("--twin-arrivals", choices=("once", "sent"), default="once",
                        help="the twin's arrivals: all at t=0 (default) or the send times")
    args = parser.parse_args(argv)
    if args.base_url:
        if urlsplit(args.base_url).hostname not in LOOPBACK:
            parser.error("--base-url must be a loopback address")
        result = run(args.base_url.rstrip("/"), args)
    else:
        with local_server(args.server_args.split()) as url:
            result = run(url, args)
    outcomes = result.pop("outcomes")
    if args.twin:
        result["twin"] = {"arrivals": args.twin_arrivals, **twin(outcomes, args)}
        real = result["served"]
        result["twin"]["served_error_pct"] = (round(100 * (result["twin"]["served"] - real) / real, 2)
                                              if real else None)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
