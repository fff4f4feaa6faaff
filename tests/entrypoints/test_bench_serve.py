"""entrypoints/cli/bench_serve.py against tests/fake_openai_server.py: pacing, the concurrency cap, records,
failures, the run folder, goodput flags, the vLLM printout, an unreachable server and Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_openai_server import (
    BAD_REQUEST_TOKENS,
    ERROR_EVENT_TOKENS,
    MALFORMED_TOKENS,
    RESET_TOKENS,
    FakeConfig,
    FakeStats,
    cached_tokens,
    free_port,
    make_app,
    serve_in_thread,
)

from twinserve.core.run_dir import REQUEST_COLUMNS, write_run
from twinserve.entrypoints.cli.bench_serve import (
    BenchmarkInterrupted,
    ServerUnavailableError,
    add_bench_serve_args,
    benchmark,
    parse_goodput,
    run_bench_serve,
)
from twinserve.entrypoints.cli.result_printout import format_result
from twinserve.entrypoints.cli.sse_client import http_error_message, sse_data
from twinserve.traces import LOWEST_TOKEN_ID, TraceRequest

CFG = FakeConfig(first_chunk_delay_s=0.05, chunk_delay_s=0.03, tokens_per_chunk=2)
VLLM_LINES = (
    "============ Serving Benchmark Result ============", "Successful requests:",
    "Benchmark duration (s):", "Total input tokens:", "Total generated tokens:",
    "Request throughput (req/s):", "Output token throughput (tok/s):",
    "Total Token throughput (tok/s):", "---------------Time to First Token----------------",
    "Mean TTFT (ms):", "Median TTFT (ms):", "P99 TTFT (ms):",
    "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):", "Median TPOT (ms):",
    "P99 TPOT (ms):", "---------------Inter-token Latency----------------", "Mean ITL (ms):",
    "Median ITL (ms):", "P99 ITL (ms):", "=" * 50,
)


@pytest.fixture
def fake() -> Iterator[tuple[str, FakeStats]]:
    app = make_app(CFG)
    with serve_in_thread(app, max_lifetime_s=60) as url:
        yield url, app.state.stats


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    return parser.parse_args(list(argv))


def _run(url: str, reqs: list[TraceRequest], **kwargs: Any) -> tuple[list, dict]:
    return asyncio.run(benchmark(url, reqs, **kwargs))


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------------------ the whole command


def test_cli_run_writes_a_valid_run_folder(fake: tuple[str, FakeStats], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    url, stats = fake
    out = tmp_path / "run"
    args = _parse("--base-url", url + "/", "--trace", "synthetic", "--num-requests", "20",
                  "--request-rate", "50", "--input-len", "32", "--output-len", "6",
                  "--max-concurrency", "4", "--goodput", "ttft:5000", "tpot:5000", "--tenants",
                  "a=1,b=1", "--priorities", "0=1,2=1", "--send-priority", "--vocab-size", "1000",
                  "--out", str(out), "--disable-tqdm", "--label", "fake run")
    summary = run_bench_serve(args)

    assert {p.name for p in out.iterdir()} == {"config.json", "summary.json", "requests.csv"}
    _check_summary(json.loads((out / "summary.json").read_text()), summary)
    _check_config(json.loads((out / "config.json").read_text()), url)
    rows = _check_rows(out / "requests.csv")
    assert 1 <= stats.max_in_flight <= 4 and summary["max_concurrent_requests"] <= 4
    _check_bodies(stats.bodies, rows)
    printed = capsys.readouterr().out
    for line in VLLM_LINES:
        assert line in printed, line
    assert "Request goodput (req/s):" in printed and "Maximum request concurrency:" in printed
    assert f"Run folder: {out}" in printed


def _check_summary(saved: dict[str, Any], summary: dict[str, Any]) -> None:
    for key in ("duration", "completed", "failed", "request_throughput", "request_goodput",
                "output_throughput", "total_token_throughput", "mean_ttft_ms", "median_tpot_ms",
                "p99_itl_ms", "mean_e2el_ms", "prefix_cache_hit_rate", "max_concurrent_requests",
                "max_output_tokens_per_s", "max_concurrency", "request_rate"):
        assert key in saved, key
    assert saved["completed"] == summary["completed"] == 20 and saved["failed"] == 0
    assert saved["request_goodput"] == pytest.approx(saved["request_throughput"])
    assert saved["max_concurrency"] == 4 and saved["request_rate"] == 50
    assert saved["total_output_tokens"] == 20 * 6 and saved["total_input_tokens"] == 20 * 32
    assert saved["prefix_cache_hit_rate"] == pytest.approx(cached_tokens(32) / 32)


def _check_config(config: dict[str, Any], url: str) -> None:
    assert config["backend"] == "twinserve" and config["model"] == CFG.model_id
    assert config["base_url"] == url and config["trace"] == "synthetic"
    assert config["request_rate"] == 50 and config["max_concurrency"] == 4
    assert config["num_prompts"] == 20 and config["label"] == "fake run"
    assert config["interrupted"] is False and config["goodput_slos_ms"] == {"ttft": 5000, "tpot": 5000}


def _check_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        assert tuple(next(csv.reader(f))) == REQUEST_COLUMNS
    rows = _read_csv(path)
    assert len(rows) == 20
    assert {r["tenant"] for r in rows} == {"a", "b"} and {r["priority"] for r in rows} == {"0", "2"}
    for row in rows:
        assert row["success"] == "1" and row["first_scheduled_time"] == ""
        assert int(row["output_tokens"]) == 6  # from usage, not the 3 chunks
        assert len(row["itls_ms"].split()) == 2
        assert int(row["cached_tokens"]) == cached_tokens(32)
    return rows


def _check_bodies(bodies: list[dict[str, Any]], rows: list[dict[str, str]]) -> None:
    assert len(bodies) == 20
    for body in bodies:
        assert body["model"] == CFG.model_id and body["max_tokens"] == 6
        assert body["ignore_eos"] is True and body["stream"] is True and body["temperature"] == 0
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"]) == 32
        assert all(LOWEST_TOKEN_ID <= t < 1000 for t in body["prompt"])
    sent = sorted((b["user"], b["priority"]) for b in bodies)
    assert sent == sorted((r["tenant"], int(r["priority"])) for r in rows)


def test_latencies_follow_the_server_delays(fake: tuple[str, FakeStats]) -> None:
    url, _ = fake
    reqs = [TraceRequest(f"r{i}", i * 0.02, 16, 8) for i in range(10)]
    records, summary = _run(url, reqs)
    assert all(r.success for r in records)
    for r in records:
        assert r.ttft >= CFG.first_chunk_delay_s - 1e-3
        assert len(r.itls) == 3 and r.output_tokens == 8
        assert r.first_scheduled_time != r.first_scheduled_time  # nan: unknown client-side
        assert r.finish_time == pytest.approx(r.first_token_time + sum(r.itls))
    assert CFG.chunk_delay_s * 0.9 <= summary["median_itl_ms"] / 1e3 <= CFG.chunk_delay_s * 3
    assert summary["mean_tpot_ms"] == pytest.approx(
        sum(r.tpot for r in records) / len(records) * 1e3)


def test_requests_are_sent_at_their_arrival_times(fake: tuple[str, FakeStats]) -> None:
    url, _ = fake
    reqs = [TraceRequest(f"r{i}", 0.1 * i, 8, 2) for i in range(6)]
    records, summary = _run(url, reqs)
    for req, rec in zip(reqs, records):
        assert req.request_id == rec.request_id
        assert req.arrival_time - 1e-3 <= rec.arrival_time <= req.arrival_time + 0.08
    assert summary["duration"] >= 0.5


# ------------------------------------------------------------------------------------ concurrency


def test_max_concurrency_caps_requests_in_flight(tmp_path: Path) -> None:
    reqs = [TraceRequest(f"r{i}", 0.0, 8, 6) for i in range(12)]  # all at once
    for cap, check in ((None, lambda n: n > 4), (3, lambda n: n == 3)):
        app = make_app(CFG)
        with serve_in_thread(app, max_lifetime_s=60) as url:
            records, summary = _run(url, reqs, max_concurrency=cap)
        assert check(app.state.stats.max_in_flight), (cap, app.state.stats.max_in_flight)
        assert summary["max_concurrent_requests"] == app.state.stats.max_in_flight
        assert summary["completed"] == 12


# ---------------------------------------------------------------------------------------- failures


def test_failed_requests_become_failed_records(fake: tuple[str, FakeStats], tmp_path: Path) -> None:
    url, _ = fake
    lengths = [6, BAD_REQUEST_TOKENS, 6, MALFORMED_TOKENS, ERROR_EVENT_TOKENS, RESET_TOKENS, 6,
               BAD_REQUEST_TOKENS]
    reqs = [TraceRequest(f"r{i}", 0.01 * i, 16, n) for i, n in enumerate(lengths)]
    records, summary = _run(url, reqs, max_concurrency=4)
    assert summary["completed"] == 3 and summary["failed"] == 5
    errors = {r.request_id: r.error for r in records}
    assert errors["r1"] == "HTTP 400: max_tokens=13 is refused by the fake server"
    assert "not JSON" in errors["r3"]
    assert "the fake engine died" in errors["r4"]
    assert "RemoteProtocolError" in errors["r5"] or "Error" in errors["r5"]
    assert all(r.success == (r.error == "") for r in records)
    assert summary["total_output_tokens"] == 3 * 6  # failed requests count nothing
    rows = _read_csv(write_run(tmp_path / "run", {"backend": "fake"}, records, summary) / "requests.csv")
    assert [r["success"] for r in rows].count("0") == 5 and rows[1]["error"] == errors["r1"]


def test_an_unreachable_server_gives_a_clear_error(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnavailableError, match="cannot reach the server"):
        _run(url, [TraceRequest("r0", 0.0, 8, 2)])
    args = _parse("--base-url", url, "--trace", "synthetic", "--num-requests", "2", "--out",
                  str(tmp_path / "run"), "--disable-tqdm")
    with pytest.raises(SystemExit, match="cannot reach the server .* --base-url"):
        run_bench_serve(args)
    assert not (tmp_path / "run").exists()


def test_ctrl_c_stops_cleanly_and_keeps_finished_requests(fake: tuple[str, FakeStats],
                                                          tmp_path: Path) -> None:
    url, stats = fake
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "twinserve.entrypoints.cli.bench_serve", "--base-url", url, "--trace",
           "synthetic", "--num-requests", "200", "--request-rate", "20", "--input-len", "8",
           "--output-len", "2", "--out", str(out), "--disable-tqdm"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(stats.bodies) < 8 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Interrupted:" in stderr
    assert "Serving Benchmark Result (interrupted)" in stdout
    config = json.loads((out / "config.json").read_text())
    assert config["interrupted"] is True and config["num_prompts"] == 200
    assert 1 <= len(_read_csv(out / "requests.csv")) < 200



def test_stop_ends_the_replay_and_keeps_what_finished(fake: tuple[str, FakeStats]) -> None:
    url, stats = fake
    reqs = [TraceRequest(f"r{i}", 0.05 * i, 8, 2) for i in range(100)]
    collected: list = []

    async def stop_after_three() -> None:
        stop = asyncio.Event()
        replay = asyncio.create_task(benchmark(url, reqs, collected=collected, stop=stop))
        while len(collected) < 3:
            await asyncio.sleep(0.01)
        stop.set()
        with pytest.raises(BenchmarkInterrupted):
            await asyncio.wait_for(replay, timeout=5)

    asyncio.run(stop_after_three())
    assert 3 <= len(collected) < 100
    assert len(stats.bodies) < 100  # the requests not yet due were never sent

# ------------------------------------------------------------------------------------ chat endpoint


def test_chat_endpoint_skips_the_role_chunk(fake: tuple[str, FakeStats]) -> None:
    url, stats = fake
    reqs = [TraceRequest(f"r{i}", 0.0, 12, 5, tenant="t") for i in range(3)]
    records, summary = _run(url, reqs, endpoint="/v1/chat/completions", model="m")
    assert summary["completed"] == 3
    body = stats.bodies[0]
    assert body["messages"] == [{"role": "user", "content": " ".join(["hi"] * 12)}]
    assert body["max_completion_tokens"] == 5 and body["model"] == "m" and "priority" not in body
    for r in records:
        assert r.ttft >= CFG.first_chunk_delay_s - 1e-3  # the role chunk (at once) is not a token
        assert r.input_tokens == 12 and r.output_tokens == 5 and len(r.itls) == 2


# ------------------------------------------------------------------------------------------- flags


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:0"]) == {"ttft": 500, "tpot": 50.5, "e2el": 0}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["tpot:-1"], ["e2el:nan"], [":5"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)


def test_goodput_counts_requests_meeting_the_slos(fake: tuple[str, FakeStats]) -> None:
    url, _ = fake
    reqs = [TraceRequest(f"r{i}", 0.0, 8, 4) for i in range(4)]
    _, summary = _run(url, reqs, goodput_slos_ms={"ttft": 1.0})  # below the server's first delay
    assert summary["request_goodput"] == 0.0 and summary["request_throughput"] > 0


@pytest.mark.parametrize("flags, name", [
    (("--max-concurrency", "0"), "--max-concurrency"),
    (("--endpoint", "/v1/embeddings"), "--endpoint"),
    (("--vocab-size", "16"), "--vocab-size"),
    (("--base-url", "ftp://example"), "--base-url"),
    (("--request-timeout", "0"), "--request-timeout"),
    (("--goodput", "ttft:x"), "--goodput"),
])
def test_bad_flags_raise_value_errors_naming_them(flags: tuple[str, ...], name: str) -> None:
    args = _parse("--trace", "synthetic", "--num-requests", "1", *flags)
    with pytest.raises(ValueError, match=name):
        run_bench_serve(args)


# ------------------------------------------------------------------------------- printout and SSE


def test_format_result_has_vllms_layout() -> None:
    summary = {"completed": 3, "failed": 1, "duration": 2.0, "total_input_tokens": 30,
               "total_output_tokens": 12, "request_throughput": 1.5, "output_throughput": 6.0,
               "total_token_throughput": 21.0, "mean_ttft_ms": 10.0, "median_ttft_ms": 9.0,
               "p99_ttft_ms": 12.345, "mean_tpot_ms": None, "median_tpot_ms": math.nan,
               "p99_tpot_ms": 1.0}
    text = format_result(summary)
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == "{:<40} {:<10}".format("Successful requests:", 3)
    assert "{:<40} {:<10}".format("Benchmark duration (s):", "2.00") in lines
    assert "{:<40} {:<10}".format("P99 TTFT (ms):", "12.35") in lines
    assert "{:<40} {:<10}".format("Mean TPOT (ms):", "n/a") in lines
    assert "{:<40} {:<10}".format("Median TPOT (ms):", "n/a") in lines
    assert "Inter-token Latency" not in text and "Request goodput" not in text
    assert lines[-1] == "=" * 50
    assert format_result(summary, title="Sim").splitlines()[0] == "{s:=^50}".format(s=" Sim ")


def test_sse_lines_and_error_bodies() -> None:
    assert sse_data("data: {}") == "{}" and sse_data("data:[DONE]") == "[DONE]"
    assert sse_data("") is None and sse_data(": keep-alive") is None and sse_data("event: x") is None
    assert http_error_message(400, b'{"error": {"message": "too long"}}') == "HTTP 400: too long"
    assert http_error_message(400, b'{"object": "error", "message": "old vllm"}') == "HTTP 400: old vllm"
    assert http_error_message(422, b'{"detail": "bad field"}') == "HTTP 422: bad field"
    assert http_error_message(502, b"Bad\n gateway") == "HTTP 502: Bad gateway"
    assert http_error_message(500, b"") == "HTTP 500: (empty body)"
