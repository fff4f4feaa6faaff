"""Multi-LoRA batch throughput, side by side in one run: one 64-request batch whose requests use
0, 1, 4 or 8 different adapters (rank 16, all seven projections, random weights in PEFT's
format), against the base model alone and against merging each adapter into the weights and
serving its requests one adapter after another; and, given a vLLM CPU venv, vLLM CPU on the
same batches (``enable_lora=True``, ``max_loras=8``).

    python -m twinserve.benchmarks.lora_throughput [--rounds 3] [--max-tokens 64]
        [--vllm-python /work/peers/vllm/bin/python]

Rounds are interleaved (every configuration and engine once per round, the order rotating), so a
slow spell of the shared machine hits all alike. Prints generated tok/s per configuration (median
of the rounds) and, per round, each configuration's ratio to the base model on the same engine
(median over rounds): Punica's claim is that mixed-adapter batches cost little over the base.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from twinserve.benchmarks.offline_throughput import VllmWorker
from twinserve.core.lora import LoRARequest
from twinserve.core.model_config import ModelConfig
from twinserve.gpu.lora.lora_weights import write_random_adapter

NUM_REQUESTS = 64
PROMPT_LEN = 32
RANK = 16
CONFIGS = ("base", "lora-1", "lora-4", "lora-8", "merged-8")


def assignment(config: str) -> list[int | None]:
    """Adapter index per request: round-robin over the configuration's adapters."""
    if config == "base":
        return [None] * NUM_REQUESTS
    k = int(config.split("-")[1])
    return [i % k for i in range(NUM_REQUESTS)]


class TwinserveRunner:
    """twinserve with LoRA enabled (8 slots) and a plain engine for the merged baseline."""

    def __init__(self, model: str, dtype: str, adapters: list[Path]) -> None:
        from twinserve import LLM
        common = dict(dtype=dtype, max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=2048,
                      max_model_len=1024)
        self.lora = LLM(model, enable_lora=True, max_loras=8, max_lora_rank=RANK, **common)
        self.plain = LLM(model, **common)
        self.requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]

    def run(self, config: str, prompts: list[list[int]], max_tokens: int) -> float:
        from twinserve import SamplingParams
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        if config.startswith("merged"):
            return self._run_merged(int(config.split("-")[1]), prompts, params)
        loras = [None if a is None else self.requests[a] for a in assignment(config)]
        self.lora.generate(prompts[:2], params, lora_request=loras[:2], use_tqdm=False)
        t0 = time.perf_counter()
        self.lora.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return len(prompts) * max_tokens / (time.perf_counter() - t0)

    def _run_merged(self, k: int, prompts: list[list[int]], params) -> float:
        """Each adapter merged into the weights in turn, its requests run, the weights restored."""
        from twinserve.gpu.lora.lora_weights import load_peft_adapter
        runner = self.plain.engine.runner
        groups = [[p for i, p in enumerate(prompts) if i % k == a] for a in range(k)]
        self.plain.generate(prompts[:2], params, use_tqdm=False)
        t0 = time.perf_counter()
        for a, group in enumerate(groups):
            adapter = load_peft_adapter(self.requests[a], runner.config, RANK)
            saved = merge(runner.model, runner.config, adapter.weights)
            self.plain.generate(group, params, use_tqdm=False)
            for param, original in saved:
                param.copy_(original)
        return len(prompts) * params.max_tokens / (time.perf_counter() - t0)


def merge(model, config: ModelConfig, weights) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Adds ``B A`` into each targeted projection's rows; returns what to restore."""
    where = {}
    for spec in config.arch.linears(config):
        start = 0
        for shard in spec.shards:
            where[shard.hf_name.rpartition(".")[2]] = (spec.name, start, shard.output_size)
            start += shard.output_size
    saved = []
    with torch.no_grad():
        for (layer, module), (a, b) in weights.items():
            name, start, size = where[module]
            param = getattr(model.layers[layer], name).weight
            rows = param.data.narrow(0, start, size)
            saved.append((rows, rows.clone()))
            rows.add_((b @ a).to(rows.dtype))
    return saved


VLLM_LORA_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
def main():
    adapters = json.loads(sys.argv[3])
    llm = LLM(model=sys.argv[1], dtype=sys.argv[2], max_model_len=1024, max_num_seqs=64,
              enable_lora=True, max_loras=8, max_lora_rank=16)
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
    print("READY", flush=True)
    for line in sys.stdin:
        prompts, lengths, assign = json.loads(line)
        ps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        lr = [None if a is None else reqs[a] for a in assign]
        llm.generate(tp[:2], ps[:2], lora_request=lr[:2], use_tqdm=False)
        t0 = time.perf_counter(); llm.generate(tp, ps, lora_request=lr, use_tqdm=False)
        print("RESULT", sum(lengths) / (time.perf_counter() - t0), flush=True)
if __name__ == "__main__":
    main()
"""


class VllmLoraWorker(VllmWorker):
    """vLLM CPU with LoRA in its own venv; the batch carries the adapter of each request."""

    def __init__(self, python: str, model: str, dtype: str, tmp: Path, adapters: list[Path]) -> None:
        import os
        import subprocess
        tmp.mkdir(parents=True, exist_ok=True)
        script = tmp / "vllm_lora_worker.py"
        script.write_text(VLLM_LORA_WORKER)
        self._log = tmp / "vllm_lora_worker.log"
        # passive OpenMP waits: an idle worker must not spin on the cores twinserve's turn uses
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", OMP_WAIT_POLICY="PASSIVE")
        with open(self._log, "w") as log:
            self._proc = subprocess.Popen(
                [python, str(script), model, dtype, json.dumps([str(p) for p in adapters])],
                env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        self._expect("READY")

    def run_config(self, config: str, prompts: list[list[int]], max_tokens: int) -> float:
        self._proc.stdin.write(json.dumps([prompts, [max_tokens] * len(prompts),
                                           assignment(config)]) + "\n")
        self._proc.stdin.flush()
        return float(self._expect("RESULT"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--vllm-python", default=None, help="python of a vLLM CPU venv")
    args = parser.parse_args()
    from twinserve.gpu.models.default_model import resolve_model_path
    model = str(resolve_model_path(args.model))
    config = ModelConfig.from_dir(model)
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    adapters = [write_random_adapter(config, tmp / f"a{i}", RANK, i) for i in range(8)]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, config.vocab_size) for _ in range(PROMPT_LEN)]
               for _ in range(NUM_REQUESTS)]
    print(f"{model}: {NUM_REQUESTS} requests x {PROMPT_LEN} prompt + {args.max_tokens} generated "
          f"tokens, {args.dtype}, greedy; adapters rank {RANK} on all 7 projections")
    passes: list[tuple[str, str]] = [("twinserve", c) for c in CONFIGS]
    engines = {"twinserve": TwinserveRunner(model, args.dtype, adapters)}
    if args.vllm_python:
        engines["vllm"] = VllmLoraWorker(args.vllm_python, model, args.dtype, tmp, adapters)
        passes += [("vllm", c) for c in CONFIGS if not c.startswith("merged")]
    results: dict[tuple[str, str], list[float]] = {p: [] for p in passes}
    for r in range(args.rounds):
        order = passes[r % len(passes):] + passes[:r % len(passes)]
        for engine, cfg in order:
            runner = engines[engine]
            tok_s = (runner.run(cfg, prompts, args.max_tokens) if engine == "twinserve"
                     else runner.run_config(cfg, prompts, args.max_tokens))
            results[(engine, cfg)].append(tok_s)
            print(f"  round {r} {engine:<10} {cfg:<9} {tok_s:8.1f} tok/s", flush=True)
    if "vllm" in engines:
        engines["vllm"].close()
    print(summary(results, args.rounds))


def summary(results: dict[tuple[str, str], list[float]], rounds: int) -> str:
    lines = ["", f"{'engine':<10} {'config':<9} {'tok/s':>8} {'vs base':>8}"]
    for (engine, cfg), values in results.items():
        base = results[(engine, "base")]
        ratio = statistics.median(v / b for v, b in zip(values, base))
        lines.append(f"{engine:<10} {cfg:<9} {statistics.median(values):8.1f} {ratio:8.3f}")
    if ("vllm", "base") in results:
        lines.append("twinserve / vLLM, same configuration, same round (median):")
        for cfg in CONFIGS:
            if ("vllm", cfg) in results:
                ratios = [t / v for t, v in zip(results[("twinserve", cfg)], results[("vllm", cfg)])]
                lines.append(f"  {cfg:<9} {statistics.median(ratios):.2f}x")
    lines.append(f"(medians of {rounds} interleaved rounds)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
