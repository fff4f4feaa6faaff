"""The model's weight products on CPU, shaped where torch's default path is slow.

Decisions (the figures behind each, per machine, with the command that measures them
(``python -m twinserve.benchmarks.cpu_gemm``), are in docs/cpu-backend.md, "Weight products"):

- fp32: ``F.linear(x, W)`` (MKL with W transposed) jumps in cost from 1 token to 2, where
  ``W @ x.T`` does not. So products of 2+ tokens are computed feature-major (``[out_features, T]``)
  in slabs of ``CPU_GEMM_SLAB`` weight rows (one wide product runs below the rate of slabs), and
  transposed back where the caller needs ``[T, out_features]``.
- bf16/fp16 where the CPU has no native half matmuls (no avx512_bf16 / AMX): torch's half GEMM
  is several times slower than fp32. From ``MIN_WIDEN_TOKENS`` tokens on, each slab of weights is
  widened to fp32 while it sits in cache and multiplied in fp32, the output rounded back: what a
  native bf16 GEMM computes (half inputs, fp32 accumulation). Below, the product is bound by
  memory bandwidth and torch's half GEMV, reading half the bytes, is the faster one.
- Half weights the CPU multiplies natively take torch's own ``F.linear``: it beats feature-major
  products at every width there. A single row is multiplied as two (a zero row added): torch's
  one-row half product sums in another order than its product of 2+ rows (at 1,536 inputs it
  differs in the last bit), so without the pad a speculative verification's rows would not be
  bitwise those of the decodes they stand for and greedy outputs would part at near-ties. Rows
  of 2+ row products are bitwise independent of the row count, on a CPU with AMX within each of
  two classes (up to 32 rows, 33 or more: torch's oneDNN switches kernels; evening them out
  would cost 1.3-3.5x, so it is not done); the pad costs no measurable time
  (docs/speculative-decoding.md, "bf16 greedy equality").
- Feature-major products of T >= 7 tokens cost as much as those of the next multiple of 8 when
  T % 8 >= 3 (MKL's AVX2 tail for 3-7 columns is slow; in served batches a step-time sawtooth),
  so such T are padded with zero tokens (``padded_width``). A tail of 1-2 columns is left as it
  is past 16 tokens, but 9 and 10 go to 16.
- The few-column kernels differ from one CPU to the next, so the runner times the widths in
  ``TUNED_WIDTHS`` once the model is loaded (``tune_small_widths``; whole decode steps where one
  fits, ``gemm_tuning``) and a count takes the widest width within 5% of the fastest timed at or
  above it (``choose_widths``). The margin and the near-tie rule keep the time of the width a
  count runs at within 5% of a curve that never falls as the count grows, the shape the cost
  model's fit assumes.
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
    # a one-row product of native half weights runs as two rows (why: the module's notes)
    pad_single: bool = False
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
        return cls(slabs=on_cpu and not native, widen_half=half and not native, pad_single=native)

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
            if self.pad_single and x.shape[0] == 1:
                return F.linear(torch.cat([x, x.new_zeros(x.shape)]), weight, bias)[:1]
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
