"""Where an engine step's time goes on the CPU, and how far batch-1 decode is from its floor.

Runs the offline benchmark's workloads through ``LLM.generate`` with wall-clock timers around the
parts of a step (the scheduler, input building, the layers' weight products, attention, the KV
write, norms, the LM head, sampling, output processing), then prints each part's milliseconds
per step and share of the step. On the CPU every torch op is synchronous, so the timers measure
the work itself. The timers cost about a microsecond per call (a few hundred calls a step).

    python -m twinserve.benchmarks.step_profile [--workloads batch single] [--dtype bfloat16]
    python -m twinserve.benchmarks.step_profile --model FILE.gguf --dtype float32   # quantized

With a GGUF file the decode steps that the fused kernel serves (``gpu/kernels/fused_decode.py``) show as
one part, "fused decode step (all layers)"; the others split as above.

The last line is the physical limit of a batch-1 decode step: the weight bytes it must read,
over the memory bandwidth of the ``--hardware`` profile.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator

import twinserve.gpu.worker.model_runner as runner_module
from twinserve.benchmarks.offline_throughput import decode_floor, greedy_params, workloads
from twinserve.core import Scheduler
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.gpu.kernels.fused_decode import FusedDecode
from twinserve.gpu.layers.attention_backend import AttentionBackend
from twinserve.gpu.models.model import CausalLM, DecoderLayer
from twinserve.gpu.worker.model_runner import ModelRunner

# (scope, owner, attribute): every callable timed, inclusive of what it calls
TIMED = [
    ("step", LLMEngine, "step"),
    ("schedule", Scheduler, "schedule"),
    ("update", Scheduler, "update_from_output"),
    ("execute", ModelRunner, "execute"),
    ("inputs", runner_module, "build_model_input"),
    ("prepare", AttentionBackend, "prepare"),
    ("forward", CausalLM, "forward"),
    ("fused", FusedDecode, "run"),
    ("attention_block", DecoderLayer, "_attention"),
    ("attend", AttentionBackend, "attend"),
    ("mlp", DecoderLayer, "_mlp"),
    ("lm_head", CausalLM, "compute_logits"),
    ("sampling", runner_module, "sample"),
]


@contextlib.contextmanager
def timers(model: CausalLM) -> Iterator[dict[str, float]]:
    """Seconds spent in each ``TIMED`` scope, the KV write and the norms (each module's own
    ``norm_fn``) while the block runs."""
    totals: dict[str, float] = collections.defaultdict(float)
    backend = model.backend
    # the LM head of the model's own class (a quantized model overrides it)
    scoped = [(scope, type(model) if scope == "lm_head" else owner, attr)
              for scope, owner, attr in TIMED]
    scoped.append(("kv_write", backend, "write_kv_cache"))
    scoped += [("norms", m, "norm_fn") for m in model.modules() if "norm_fn" in vars(m)]
    originals = [(owner, attr, getattr(owner, attr)) for _, owner, attr in scoped]
    try:
        for (scope, owner, attr), (_, _, fn) in zip(scoped, originals):
            setattr(owner, attr, _timed(fn, scope, totals))
        yield totals
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)


def _timed(fn: Callable, scope: str, totals: dict[str, float]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[scope] += time.perf_counter() - t0
    return wrapper


def breakdown(totals: dict[str, float]) -> dict[str, float]:
    """Exclusive seconds per part of a step; the parts sum to ``totals["step"]``."""
    t = collections.defaultdict(float, totals)
    attention_rest = t["attention_block"] - t["attend"] - t["kv_write"]
    return {
        "scheduler (schedule + update_from_output)": t["schedule"] + t["update"],
        "input build (positions, slots, block tables)": t["inputs"] + t["prepare"],
        "weight products: q/k/v, o (+ rope)": attention_rest,
        "weight products: MLP (+ SiLU)": t["mlp"],
        "attention over the paged KV": t["attend"],
        "KV cache write": t["kv_write"],
        "RMSNorm": t["norms"],
        "fused decode step (all layers)": t["fused"],
        "embedding, residual adds, rope table": (t["forward"] - t["attention_block"] - t["mlp"]
                                                 - t["norms"]),
        "LM head": t["lm_head"],
        "sampling": t["sampling"],
        "runner's rest (swaps, output, a quantized model's embedding)": (
            t["execute"] - t["inputs"] - t["prepare"] - t["forward"] - t["fused"]
            - t["lm_head"] - t["sampling"]),
        "output processing (detokenize, stop checks)": (t["step"] - t["schedule"] - t["update"]
                                                        - t["execute"]),
    }


def profile(llm, prompts: list[list[int]], lengths: list[int]) -> tuple[dict[str, float], int]:
    """``(exclusive seconds per part, steps)`` of one generate pass over the workload."""
    params = greedy_params(lengths)
    engine = llm.engine
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    steps = engine.num_steps
    with timers(engine.runner.model) as totals:
        llm.generate(prompts, params, use_tqdm=False)
    return breakdown(totals), engine.num_steps - steps


def format_breakdown(name: str, parts: dict[str, float], steps: int, tokens: int) -> str:
    total = sum(parts.values())
    head = (f"{name}: {steps} steps, {total / steps * 1e3:.1f} ms per step, "
            f"{tokens / total:.1f} generated tok/s (with timers)")
    lines = [head]
    for part, seconds in sorted(parts.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {part:<46} {seconds / steps * 1e3:9.2f} ms {seconds / total:7.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workloads", nargs="+", default=["batch", "single"],
                    choices=["batch", "single", "varied", "varied-uniform"])
    ap.add_argument("--hardware", default="cpu", help="the profile whose bandwidth sets the floor")
    args = ap.parse_args(argv)
    import torch

    from twinserve import LLM
    from twinserve.gpu.models.default_model import default_model_path
    torch.set_num_threads(args.threads)
    from twinserve.gpu.models.default_model import resolve_model_source
    model = args.model or str(default_model_path())
    model_dir, gguf_file = resolve_model_source(model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    llm = LLM(model, dtype=args.dtype, max_num_seqs=64, max_num_batched_tokens=2048,
              max_model_len=1024)
    data = workloads(vocab)
    for name in args.workloads:
        prompts, lengths = data[name]
        parts, steps = profile(llm, prompts, lengths)
        print(format_breakdown(name, parts, steps, sum(lengths)))
    if gguf_file is None:  # a GGUF's floor: benchmarks/quant_throughput.py measures it
        print(decode_floor(model, args.dtype, args.hardware))
    return 0


if __name__ == "__main__":
    sys.exit(main())
