"""The model's weight products on CPU, shaped where torch's default path is slow.

Measured on this machine's 2-core AVX2 EPYC with SmolLM2-135M's weights
(``python -m twinserve.benchmarks.cpu_gemm``, all products of one forward):

- fp32: ``F.linear(x, W)`` (MKL with W transposed) jumps in cost from 1 token to 2 and stays
  there; ``W @ x.T`` ran 2.0-2.6x faster at 2-4 tokens, 1.1-1.8x at 6-16 and 1.0-1.2x at 64. So
  products of 2+ tokens are computed feature-major (``[out_features, T]``) in slabs of
  ``CPU_GEMM_SLAB`` weight rows (one wide product ran below the rate of slabs: 64 x 576 x 49152,
  80 ms vs 40 ms), and transposed back where the caller needs ``[T, out_features]``.
- bf16/fp16 where the CPU has no native half matmuls (no avx512_bf16 / AMX): torch's half GEMM
  costs about 18 ms more per token here (1.1 s at 64 tokens, about 4x fp32). From
  ``MIN_WIDEN_TOKENS`` tokens on, each slab of weights is widened to fp32 while it sits in cache
  and multiplied in fp32, the output rounded back: what a native bf16 GEMM computes (half inputs,
  fp32 accumulation); 1.3x faster than torch's at 8 tokens, 4.7-5.4x at 64, where it was as fast as
  fp32. Below, the product is bound by memory bandwidth and torch's half GEMV reads half the
  bytes: 2.4-2.9x faster than fp32 at 1 token.
- bf16 where the CPU has native bf16 matmuls (avx512_bf16 on a later 2-core EPYC): torch's own
  products beat feature-major ones at every width, 1.3-1.4x at 2-9 tokens and 1.9x at 512
  (products of one forward); whole steps ran 1.45x faster at 2 decodes, 1.19-1.27x at 4-8 and
  1.28x for a 110-token chunk beside 3 decodes, whose 4 logits rows ran feature-major before (5
  interleaved rounds). So half weights the CPU multiplies natively take ``F.linear``. That CPU
  has no fp16 matmuls: widened, a 256-token fp16 prefill took 0.43 s against 6.0 s.
- Feature-major products of T >= 7 tokens cost as much as, or more than, those of the next
  multiple of 8 when T % 8 >= 3: MKL's AVX2 tail for 3-7 columns is slow (T=15: 162 ms, padded
  to 16: 99 ms; T=31: 287 vs 181; T=63: 271 vs 201; median of 9 interleaved runs of every product
  of one forward). So such T are padded with zero tokens (``padded_width``). In served batches
  this showed as a step-time sawtooth: 63 decodes took 447 ms, 64 took 358 ms. A tail of 1-2
  columns is left as it is past 16 tokens (17 and 18 decodes: 135 and 140 ms, against 151-174 ms
  padded to 24, medians of 9 replays' steps), but 9 and 10 go to 16: unpadded they took 145 and
  159 ms against 113 ms for 11-16. In-process A/B runs of 96 decode steps agreed less: fp32
  9 sequences +24% and +6% tok/s, 10 sequences +10% and +1%; bf16 -3% and -2%; an unchanged
  control batch (17) moved by -5% to -10% in the same runs.
- Those few-column kernels differ from one CPU to the next: on another 2-core EPYC, 3 columns
  cost 77 ms per forward and 4 columns 54 ms, and decode steps of 3 sequences took 111 ms
  against 97 ms for 4. So the runner times one layer's products at 2 to 8 tokens once the model
  is loaded (``tune_small_widths``, about 0.1 s) and pads a count to a width that ran faster
  (there 3 to 4; 3-decode steps then took 90 ms).
- On a third 2-core EPYC, 16 columns ran faster than any width from 6 to 15: one layer's
  products took 36 ms at 16 tokens against 43-49 ms at 6-8 and 58-86 ms at 9-15 (the LM head
  17 ms against 17-32 ms), and decode steps of 5-8 sequences took 114-137 ms against 104 ms for
  16. So the tuning also times ``TUNED_MAX_WIDTH`` (twice the multiple) columns, which counts
  up to 8 may pad to; 9-15 columns are not timed (the fixed rule pads them to 16 anyway).
- On a fourth, one layer's products took 1.50 ms at 16 columns against 1.75 ms at 6 and
  1.41 ms at 5 (medians of 16 rounds). A 10% margin kept 6 at 6 while 7 and 8 went to 16, so
  6 decodes cost more than 7 or 8, which no fit monotone in tokens follows: the fidelity
  study's 6-sequence decodes ran 1.00-1.20x its profile, 3-4 sequences 0.78-0.98x. So a count
  takes the widest width within 5% of the fastest timed at or above it (``choose_widths``;
  with the narrower of a near-tie, 6 kept 6 while 7 and 8 took 16, and the next study's
  6-sequence decodes ran 1.11-1.24x its profile). Where a step fits, the runner times whole
  decode steps instead (``gemm_tuning``: there one layer's products tied 8 and 16 columns
  while the steps did not).
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

CPU_GEMM_SLAB = 1024
MIN_WIDEN_TOKENS = 6
PAD_MULTIPLE = 8
MIN_PADDED_TAIL = 3
TUNED_MAX_WIDTH = 2 * PAD_MULTIPLE
TUNED_WIDTHS = (*range(2, PAD_MULTIPLE + 1), TUNED_MAX_WIDTH)
HALF_DTYPES = (torch.bfloat16, torch.float16)
NATIVE_HALF_FLAGS = {torch.bfloat16: frozenset({"avx512_bf16", "amx_bf16"}),
                     torch.float16: frozenset({"avx512_fp16", "amx_fp16"})}


@dataclass(frozen=True, slots=True)
class Gemm:
    """How one model's weight products run: ``slabs`` computes products of 2+ tokens
    feature-major in slabs of weight rows (else every product is torch's ``F.linear``);
    ``widen_half`` (half weights on a CPU without native matmuls in their dtype) widens products
    of ``MIN_WIDEN_TOKENS``+ tokens to fp32 and leaves smaller ones to torch's half GEMV;
    ``pad_tokens`` pads feature-major products to ``padded_width`` tokens."""
    slabs: bool
    widen_half: bool
    pad_tokens: bool = True
    # The width of products of fewer tokens than its length, measured on the loaded model
    # (``tune_small_widths``); others take ``padded_width``.
    small_widths: tuple[int, ...] = ()

    @classmethod
    def for_device(cls, device: torch.device, dtype: torch.dtype) -> Gemm:
        """Feature-major on a CPU, except for half weights the CPU multiplies natively (torch's
        products are faster there); widened for half weights it does not."""
        on_cpu = device.type == "cpu"
        half = on_cpu and dtype in HALF_DTYPES
        native = half and cpu_has_native_half(dtype)
        return cls(slabs=on_cpu and not native, widen_half=half and not native)

    def plain(self, num_tokens: int) -> bool:
        """Whether torch's own ``F.linear`` is the faster product for ``num_tokens`` rows."""
        if not self.slabs:
            return True
        return num_tokens < (MIN_WIDEN_TOKENS if self.widen_half else 2)

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)``: contiguous ``[T, out_features]``; ``x`` may be a
        transposed view."""
        if self.plain(x.shape[0]):
            return F.linear(x, weight, bias)
        out = self.feature_major(x, weight).t().contiguous()
        return out if bias is None else out.add_(bias)

    def feature_major(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``F.linear(x, weight).t()``: ``[out_features, T]``, contiguous or (when ``T`` was
        padded) the first ``T`` columns of a contiguous product."""
        num_tokens = x.shape[0]
        if self.plain(num_tokens):
            return F.linear(x, weight).t().contiguous()
        width = self.width(num_tokens) if self.pad_tokens else num_tokens
        if width != num_tokens:
            x = torch.cat([x, x.new_zeros(width - num_tokens, x.shape[1])])
        out = x.new_empty(weight.shape[0], width)
        if not self.widen_half:
            for start in range(0, weight.shape[0], CPU_GEMM_SLAB):
                rows = weight[start:start + CPU_GEMM_SLAB]
                torch.mm(rows, x.t(), out=out[start:start + rows.shape[0]])
        else:
            x32_t = x.float().t()
            for start in range(0, weight.shape[0], CPU_GEMM_SLAB):
                stop = start + CPU_GEMM_SLAB
                out[start:stop] = torch.mm(weight[start:stop].float(), x32_t)
        return out if width == num_tokens else out[:, :num_tokens]

    def width(self, num_tokens: int) -> int:
        """The column count a feature-major product of ``num_tokens`` tokens runs at."""
        if num_tokens < len(self.small_widths):
            return self.small_widths[num_tokens]
        return padded_width(num_tokens)


def tune_small_widths(weights: Sequence[torch.Tensor], gemm: Gemm, rounds: int = 9,
                      margin: float = 0.05) -> tuple[int, ...]:
    """``Gemm.small_widths`` for products of up to ``TUNED_MAX_WIDTH`` tokens, timed on
    ``weights`` (one layer's): each of ``TUNED_WIDTHS`` in shuffled rounds, medians compared by
    ``choose_widths`` (why: the module's notes)."""
    unpadded = dataclasses.replace(gemm, pad_tokens=False)
    inputs = {t: [torch.zeros(t, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
              for t in TUNED_WIDTHS}

    def run(t: int) -> None:
        for w, x in zip(weights, inputs[t]):
            unpadded.feature_major(x, w)
    return choose_widths(median_times(run, TUNED_WIDTHS, rounds), margin)


def median_times(run: Callable[[int], object], widths: Sequence[int],
                 rounds: int) -> dict[int, float]:
    """Each width's median seconds of ``run(width)`` over ``rounds`` shuffled (seeded) rounds,
    after one untimed round that warms the caches up."""
    times: dict[int, list[float]] = {w: [] for w in widths}
    rng = random.Random(0)
    for round_ in range(rounds + 1):
        order = list(widths)
        rng.shuffle(order)
        for w in order:
            start = time.perf_counter()
            run(w)
            if round_:
                times[w].append(time.perf_counter() - start)
    return {w: statistics.median(v) for w, v in times.items()}


def choose_widths(seconds: dict[int, float], margin: float = 0.05) -> tuple[int, ...]:
    """For each token count up to the largest timed width, the widest timed width at or above
    it within ``margin`` of the fastest of those (the count itself, or ``padded_width``'s
    choice, where that is not timed). The time of the width a count takes is then within
    ``margin`` of a non-decreasing function of the count (the fastest at or above it), the
    shape the cost model's fit assumes; near-ties go to the wider width, so counts that tie
    share one (a timing's noise then leaves no bump between them)."""
    largest = max(seconds)
    out = []
    for t in range(largest + 1):
        static = padded_width(t)
        if t < 2 or static not in seconds:
            out.append(static)
            continue
        wider = [w for w in seconds if w >= t]
        fastest = min(seconds[w] for w in wider)
        out.append(max(w for w in wider if seconds[w] <= (1 + margin) * fastest))
    return tuple(out)


def padded_width(num_tokens: int) -> int:
    """The column count a feature-major product of ``num_tokens`` tokens runs at: the next
    multiple of ``PAD_MULTIPLE`` from 7 tokens on (below, 3-6 columns ran faster unpadded) when
    the tail is ``MIN_PADDED_TAIL`` columns or more or the count is below twice the multiple,
    else ``num_tokens``."""
    tail = num_tokens % PAD_MULTIPLE
    short = num_tokens < 2 * PAD_MULTIPLE
    if num_tokens < PAD_MULTIPLE - 1 or tail == 0 or (tail < MIN_PADDED_TAIL and not short):
        return num_tokens
    return num_tokens + PAD_MULTIPLE - tail


def cpu_has_native_half(dtype: torch.dtype) -> bool:
    """Whether /proc/cpuinfo lists matmul instructions for ``dtype`` (bfloat16: avx512_bf16 or
    amx_bf16; float16: avx512_fp16 or amx_fp16); False for other dtypes or where it cannot be
    read."""
    wanted = NATIVE_HALF_FLAGS.get(dtype, frozenset())
    return bool(wanted and wanted & cpu_flags())


def cpu_has_native_bf16() -> bool:
    return cpu_has_native_half(torch.bfloat16)


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
