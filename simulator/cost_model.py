"""Step time of the simulated GPU: a roofline that needs no profiling, and a fitted linear model.

Roofline (``CostModel``), per GPU of a tensor-parallel group, two operator groups each bound by the
slower of compute and memory, plus communication, swap copies and fixed overheads::

    linear    = max(2 * P_layers * T + 2 * V * H * S , (P_layers + V * H) * dtype) / (rates)   # GEMMs
    attention = max(4 * L * heads * head_dim * C     , kv_bytes * (C_read + T))    / (rates)   # paged attn
    step      = linear + attention + allreduce + swap + step_overhead + L * per_layer + S * per_seq

with T scheduled tokens, S scheduled sequences (``lm_head`` runs on one position per sequence), C
``sum_context_tokens`` (the positions every new token attends to), C_read the KV positions read:
a decode reads its whole context once; a prefill chunk reads its prefix and itself once.
FLOPs are divided by ``eff_compute * peak_flops``, bytes by ``eff_memory * mem_bandwidth``; weights,
heads and FLOPs split over ``tensor_parallel_size``. Each layer does two ring all-reduces of
``T * H * dtype`` bytes: ``2 * (tp - 1) / tp * bytes / interconnect_bandwidth + latency`` each.
Summing the two groups (instead of one max over the step) charges a mixed batch for its
memory-bound decode attention even when its GEMMs are compute-bound.

Decode context: only the scheduler knows how ``sum_context_tokens`` splits between decodes and
prefill chunks. ``SchedulerOutput.sum_decode_context_tokens`` is used when present; otherwise the
prefill share is taken as that of prompt chunks without a cached prefix, ``P * (P / k + 1) / 2``
for P prefill tokens in k chunks (exact for fresh equal-length chunks, an over-estimate of the decode
share for chunks continuing a long prompt), capped at ``max_position_embeddings`` per decode.

LoRA (``lora``, a ``lora_cost.LoRACost``; ``None`` without LoRA, and then nothing is computed):
a step adds the LoRA group of its distinct adapters and the host-to-device copy of the adapters it
loads (``lora_cost`` has the formulas and the decisions behind them).

Fitted (``FittedCostModel``): ``seconds = intercept + sum(c_f * feature_f)`` over ``FEATURE_NAMES``
with non-negative coefficients (NNLS), swap copies still timed by the roofline's PCIe term. A fit
that holds coefficients of ``LORA_FEATURE_NAMES`` (fitted on samples that carried them) times the
LoRA terms with them; any other fit keeps the roofline's LoRA terms. Besides
the linear terms, the features split the token count over log-spaced spans (``TOKEN_SEGMENTS``),
so the fit can follow the steps of tiled kernels while staying non-decreasing in tokens.

The terms follow the real engine's kernels, so that a fit over a grid of the step space holds for
workloads it never saw: the weight products by token count (``num_tokens`` and the segments),
``lm_head`` and sampling by sequences (``num_decode_seqs``, ``num_prefill_seqs``), decode
attention by the summed contexts and, for a backend that pads, by batch x longest context; prefill
attention by tokens x context (``sum_context_tokens``). Backend fits of this machine also carry
``KERNEL_FEATURE_NAMES``: the CPU decode kernel's longest context, its critical path when a small
batch is split over KV heads, the prefill chunks after a prefix, whose attention runs a masked
kernel (``num_prefix_chunks``) that reads each chunk's prefix (``sum_prefix_context_tokens``),
the chunks' whole query-by-key rectangles (``sum_prefill_attention_area``: the CPU kernels
compute the masked half too), and the steps that hold a prefill chunk, which on CUDA run
eagerly where decode-only steps replay CUDA graphs (``prefill_step``). Every coefficient is
non-negative and every feature non-decreasing in tokens and contexts, so the fitted time is
monotone in both; all are per-step aggregates of the ``SchedulerOutput`` (``step_time`` stays
O(1)).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from twinserve.core.model_config import ModelConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.hardware import FittedParams, HardwareProfile
from twinserve.simulator.lora_cost import LORA_FEATURE_NAMES, LoRACost, LoRAWork, lora_step_features
from twinserve.simulator.moe_cost import (
    ExpertWeights,
    WindowedAttention,
    expert_weights,
    windowed_attention,
)
from twinserve.simulator.step_time import StepTimeModel

# Token counts where the fitted step time may change slope. GEMM kernels run in tiles and pad
# their width, so time is not linear in the tokens of a step: it runs in plateaus (measured
# ones in docs/fidelity.md, "The cost model's terms"). ``tokens_<a>_<b>`` counts a step's tokens
# between two knots (``tokens_<a>_up`` past the last); with non-negative coefficients the fitted
# time is a non-decreasing piecewise-linear function of the token count, linear past the last knot.
TOKEN_KNOTS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
TOKEN_SEGMENTS: tuple[str, ...] = (*(f"tokens_{a}_{b}" for a, b in zip(TOKEN_KNOTS, TOKEN_KNOTS[1:])),
                                   f"tokens_{TOKEN_KNOTS[-1]}_up")
FEATURE_NAMES: tuple[str, ...] = (
    "num_tokens",  # total_num_scheduled_tokens: GEMM work above the weight-streaming floor
    "num_prefill_tokens",
    "num_prefill_seqs",
    "num_decode_seqs",  # per-sequence CPU work, lm_head, sampling
    "sum_context_tokens",  # attention FLOPs
    "sum_decode_context_tokens",  # KV bytes read by decodes
    "padded_decode_context_tokens",  # decodes x longest decode context: padded attention backends
    *TOKEN_SEGMENTS,
)
_NUM_LINEAR = len(FEATURE_NAMES) - len(TOKEN_SEGMENTS)
# Terms that follow the CPU engine's own kernels, fitted by the backend calibrations of this
# machine (``calibration.fit_backend``/``fit_joint``; generic fits such as the Vidur one keep
# ``FEATURE_NAMES``). Each was added where a measured shape of step time had no term to follow
# it; the timings behind them are in docs/fidelity.md, "The cost model's terms".
# ``max_decode_context``: the native decode kernel splits a batch of fewer than 4 x threads
# decodes over KV heads, so each thread walks whole contexts: the longest one is its critical path.
# ``num_prefix_chunks``: a prefill chunk after a prefix runs a masked attention kernel whose cost
# per chunk neither ``num_prefill_seqs`` nor tokens x context follows.
# ``sum_prefix_context_tokens`` (the chunks' prefixes, summed): the masked kernel gathers each
# chunk's prefix and reads it whatever the chunk's length.
# ``sum_prefill_attention_area`` (chunk tokens x (prefix + chunk tokens), summed): torch's CPU
# flash kernel skips none of a causal prompt's masked half, so a fresh prompt costs its whole
# square where ``sum_context_tokens`` prices the triangle.
# ``tokens_ge_<k>`` (1 from ``k`` tokens on) lets the step time jump where a GEMM kernel starts
# another tile of rows (the segments alone only bend at powers of two): at 2, 3 and every 4th
# count from 5 to 33, where the grid times each batch size (``gpu.measurement.profiler.batch_sweep``).
# ``prefill_step`` (1 for a step that holds a prefill chunk): on CUDA a decode-only step replays
# a CUDA graph while a step with a prefill chunk launches every kernel from Python, a fixed cost
# per step (docs/gpu-backend.md).
TOKEN_STEP_KNOTS: tuple[int, ...] = (2, 3, 5, 9, 13, 17, 21, 25, 29, 33)
TOKEN_STEP_NAMES: tuple[str, ...] = tuple(f"tokens_ge_{k}" for k in TOKEN_STEP_KNOTS)
KERNEL_FEATURE_NAMES: tuple[str, ...] = ("max_decode_context", "num_prefix_chunks",
                                         "sum_prefix_context_tokens",
                                         "sum_prefill_attention_area", "prefill_step",
                                         *TOKEN_STEP_NAMES)
_NUM_KERNEL_LINEAR = 5  # the kernel features before the token steps
ALL_FEATURE_NAMES: tuple[str, ...] = (*FEATURE_NAMES, *KERNEL_FEATURE_NAMES)
KNOWN_FEATURES = frozenset((*ALL_FEATURE_NAMES, *LORA_FEATURE_NAMES))
DEFAULT_BLOCK_SIZE = 16
_NON_TORCH_RESERVE_BYTES = 512 * 2**20  # CUDA context, cuBLAS/NCCL workspaces, CUDA graphs


def decode_context_tokens(out: SchedulerOutput, max_context: int | None = None) -> int:
    """The part of ``sum_context_tokens`` owed to decodes (the scheduler counts it exactly)."""
    decode = out.sum_decode_context_tokens
    if max_context is not None:
        decode = min(decode, out.num_decode_seqs * max_context)
    return decode


def _feature_vector(out: SchedulerOutput, max_context: int | None) -> tuple[float, ...]:
    """The linear features (``FEATURE_NAMES`` before the token segments, then the longest decode
    context, the prefix chunks, their prefixes, the chunks' attention area and the prefill step
    of ``KERNEL_FEATURE_NAMES``)."""
    longest = out.max_decode_context if max_context is None else min(out.max_decode_context,
                                                                      max_context)
    return (out.total_num_scheduled_tokens, out.num_prefill_tokens, out.num_prefill_seqs,
            out.num_decode_seqs, out.sum_context_tokens, decode_context_tokens(out, max_context),
            out.num_decode_seqs * longest, longest, out.num_prefix_chunks,
            out.sum_prefix_context_tokens, out.sum_prefill_attention_area,
            int(out.num_prefill_seqs > 0))


def token_segments(num_tokens: int) -> tuple[int, ...]:
    """How many of ``num_tokens`` fall in each ``TOKEN_SEGMENTS`` span (they sum to
    ``num_tokens - 1`` from 1 token on)."""
    spans = zip(TOKEN_KNOTS, TOKEN_KNOTS[1:])
    return (*(max(0, min(num_tokens, hi) - lo) for lo, hi in spans),
            max(0, num_tokens - TOKEN_KNOTS[-1]))


def token_steps(num_tokens: int) -> tuple[int, ...]:
    """``TOKEN_STEP_NAMES``' values: 1 for each knot at or below ``num_tokens``."""
    return tuple(int(num_tokens >= k) for k in TOKEN_STEP_KNOTS)


def step_features(out: SchedulerOutput, max_context: int | None = None) -> dict[str, float]:
    """The features of one step, keyed by ``ALL_FEATURE_NAMES`` (what calibration records)."""
    linear = _feature_vector(out, max_context)
    tokens = out.total_num_scheduled_tokens
    return dict(zip(ALL_FEATURE_NAMES, (*linear[:_NUM_LINEAR], *token_segments(tokens),
                                        *linear[_NUM_LINEAR:], *token_steps(tokens))))


@dataclass(slots=True, frozen=True)
class StepCost:
    """One step, term by term (per GPU). ``total_s`` is what ``step_time`` returns."""

    flops: float
    nbytes: float
    compute_s: float  # all FLOPs at the achievable compute rate
    memory_s: float  # all bytes at the achievable bandwidth
    linear_s: float
    attention_s: float
    allreduce_s: float
    swap_s: float
    overhead_s: float
    total_s: float
    lora_s: float = 0.0  # the adapters' products (their own roofline group)
    lora_load_s: float = 0.0  # adapters copied host-to-device before the forward pass

    @property
    def is_compute_bound(self) -> bool:
        return self.compute_s > self.memory_s


class DeviceCostModel(StepTimeModel, Protocol):
    """A cost model of one replica's devices: the step time of ``StepTimeModel`` plus what
    building a replica needs (memory sizing, swap and adapter copies, a description for the
    run folder). The roofline (``CostModel``, whose LoRA, MoE and sliding-window terms are
    parts of it) and the fitted model (``FittedCostModel``, which rests on a roofline)
    implement it; ``roofline`` names the roofline a model rests on, so that callers need not
    know which of them they hold."""

    @property
    def model(self) -> ModelConfig: ...

    @property
    def hardware(self) -> HardwareProfile: ...

    @property
    def tensor_parallel_size(self) -> int: ...

    @property
    def roofline(self) -> CostModel:
        """The roofline this model's memory sizing and copy times come from (itself for one)."""
        ...

    def with_lora(self, lora: LoRACost | None) -> DeviceCostModel:
        """A copy with the LoRA terms ``lora`` (``None``: without)."""
        ...

    def lora_load_time(self, loads: Sequence[tuple[str, int]]) -> float:
        """Seconds to copy a step's ``lora_loads`` host-to-device (0 without LoRA)."""
        ...

    def swap_time(self, num_blocks: int, block_size: int | None = None) -> float: ...

    def num_gpu_blocks(self, gpu_memory_utilization: float, block_size: int | None = None,
                       activation_reserve_bytes: int | None = None) -> int: ...

    def describe(self) -> str:
        """Which profile and which data the step times rest on (for run folders)."""
        ...


@dataclass(slots=True)
class CostModel:
    """Roofline step time for ``model`` on ``tensor_parallel_size`` devices like ``hardware``.

    ``block_size`` (tokens per KV block) sizes the swap and copy traffic of a step; ``lora``
    adds the LoRA terms (with LoRA enabled); ``kv_block_bytes``: one block's bytes when a block
    spans fewer than all layers (a hybrid KV cache's group, ``core/kv_cache_groups.py``).
    """

    model: ModelConfig
    hardware: HardwareProfile
    tensor_parallel_size: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE
    lora: LoRACost | None = None
    kv_block_bytes: int | None = None
    _s_per_flop: float = field(init=False, repr=False)
    _s_per_byte: float = field(init=False, repr=False)
    _flops_per_token: float = field(init=False, repr=False)
    _flops_per_seq: float = field(init=False, repr=False)
    _flops_per_context: float = field(init=False, repr=False)
    _weight_bytes: float = field(init=False, repr=False)
    _kv_bytes: int = field(init=False, repr=False)
    _fixed_s: float = field(init=False, repr=False)
    _per_seq_s: float = field(init=False, repr=False)
    _max_context: int = field(init=False, repr=False)
    # mixtures of experts / sliding windows (simulator/moe_cost.py); None for dense, full attention
    _experts: ExpertWeights | None = field(init=False, repr=False)
    _window: WindowedAttention | None = field(init=False, repr=False)
    _allreduce_s_per_token: float = field(init=False, repr=False)
    _allreduce_latency_s: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._validate()
        m, hw, tp = self.model, self.hardware, self.tensor_parallel_size
        arch = m.arch  # the formulas the engine's layers are built from
        self._s_per_flop = 1.0 / (hw.eff_compute * hw.peak_flops)
        self._s_per_byte = 1.0 / (hw.eff_memory * hw.mem_bandwidth)
        self._flops_per_token = arch.linear_flops_per_token(m) / tp
        self._flops_per_seq = arch.lm_head_flops_per_seq(m) / tp  # lm_head on the sampled position
        self._flops_per_context = arch.attention_flops_per_context_token(m) / tp
        self._weight_bytes = arch.streamed_params(m) * m.weight_bytes_per_param / tp  # quantized
        self._kv_bytes = self.kv_bytes_per_token_per_gpu
        ring = 2.0 * (tp - 1) / tp
        self._allreduce_s_per_token = (arch.allreduce_elements_per_token(m) * ring * m.dtype_bytes
                                       / hw.interconnect_bandwidth)
        layers = m.num_hidden_layers
        self._allreduce_latency_s = 2 * layers * hw.interconnect_latency_s if tp > 1 else 0.0
        self._fixed_s = hw.step_overhead_s + hw.per_layer_overhead_s * layers
        self._per_seq_s = hw.per_seq_overhead_s
        self._max_context = m.max_position_embeddings
        self._experts = expert_weights(m, m.weight_bytes_per_param, tp)
        self._window = windowed_attention(m)

    def _validate(self) -> None:
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}.")
        if self.model.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads "
                             f"({self.model.num_attention_heads}).")
        kv = self.model.num_key_value_heads
        if kv % tp and tp % kv:
            raise ValueError(f"tensor_parallel_size ({tp}) and num_key_value_heads ({kv}) must divide "
                             "one another.")
        _check_block_size(self.block_size)

    @property
    def kv_heads_per_gpu(self) -> int:
        """KV heads split over the group; replicated when there are fewer heads than GPUs (as vLLM)."""
        return max(1, self.model.num_key_value_heads // self.tensor_parallel_size)

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        m = self.model
        return m.arch.kv_elements_per_token(m, self.kv_heads_per_gpu) * m.kv_value_bytes

    @property
    def weight_bytes_per_gpu(self) -> int:
        return math.ceil(self.model.weight_bytes / self.tensor_parallel_size)

    @property
    def roofline(self) -> CostModel:
        return self

    def describe(self) -> str:
        hw = self.hardware
        return f"{hw.name}: {hw.describe_roofline(self.model.name, self.tensor_parallel_size)}"

    def with_lora(self, lora: LoRACost | None) -> CostModel:
        """A copy with the LoRA terms ``lora`` (``None``: without)."""
        return dataclasses.replace(self, lora=lora)

    def lora_load_time(self, loads: Sequence[tuple[str, int]]) -> float:
        """Seconds to copy a step's ``lora_loads`` host-to-device (0 without LoRA)."""
        if self.lora is None or not loads:
            return 0.0
        return self.lora.load_bytes(loads) / self.hardware.pcie_bandwidth

    def block_bytes(self, block_size: int | None = None) -> int:
        """Bytes of one KV block on one GPU (K and V of all layers, or of the layers a hybrid
        layout's block spans)."""
        if self.kv_block_bytes is not None and block_size in (None, self.block_size):
            return self.kv_block_bytes
        return (block_size or self.block_size) * self.kv_bytes_per_token_per_gpu

    def step_time(self, out: SchedulerOutput) -> float:
        """Seconds for one engine step (swaps, copies, adapter loads, then the forward pass). O(1)
        without LoRA (O(scheduled) with it); equals ``breakdown(out).total_s``, without building it
        when there is no LoRA (this runs once per simulated step)."""
        tokens = out.total_num_scheduled_tokens
        if (tokens == 0 or out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy
                or self.lora is not None or self._experts is not None or self._window is not None):
            return self.breakdown(out).total_s
        # ``_work``, ``_kv_tokens_read``, ``_allreduce_s`` and ``_overhead_s`` inlined, with the
        # same float operations in the same order (results are bit-identical to ``breakdown``).
        # ``b if b > a else a`` is ``max(a, b)`` (and ``b if b < a else a`` is ``min``) without
        # the builtin's keyword parsing, a good part of this function's cost.
        seqs = out.num_prefill_seqs + out.num_decode_seqs
        linear_flops = self._flops_per_token * tokens + self._flops_per_seq * seqs
        attention_flops = self._flops_per_context * out.sum_context_tokens
        decode, longest = out.sum_decode_context_tokens, out.num_decode_seqs * self._max_context
        decode = longest if longest < decode else decode
        prefill_tokens, chunks = out.num_prefill_tokens, out.num_prefill_seqs
        kv_read: float
        if prefill_tokens == 0 or chunks == 0:
            kv_read = decode
        else:
            prefill_context = max(0, out.sum_context_tokens - decode)
            kv_read = decode + prefill_context * chunks / prefill_tokens + (prefill_tokens - chunks) / 2
        s_per_flop, s_per_byte = self._s_per_flop, self._s_per_byte
        compute_s, memory_s = linear_flops * s_per_flop, self._weight_bytes * s_per_byte
        linear_s = memory_s if memory_s > compute_s else compute_s
        compute_s, memory_s = attention_flops * s_per_flop, self._kv_bytes * (kv_read + tokens) * s_per_byte
        attention_s = memory_s if memory_s > compute_s else compute_s
        return (linear_s + attention_s
                + (self._allreduce_s_per_token * tokens + self._allreduce_latency_s)
                + (self._fixed_s + self._per_seq_s * seqs))

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        """The end times of a decode run's steps from ``now`` (``core.decode_run``: ``out``
        holds the first step; each later step's contexts are one token longer, as
        ``DecodeRun.next_step`` moves them), as long as a step ends before ``horizon`` and
        exactly where SimPy would put it (``base + (end - base) == end``), at most
        ``max_steps``: the engine loop's ``now + step_time(run.out)`` step by step, with the
        terms that stay fixed over the run computed once and the same float operations in the
        same order (``tests/simulator/test_cost_model.py`` compares the two). None where ``step_time``
        would not take its inlined path, or for a step that is not decode-only; ``out`` is left
        as it is. A subclass that changes ``step_time`` must change this too."""
        tokens = n = out.num_decode_seqs
        if (tokens == 0 or out.total_num_scheduled_tokens != n or out.num_prefill_seqs
                or out.num_prefill_tokens or out.blocks_to_swap_out or out.blocks_to_swap_in
                or out.blocks_to_copy or self.lora is not None or self._experts is not None
                or self._window is not None):
            return None
        seqs = n
        s_per_flop, s_per_byte = self._s_per_flop, self._s_per_byte
        compute_s = (self._flops_per_token * tokens + self._flops_per_seq * seqs) * s_per_flop
        memory_s = self._weight_bytes * s_per_byte
        linear_s = memory_s if memory_s > compute_s else compute_s
        allreduce_s = self._allreduce_s_per_token * tokens + self._allreduce_latency_s
        overhead_s = self._fixed_s + self._per_seq_s * seqs
        per_context, kv_bytes = self._flops_per_context, self._kv_bytes
        context, decode, longest = (out.sum_context_tokens, out.sum_decode_context_tokens,
                                    n * self._max_context)
        ends: list[float] = []
        append = ends.append
        for _ in range(max_steps):
            kv_read = longest if longest < decode else decode
            compute_s = per_context * context * s_per_flop
            memory_s = kv_bytes * (kv_read + tokens) * s_per_byte
            attention_s = memory_s if memory_s > compute_s else compute_s
            end = now + (linear_s + attention_s + allreduce_s + overhead_s)
            if end >= horizon or base + (end - base) != end:
                break
            append(end)
            now = end
            context += n
            decode += n
        return ends

    def breakdown(self, out: SchedulerOutput) -> StepCost:
        """``step_time`` term by term (for reports and tests). ``flops``, ``nbytes``,
        ``compute_s`` and ``memory_s`` are the base model's; the LoRA terms are ``lora_s`` and
        ``lora_load_s``."""
        tokens = out.total_num_scheduled_tokens
        swap_s = self.copy_time(out)
        if tokens == 0:
            overhead = self.hardware.step_overhead_s if swap_s > 0 else 0.0
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, swap_s, overhead, swap_s + overhead)
        seqs = out.num_prefill_seqs + out.num_decode_seqs
        linear_flops, attention_flops, kv_bytes = self._work(out, tokens, seqs)
        weight_bytes = (self._weight_bytes if self._experts is None  # MoE: the experts touched
                        else self._experts.step_bytes(tokens))
        linear_s = max(linear_flops * self._s_per_flop, weight_bytes * self._s_per_byte)
        attention_s = max(attention_flops * self._s_per_flop, kv_bytes * self._s_per_byte)
        allreduce_s, overhead_s = self._allreduce_s(tokens), self._overhead_s(seqs)
        flops, nbytes = linear_flops + attention_flops, weight_bytes + kv_bytes
        total = linear_s + attention_s + allreduce_s + swap_s + overhead_s
        lora_s = load_s = 0.0
        if self.lora is not None:
            work = self.lora.work(out)
            lora_s, load_s = self.lora.forward_time(work), self.lora.load_time(work)
            total += lora_s + load_s
        return StepCost(flops, nbytes, flops * self._s_per_flop, nbytes * self._s_per_byte,
                        linear_s, attention_s, allreduce_s, swap_s, overhead_s, total, lora_s,
                        load_s)

    def _work(self, out: SchedulerOutput, tokens: int, seqs: int) -> tuple[float, float, float]:
        """Per-GPU GEMM FLOPs, attention FLOPs and KV bytes (read + written) of the forward pass."""
        linear_flops = self._flops_per_token * tokens + self._flops_per_seq * seqs
        window = self._window
        if window is None:
            attention_flops = self._flops_per_context * out.sum_context_tokens
            return linear_flops, attention_flops, self._kv_bytes * (self._kv_tokens_read(out) + tokens)
        attention_flops = self._flops_per_context * window.context_tokens(out)
        kv_read = window.kv_read(out, self._kv_tokens_read(out))
        return linear_flops, attention_flops, self._kv_bytes * (kv_read + tokens)

    def _allreduce_s(self, tokens: int) -> float:
        """Two ring all-reduces of the hidden states per layer (zero without tensor parallelism)."""
        return self._allreduce_s_per_token * tokens + self._allreduce_latency_s

    def _overhead_s(self, seqs: int) -> float:
        """Per-step and per-layer fixed costs plus per-sequence CPU work."""
        return self._fixed_s + self.hardware.per_seq_overhead_s * seqs

    def _kv_tokens_read(self, out: SchedulerOutput) -> float:
        """KV positions read: each decode its context; each prefill chunk its prefix and itself.

        For k prefill chunks of n tokens after s cached ones, the prefill context is
        ``k * (n * s + n * (n + 1) / 2)``, so ``k * (s + n) = ctx * k / P + (P - k) / 2``.
        """
        decode = decode_context_tokens(out, self.model.max_position_embeddings)
        prefill_tokens, chunks = out.num_prefill_tokens, out.num_prefill_seqs
        if prefill_tokens == 0 or chunks == 0:
            return decode
        prefill_context = max(0, out.sum_context_tokens - decode)
        return decode + prefill_context * chunks / prefill_tokens + (prefill_tokens - chunks) / 2

    def copy_time(self, out: SchedulerOutput) -> float:
        """Swap-outs and swap-ins over PCIe plus copy-on-write block copies on the device."""
        swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        copied = len(out.blocks_to_copy)
        if not swapped and not copied:
            return 0.0
        device_copy = 2 * copied * self.block_bytes() * self._s_per_byte  # read + write on the device
        return self.swap_time(swapped) + device_copy

    def swap_time(self, num_blocks: int, block_size: int | None = None) -> float:
        """Seconds to move ``num_blocks`` KV blocks between host and device over PCIe (per GPU)."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}.")
        return num_blocks * self.block_bytes(block_size) / self.hardware.pcie_bandwidth

    def activation_reserve_bytes(self, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256) -> int:
        """Peak non-KV memory of a profiling forward pass of ``max_num_batched_tokens`` (as vLLM
        measures it): hidden states, qkv and MLP activations per token, fp32 logits per sequence, plus
        a fixed 512 MiB for the CUDA context, library workspaces and CUDA graphs."""
        m, tp = self.model, self.tensor_parallel_size
        per_token = m.arch.activation_elements_per_token(m, tp)
        logits = max_num_seqs * m.vocab_size / tp * 4
        return int(max_num_batched_tokens * per_token * m.dtype_bytes + logits) + _NON_TORCH_RESERVE_BYTES

    def num_gpu_blocks(self, gpu_memory_utilization: float, block_size: int | None = None,
                       activation_reserve_bytes: int | None = None) -> int:
        """KV blocks per GPU: ``(capacity * utilization - weights / tp - reserve) // block_bytes``.

        ``activation_reserve_bytes`` defaults to ``activation_reserve_bytes()``. Raises ValueError
        when the weights and the reserve leave no room for one block.
        """
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}.")
        block_size = self.block_size if block_size is None else block_size
        _check_block_size(block_size)
        reserve = (self.activation_reserve_bytes() if activation_reserve_bytes is None
                   else activation_reserve_bytes)
        if reserve < 0:
            raise ValueError(f"activation_reserve_bytes must be >= 0, got {reserve}.")
        budget = self.hardware.mem_capacity * gpu_memory_utilization
        free = budget - self.weight_bytes_per_gpu - reserve
        blocks = int(free // self.block_bytes(block_size)) if free > 0 else 0
        if blocks < 1:
            raise ValueError(self._does_not_fit_message(gpu_memory_utilization, budget, reserve))
        return blocks

    def _does_not_fit_message(self, utilization: float, budget: float, reserve: int) -> str:
        gib = 2**30
        return (f"{self.model.name} does not fit on {self.hardware.name} with tensor_parallel_size="
                f"{self.tensor_parallel_size}: weights {self.weight_bytes_per_gpu / gib:.2f} GiB per GPU + "
                f"activation reserve {reserve / gib:.2f} GiB > gpu_memory_utilization {utilization} x "
                f"{self.hardware.mem_capacity / gib:.2f} GiB = {budget / gib:.2f} GiB, leaving no room for "
                f"a KV block of {self.block_bytes() / 2**20:.2f} MiB.")


def _check_block_size(block_size: object) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}.")


@dataclass(slots=True)
class FittedCostModel:
    """Step time from coefficients measured on the machine (``params``); memory sizing and swap
    copies from the roofline ``base`` for the same model, hardware and TP size."""

    params: FittedParams
    base: CostModel
    _intercept: float = field(init=False, repr=False)
    _coefficients: tuple[float, ...] = field(init=False, repr=False)
    _token_curve: tuple[tuple[float, float], ...] = field(init=False, repr=False)
    _token_jumps: tuple[float, ...] = field(init=False, repr=False)
    # fitted LoRA coefficients (LORA_FEATURE_NAMES order) of the forward terms and of the loads;
    # None: the roofline's LoRA terms
    _lora_forward: tuple[float, ...] | None = field(init=False, repr=False)
    _lora_load: float | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.params.coefficients) - KNOWN_FEATURES)
        if unknown:
            raise ValueError(f"fitted coefficients name unknown feature(s) {', '.join(unknown)}; "
                             f"known: {', '.join((*ALL_FEATURE_NAMES, *LORA_FEATURE_NAMES))}.")
        if not self.params.matches(self.base.model.name, self.base.tensor_parallel_size):
            raise ValueError(f"params were fitted for model {self.params.model!r} at tensor_parallel_size="
                             f"{self.params.tensor_parallel_size}, not {self.base.model.name!r} at "
                             f"{self.base.tensor_parallel_size}.")
        self._intercept = self.params.intercept_s
        coefficients = [self.params.coefficients.get(f, 0.0) for f in FEATURE_NAMES]
        self._coefficients = (*coefficients[:_NUM_LINEAR],
                              *(self.params.coefficients.get(f, 0.0)
                                for f in KERNEL_FEATURE_NAMES[:_NUM_KERNEL_LINEAR]))
        # the segments' sum at each knot and the slope after it: a lookup instead of 11 products
        slopes = coefficients[_NUM_LINEAR:]
        values = [0.0]
        for lo, hi, slope in zip(TOKEN_KNOTS, TOKEN_KNOTS[1:], slopes):
            values.append(values[-1] + slope * (hi - lo))
        self._token_curve = tuple(zip(values, slopes))
        # the jumps' sum at each count up to the last knot (a count above it has them all)
        jumps = [0.0] * (TOKEN_STEP_KNOTS[-1] + 1)
        for k, name in zip(TOKEN_STEP_KNOTS, TOKEN_STEP_NAMES):
            jumps[k] = self.params.coefficients.get(name, 0.0)
        for n in range(1, len(jumps)):
            jumps[n] += jumps[n - 1]
        self._token_jumps = tuple(jumps)
        fitted = self.params.coefficients
        forward_names = LORA_FEATURE_NAMES[:-1]
        self._lora_forward = (tuple(fitted.get(f, 0.0) for f in forward_names)
                              if any(f in fitted for f in forward_names) else None)
        self._lora_load = fitted.get(LORA_FEATURE_NAMES[-1])

    @property
    def model(self) -> ModelConfig:
        return self.base.model

    @property
    def hardware(self) -> HardwareProfile:
        return self.base.hardware

    @property
    def tensor_parallel_size(self) -> int:
        return self.base.tensor_parallel_size

    @property
    def roofline(self) -> CostModel:
        return self.base

    def describe(self) -> str:
        return f"{self.hardware.name}: {self.params.describe()}"

    def step_time(self, out: SchedulerOutput) -> float:
        """The fitted forward pass plus the roofline's swap and copy time. O(1); equals
        ``step_time_reference`` bit for bit (the same products summed in the same order,
        inlined: this runs once per simulated step)."""
        tokens = out.total_num_scheduled_tokens
        if (tokens == 0 or out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy
                or self.base.lora is not None):
            return self.step_time_reference(out)
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = self._coefficients
        decodes, longest, prefills = out.num_decode_seqs, out.max_decode_context, out.num_prefill_seqs
        linear: float = 0
        linear += c0 * tokens
        linear += c1 * out.num_prefill_tokens
        linear += c2 * prefills
        linear += c3 * decodes
        linear += c4 * out.sum_context_tokens
        linear += c5 * out.sum_decode_context_tokens
        linear += c6 * (decodes * longest)
        linear += c7 * longest
        linear += c8 * out.num_prefix_chunks
        linear += c9 * out.sum_prefix_context_tokens
        linear += c10 * out.sum_prefill_attention_area
        linear += c11 * (prefills > 0)
        return self._intercept + linear + self._token_time(tokens)

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        """The end times of a decode run's steps from ``now``, as ``CostModel.decode_run_ends``
        states: ``step_time``'s sum with the run's fixed terms computed once and the others in
        the same order (``tests/simulator/test_cost_model.py`` compares the two). None for a
        step that is not decode-only or one ``step_time`` would not take its inlined path."""
        n = out.num_decode_seqs
        if (n == 0 or out.total_num_scheduled_tokens != n or out.num_prefill_seqs
                or out.num_prefill_tokens or out.num_prefix_chunks or out.sum_prefix_context_tokens
                or out.sum_prefill_attention_area or out.blocks_to_swap_out
                or out.blocks_to_swap_in or out.blocks_to_copy or self.base.lora is not None):
            return None
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = self._coefficients
        head: float = 0  # the terms that stay fixed over the run, summed as step_time sums them
        head += c0 * n
        head += c1 * 0
        head += c2 * 0
        head += c3 * n
        tail8, tail9, tail10, tail11 = c8 * 0, c9 * 0, c10 * 0, c11 * False
        intercept, token_time = self._intercept, self._token_time(n)
        context, decode, longest = (out.sum_context_tokens, out.sum_decode_context_tokens,
                                    out.max_decode_context)
        ends: list[float] = []
        for _ in range(max_steps):
            linear = head
            linear += c4 * context
            linear += c5 * decode
            linear += c6 * (n * longest)
            linear += c7 * longest
            linear += tail8
            linear += tail9
            linear += tail10
            linear += tail11
            end = now + (intercept + linear + token_time)
            if end >= horizon or base + (end - base) != end:
                break
            ends.append(end)
            now = end
            context += n
            decode += n
            longest += 1
        return ends

    def step_time_reference(self, out: SchedulerOutput) -> float:
        """The plain version of ``step_time``."""
        if out.total_num_scheduled_tokens == 0:
            return self.base.breakdown(out).total_s  # swaps only (or nothing): no forward pass
        x = _feature_vector(out, None)  # as ``step_features(out)`` recorded them
        seconds = (self._intercept + sum(c * v for c, v in zip(self._coefficients, x))
                   + self._token_time(out.total_num_scheduled_tokens) + self.base.copy_time(out))
        lora = self.base.lora
        return seconds if lora is None else seconds + self.lora_time(lora.work(out))

    def lora_time(self, work: LoRAWork) -> float:
        """The LoRA terms of a step: fitted where the fit holds them, else the roofline's."""
        lora = self.base.lora
        if lora is None:
            return 0.0
        if self._lora_forward is None:
            forward = lora.forward_time(work)
        else:
            features = lora_step_features(work)
            forward = sum(c * features.get(f, 0.0)
                          for c, f in zip(self._lora_forward, LORA_FEATURE_NAMES))
        load = (lora.load_time(work) if self._lora_load is None
                else self._lora_load * work.load_bytes)
        return forward + load

    def with_lora(self, lora: LoRACost | None) -> FittedCostModel:
        return FittedCostModel(self.params, self.base.with_lora(lora))

    def lora_load_time(self, loads: Sequence[tuple[str, int]]) -> float:
        lora = self.base.lora
        if self._lora_load is None or lora is None or not loads:
            return self.base.lora_load_time(loads)
        return self._lora_load * lora.load_bytes(loads)

    def _token_time(self, num_tokens: int) -> float:
        """``sum(c_j * token_segments(num_tokens)[j])``, from the knot at or below the count,
        plus the jumps of ``token_steps(num_tokens)``."""
        j = bisect.bisect_right(TOKEN_KNOTS, num_tokens) - 1
        value, slope = self._token_curve[j]
        jumps = self._token_jumps
        return value + slope * (num_tokens - TOKEN_KNOTS[j]) + jumps[min(num_tokens,
                                                                          len(jumps) - 1)]

    def swap_time(self, num_blocks: int, block_size: int | None = None) -> float:
        return self.base.swap_time(num_blocks, block_size)

    def num_gpu_blocks(self, gpu_memory_utilization: float, block_size: int | None = None,
                       activation_reserve_bytes: int | None = None) -> int:
        return self.base.num_gpu_blocks(gpu_memory_utilization, block_size, activation_reserve_bytes)

    @classmethod
    def fit(cls, samples: Sequence[tuple[dict[str, float], float]], base: CostModel) -> FittedCostModel:
        """Fit on ``(step_features(out), measured seconds)`` pairs, labelled with ``base``'s model and TP."""
        params = fit_step_time(samples, base.model.name, base.tensor_parallel_size)
        return cls(params, base)


def make_cost_model(model: ModelConfig, hardware: HardwareProfile, tensor_parallel_size: int = 1,
                    block_size: int = DEFAULT_BLOCK_SIZE, lora: LoRACost | None = None,
                    kv_block_bytes: int | None = None) -> DeviceCostModel:
    """The fitted model when ``hardware`` holds a fit for this model and TP size, else the roofline."""
    base = CostModel(model, hardware, tensor_parallel_size, block_size, lora, kv_block_bytes)
    params = hardware.find_fitted(model.name, tensor_parallel_size)
    return FittedCostModel(params, base) if params is not None else base


def fit_step_time(samples: Sequence[tuple[dict[str, float], float]], model: str | None = None,
                  tensor_parallel_size: int = 1, kernel: bool = False) -> FittedParams:
    """Non-negative least squares of seconds on ``[1, *fit_feature_names(samples, kernel)]``.

    Each sample is ``(features, seconds)``; a feature missing from the dict counts as 0, an unknown
    one raises ValueError. ``model`` ``None`` labels the fit as valid for any model.
    """
    if not samples:
        raise ValueError("samples must hold at least one (features, seconds) pair.")
    names = fit_feature_names((f for f, _ in samples), kernel)
    x = np.ones((len(samples), len(names) + 1))
    y = np.empty(len(samples))
    for i, (features, seconds) in enumerate(samples):
        x[i, 1:] = _sample_row(features, i, names)
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"samples[{i}] seconds must be finite and >= 0, got {seconds!r}.")
        y[i] = seconds
    coef = nnls(x, y)
    rmse = float(np.sqrt(np.mean((x @ coef - y) ** 2)))
    return FittedParams(float(coef[0]), dict(zip(names, map(float, coef[1:]))), model,
                        tensor_parallel_size, len(samples), rmse)


def fit_feature_names(features: Iterable[dict[str, float]], kernel: bool = False) -> tuple[str, ...]:
    """``FEATURE_NAMES`` (with ``kernel``: ``ALL_FEATURE_NAMES``, the backend's kernel terms
    too), plus ``LORA_FEATURE_NAMES`` when a sample carries any of them (LoRA steps measured on
    the real engine): a fit without them keeps the roofline's LoRA terms."""
    base = ALL_FEATURE_NAMES if kernel else FEATURE_NAMES
    lora = set(LORA_FEATURE_NAMES)
    if any(lora.intersection(f) for f in features):
        return (*base, *LORA_FEATURE_NAMES)
    return base


def _sample_row(features: dict[str, float], index: int,
                names: Sequence[str] = FEATURE_NAMES) -> list[float]:
    unknown = sorted(set(features) - KNOWN_FEATURES)
    if unknown:
        raise ValueError(f"samples[{index}] has unknown feature(s) {', '.join(unknown)}; "
                         f"known: {', '.join((*ALL_FEATURE_NAMES, *LORA_FEATURE_NAMES))}.")
    return [float(features.get(name, 0.0)) for name in names]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin ||a x - b||`` subject to ``x >= 0`` (scipy's Lawson-Hanson solver).

    Columns are scaled to unit norm first so that features of very different magnitudes
    (tokens vs. context sums) share one tolerance; all-zero columns get coefficient 0.
    """
    norms = np.linalg.norm(a, axis=0)
    live = norms > 0
    solution = np.zeros(a.shape[1])
    import scipy.optimize  # only fitting needs it (~0.5 s to import): not every simulation
    solution[live] = scipy.optimize.nnls(a[:, live] / norms[live], b)[0] / norms[live]
    return solution
