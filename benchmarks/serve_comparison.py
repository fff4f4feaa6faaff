"""``bench serve`` against ``twinserve serve`` and ``vllm serve`` (its own venv), one after the
other on the same model, settings and workload; prints throughput and latency side by side.

    python -m twinserve.benchmarks.serve_comparison --vllm-python /tmp/vllm-venv/bin/python \
        [--num-requests 300] [--time-scale 1.0] [--max-model-len 1024]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from twinserve.entrypoints.cli.main import build_parser

METRICS = ("completed", "failed", "request_throughput", "output_throughput", "mean_ttft_ms",
           "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], port: int, env: dict, timeout: float = 600.0) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(2)
    _stop(proc)
    raise RuntimeError(f"server did not come up in {timeout:.0f} s: {' '.join(cmd)}")


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _bench(port: int, label: str, args: argparse.Namespace, vocab: int) -> dict:
    from twinserve.entrypoints.cli.bench_serve import run_bench_serve
    ns = build_parser().parse_args([
        "bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--trace", "azure-conv",
        "--num-requests", str(args.num_requests), "--max-model-len", str(args.max_model_len),
        "--time-scale", str(args.time_scale), "--vocab-size", str(vocab),
        "--backend-label", label, "--out", str(Path(args.out) / label), "--disable-tqdm"])
    return run_bench_serve(ns)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default="runs/serve-comparison")
    args = ap.parse_args()
    from twinserve.gpu.models.default_model import default_model_path
    model = str(default_model_path())
    vocab = 49152
    common = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
              "--dtype", args.dtype]
    servers = {"twinserve": [sys.executable, "-m", "twinserve.entrypoints.openai.server", "--model", model,
                             *common]}
    if args.vllm_python:
        servers["vllm"] = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server",
                           "--model", model, *common]
    results = {}
    for label, cmd in servers.items():
        port = _free_port()
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
        proc = _start([*cmd, "--port", str(port)], port, env)
        try:
            results[label] = _bench(port, label, args, vocab)
        finally:
            _stop(proc)
    print(f"{'metric':<22}" + "".join(f"{k:>14}" for k in results)
          + ("    twinserve/vllm" if "vllm" in results else ""))
    for m in METRICS:
        vals = [results[k].get(m) for k in results]
        row = f"{m:<22}" + "".join(f"{v:>14.2f}" if isinstance(v, float) else f"{v!s:>14}"
                                   for v in vals)
        if "vllm" in results and isinstance(vals[0], (int, float)) and vals[-1]:
            row += f"{vals[0] / vals[-1]:>18.2f}"
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
