"""Where one hand-built step's time goes, op by op (torch.profiler), on any device:

    python -m twinserve.benchmarks.kernel_profile --model DIR --device cuda --dtype bfloat16 \\
        [--step prefill:16] [--step decode:1x512] [--top 15]

Each ``--step`` is ``prefill:N`` (one chunk of N fresh tokens) or ``decode:BxC`` (B decodes at
context C). Prints, per step, its wall time (median of 5 after a warm-up), then the ``--top`` ops
by self host time with their call counts, and the device time where there is one: a step whose
wall time is far above its device time is bound by the host's launches, not the GPU.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from twinserve.gpu.measurement.profiler import StepSpec, build_step, time_call


def parse_step(text: str) -> StepSpec:
    kind, _, size = text.partition(":")
    try:
        if kind == "prefill":
            return StepSpec(prefills=((int(size), 0),))
        if kind == "decode":
            batch, context = size.split("x")
            return StepSpec(decodes=(int(context),) * int(batch))
    except ValueError:
        pass
    raise ValueError(f"--step {text!r}: expected prefill:N or decode:BxC.")


def profile_step(runner, spec: StepSpec, top: int) -> str:
    step = build_step(spec, runner.block_size, runner.num_gpu_blocks, runner.vocab_size,
                      runner.kv_layout.num_groups)
    cuda = runner.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    wall = statistics.median(time_call(partial(runner.execute, step), 2, 5, sync))
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        runner.execute(step)
        if sync:
            sync()
    events = prof.key_averages()
    # the kernels' own rows (an aten op's row repeats the time of the kernels it launched)
    device_us = sum(e.self_device_time_total for e in events
                    if e.device_type == DeviceType.CUDA and not e.is_user_annotation)
    table = events.table(sort_by="self_cpu_time_total", row_limit=top)
    head = f"== {spec.label()}: {wall * 1e3:.2f} ms wall"
    if cuda:
        head += f", {device_us / 1e3:.2f} ms of device time"
    return f"{head}\n{table}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--step", action="append", default=None, help="prefill:N or decode:BxC")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args(argv)
    specs = [parse_step(s) for s in (args.step or ["prefill:16", "decode:1x512"])]
    from twinserve.core.engine_args import EngineArgs
    from twinserve.entrypoints.cli.calibrate import model_dir_or_default
    from twinserve.gpu.worker.model_runner import ModelRunner
    runner = ModelRunner(EngineArgs(model=model_dir_or_default(args.model), device=args.device,
                                    dtype=args.dtype, max_model_len=args.max_model_len,
                                    gpu_memory_utilization=0.5), usage_context="server")
    for spec in specs:
        print(profile_step(runner, spec, args.top), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
