"""Which width a loaded model's small CPU products run at, timed on its own decode steps.

``cpu_gemm.Gemm.small_widths`` pads a product of a few tokens to a wider one where that runs
faster. One layer's products, whose weights stay in the cache between repeats, can tie widths
that whole decode steps, whose weights stream from memory, tell apart (docs/cpu-backend.md has
the figures). So the runner times a decode step of each width in ``TUNED_WIDTHS`` (each count at
its own width) and keeps the widths that ran fastest (``choose_widths``); the layer's products
remain the timing where a step cannot be built here (tensor parallel workers, a cache too small
for the steps). Either runs once per machine and model shape (``gemm_tuning_cache``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from twinserve.gpu.kernels.cpu_gemm import TUNED_WIDTHS, choose_widths, median_times, tune_small_widths
from twinserve.gpu.layers.linear import LinearBase
from twinserve.gpu.measurement.gemm_tuning_cache import cached_widths

if TYPE_CHECKING:
    from twinserve.gpu.worker.model_runner import ModelRunner

STEP_CONTEXT = 48  # tokens of each timed decode (attention then costs little beside the products)


def tune_cpu_gemm(runner: ModelRunner, rounds: int = 5) -> None:
    """Sets ``runner.model``'s small widths, on a CPU whose products run feature-major in the
    weights' own dtype (not half weights widened, not quantized ones)."""
    model = runner.model
    gemm = model.gemm
    if not gemm.slabs or gemm.widen_half or not gemm.pad_tokens or not len(model.layers):
        return
    weights = [m.weight for m in model.layers[0].modules()
               if isinstance(m, LinearBase) and isinstance(getattr(m, "weight", None), torch.Tensor)
               and m.weight.dim() == 2 and m.weight.dtype in (torch.float32, torch.float64)]
    if not weights:
        return
    steps = _decode_steps(runner)
    if steps is None:
        widths = cached_widths(weights, lambda: tune_small_widths(weights, gemm),
                               {"timed": "layer products"})
    else:
        shape = {"timed": "decode steps", "layers": len(model.layers),
                 "vocab_size": runner.vocab_size}
        widths = cached_widths(weights, lambda: _time_steps(runner, steps, rounds), shape)
    model.set_gemm(dataclasses.replace(gemm, small_widths=widths))


def _decode_steps(runner: ModelRunner) -> dict | None:
    """A decode step of ``STEP_CONTEXT`` tokens per sequence for each width, or None where the
    runner cannot run one here."""
    from twinserve.gpu.measurement.profiler import StepSpec, build_step  # (the profiler imports the runner)
    if runner.tp is not None or runner.lora is not None:
        return None
    try:
        return {w: build_step(StepSpec(decodes=(STEP_CONTEXT,) * w), runner.block_size,
                              runner.num_gpu_blocks, runner.vocab_size,
                              runner.kv_layout.num_groups)
                for w in TUNED_WIDTHS}
    except ValueError:  # the cache holds fewer blocks than the widest step needs
        return None


def _time_steps(runner: ModelRunner, steps: dict, rounds: int) -> tuple[int, ...]:
    """Each width's step with every product unpadded (``median_times``); the widths by their
    medians (``choose_widths``)."""
    model = runner.model
    padded = model.gemm
    model.set_gemm(dataclasses.replace(padded, pad_tokens=False))
    try:
        seconds = median_times(lambda w: runner.execute(steps[w]), list(steps), rounds)
    finally:
        model.set_gemm(padded)
    return choose_widths(seconds)
