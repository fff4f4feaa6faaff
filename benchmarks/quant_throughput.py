"""Quantized weights at the memory-bandwidth limit: twinserve running the bundled SmolLM2 Q4_1
GGUF as it is, against the fp32 directory converted from it and against llama.cpp on the same
file, side by side in interleaved rounds (each round runs every engine on every workload, so a
slow spell of a shared machine hits all alike); medians of the rounds, and the median of each
round's ratio.

Workloads (the same prompt token ids for every engine, 32 tokens each, greedy, no early stop):
``single``: batch 1 x 128 tokens; ``batch``: 64 parallel sequences x 128 tokens.

Engines (``--engines``): ``gguf`` twinserve on the file's blocks as it runs by default (the fused
decode step, int8 activations); ``gguf-fp32act`` the same with fp32 activations (the exact path);
``gguf-perop`` without the fused step (the per-op reference path, int8 activations); ``gguf-rows``
the fused step on the file's rows (no 8-row packed copy of the Q4 projections); ``fp32`` the
converted fp32 directory; ``llama.cpp`` llama-cpp-python in its own venv on the same file.

Then the batch-1 decode step against the physical limit: the bytes a step streams (the
projections' blocks, the Q8_0 LM-head table, the norms) over the streaming-read bandwidth
measured here (``torch.sum`` over a 512 MiB buffer, the best of several passes), as a
percentage of the measured step (decode time of 128 tokens less that of 1, over 127).

    python -m twinserve.benchmarks.quant_throughput [--rounds 3] \
        [--llamacpp-python /work/peers/llamacpp/bin/python] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

WORKLOADS = {"single": 1, "batch": 64}
MAX_TOKENS = 128
PROMPT_LEN = 32


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(64)]


# engine name -> (label, the kernel engine arguments it runs with beside the defaults)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gguf": ("twinserve gguf (fused, int8 act.)", {}),
    "gguf-fp32act": ("twinserve gguf (fused, fp32 act.)", {"quant_activations": "fp32"}),
    "gguf-perop": ("twinserve gguf (per-op, int8 act.)", {"fused_decode": False}),
    "gguf-rows": ("twinserve gguf (fused, unpacked rows)", {"fused_packed": False}),
}


class Twinserve:
    def __init__(self, model: str, label: str, kernels: dict[str, Any] | None = None) -> None:
        from twinserve import LLM
        self.label = label
        self.llm = LLM(model, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=2048,
                       **(kernels or {}))

    def run(self, batch: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        from twinserve import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        out = self.llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)


class LlamaCpp:
    label = "llama.cpp"

    def __init__(self, python: str, gguf: Path, threads: int) -> None:
        worker = Path(__file__).with_name("llamacpp_worker.py")
        self.proc = subprocess.Popen([python, str(worker), str(gguf), str(threads), "64"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert json.loads(self._line())["ready"]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker exited")
        return line

    def run(self, batch: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": batch, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        reply = json.loads(self._line())
        return reply["seconds"], reply["first"]

    def close(self) -> None:
        self.proc.terminate()


def streaming_read_bandwidth(passes: int = 7) -> float:
    """Bytes/s of a multi-threaded sum over a buffer far larger than the caches (best pass)."""
    buf = torch.ones(128 << 20, dtype=torch.float32)  # 512 MiB
    buf.sum()
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def streamed_bytes(llm) -> int:
    from twinserve.gpu.quantization.quant_linear import quantized_weight_bytes
    model = llm.engine.runner.model
    head = model.quant_head.weight_q.nbytes if model.quant_head is not None else 0
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    return quantized_weight_bytes(model) + head + dense


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llamacpp-python", default="/work/peers/llamacpp/bin/python")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="gguf,fp32,llama.cpp")
    ap.add_argument("--workloads", default="single,batch",
                    help="comma-separated, of: " + ", ".join(WORKLOADS))
    args = ap.parse_args()
    workloads = {w: WORKLOADS[w] for w in args.workloads.split(",")}
    torch.set_num_threads(args.threads)
    from twinserve.gpu.models.default_model import default_model_path, gguf_path
    names = args.engines.split(",")
    engines: dict = {}
    for name in names:
        if name in VARIANTS:
            engines[name] = Twinserve(str(gguf_path()), *VARIANTS[name])
    if "fp32" in names:
        engines["fp32"] = Twinserve(str(default_model_path()), "twinserve fp32 dir")
    if "llama.cpp" in names:
        if Path(args.llamacpp_python).is_file():
            engines["llama.cpp"] = LlamaCpp(args.llamacpp_python, gguf_path(), args.threads)
        else:
            print(f"(llama.cpp skipped: no {args.llamacpp_python})")
    data = prompts(49152)
    times: dict[tuple[str, str], list[float]] = {}
    first_token: dict[str, list[float]] = {}
    firsts: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for workload, n in workloads.items():
            for name, engine in engines.items():
                engine.run(data[:n], 2)  # warm
                seconds, first = engine.run(data[:n], MAX_TOKENS)
                times.setdefault((name, workload), []).append(seconds)
                firsts[name] = first
                if workload == "single":
                    first_token.setdefault(name, []).append(engine.run(data[:1], 1)[0])
    report(engines, times, first_token, firsts)
    if "gguf" in engines and "single" in workloads:
        floor(engines["gguf"], times[("gguf", "single")], first_token["gguf"])
    for engine in engines.values():
        if isinstance(engine, LlamaCpp):
            engine.close()


def report(engines: dict, times: dict, first_token: dict, firsts: dict) -> None:
    print(f"{'engine':32s} {'workload':8s} {'tok/s (median)':>15s}  rounds (s)")
    for (name, workload), secs in times.items():
        tok = WORKLOADS[workload] * MAX_TOKENS
        print(f"{engines[name].label:32s} {workload:8s} {tok / statistics.median(secs):15.1f}  "
              + " ".join(f"{s:.2f}" for s in secs))
    for other in engines:
        if other == "gguf" or "gguf" not in engines:
            continue
        for workload in sorted({w for _, w in times}, key=list(WORKLOADS).index):
            ratios = [b / a for a, b in zip(times[("gguf", workload)], times[(other, workload)])]
            print(f"twinserve gguf / {other} ({workload}): {statistics.median(ratios):.2f}x "
                  f"(per round: {' '.join(f'{r:.2f}' for r in ratios)})")
    for name in firsts:
        if name != "fp32" and "fp32" in firsts and name in VARIANTS:
            same = next((i for i, (a, b) in enumerate(zip(firsts[name], firsts["fp32"]))
                         if a != b), len(firsts[name]))
            print(f"greedy tokens of the last run, {name} == fp32 for the first {same} of "
                  f"{len(firsts[name])}")


def floor(engine: Twinserve, full: list[float], first: list[float]) -> None:
    steps = [(f - p) / (MAX_TOKENS - 1) for f, p in zip(full, first)]
    step = statistics.median(steps)
    nbytes = streamed_bytes(engine.llm)
    bandwidth = streaming_read_bandwidth()
    limit = nbytes / bandwidth
    print(f"batch-1 decode step {step * 1e3:.2f} ms; streams {nbytes / 1e6:.1f} MB; read "
          f"bandwidth {bandwidth / 1e9:.2f} GB/s -> limit {limit * 1e3:.2f} ms = "
          f"{100 * limit / step:.0f}% of the step")


if __name__ == "__main__":
    main()
