"""GPU step times from Vidur's public operator profiles, and the fitted profiles built on them.

Vidur (microsoft/vidur, MIT) measured every operator of a decoder layer on real GPUs: the GEMMs,
norms, rope, activation and residual add per token count (``mlp.csv``) and paged attention per
prefill chunk / decode batch and KV length (``attention.csv``). Its simulator times a step as the
sum of its operators over the layers (``ExecutionTime.model_time``); embedding, ``lm_head``,
sampling and CPU overheads are not counted (``skip_cpu_overhead_modeling`` is its default).
``simulator/data/profiles/vidur/`` holds the part of those measurements used here (see
``PROVENANCE.md`` there) and this module composes them the way Vidur does::

    step_ms = L * ( ops(T_rounded)                            # mlp.csv, T = scheduled tokens
                    + kv_cache_save(T)                        # attention.csv
                    + decode_attention(b, kv) * (1.1 if b > 1)   # mean decode KV length
                    + prefill_attention(chunk, kv) )          # one chunk per step here

where Vidur rounds T up to a multiple of 8 and adds its default 10% decode batching overhead.
Where attention was not measured (every H100 dataset: its ``attention.csv`` files are Git LFS
objects no snapshot holds; and every TP > 1, the kept attention rows being TP 1), a step is
``RooflineAttentionStep``: the measured token-wise operators at that TP size, two measured
all-reduces of ``T * hidden * 2`` bytes per layer plus Vidur's 0.02 ms NCCL launch overhead each
(``vidur_network``), and the roofline's attention term, over a grid of decodes, chunks and mixed
steps (``grid_steps``) kept within the measured token counts and all-reduce sizes. Each fit's
``source`` says which operators it rests on.
``operator_samples`` turns each measured point (and decode + prefill pairs of them) into a
``StepSample`` with the aggregates the scheduler would report for that step (points past the
model's context length, which never occur, are left out); ``fit_dataset`` fits
the cost model's ``FittedParams`` on them (relative NNLS, ``calibration.fit``), and
``write_profiles`` stores the fits in the bundled hardware profiles, with each profile's link
terms fitted to its node's all-reduce (``PROFILE_NETWORKS``), so the simulator needs
neither this data nor scipy at run time. Regenerate with
``python -m twinserve.simulator.vidur_profiles --write``; report with
``python -m twinserve.benchmarks.gpu_profiles``.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from twinserve.core.outputs import AGGREGATE_FIELDS
from twinserve.core.step_sample import StepSample
from twinserve.simulator.calibration import fit, fit_errors, output_of
from twinserve.simulator.cost_model import CostModel
from twinserve.simulator.hardware import FittedParams, HardwareProfile, load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.vidur_network import (
    SIZE_BANDS,
    AllReduceFit,
    AllReduceTable,
    band_label,
    fit_all_reduce,
    load_all_reduce,
    size_band,
)

VIDUR_DIR = Path(__file__).parent / "data" / "profiles" / "vidur"
HARDWARE_DIR = Path(__file__).parent / "data" / "hardware"
VIDUR_COMMIT = "7d47513363ec447a741ac5e47241580b47724fbf"
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
DECODE_BATCHING_OVERHEAD = 0.1  # Vidur's attention_decode_batching_overhead_fraction default
TOKEN_ROUNDING = 8  # Vidur's _total_num_tokens_rounded
BATCH_BUCKETS = ((1, 1), (2, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1024))


@dataclass(slots=True, frozen=True)
class VidurDataset:
    """One SKU x model of Vidur's profiles: its files here and the twinserve names it serves
    (``models``: spec names with the very layer shapes measured). ``attention_file`` "" means no
    attention profile: attention is then the roofline's; the one kept is at TP 1 only, so every
    TP > 1 fit has roofline attention too. ``network``: the all-reduce data of TP > 1."""

    sku: str
    vidur_model: str
    models: tuple[str, ...]
    hardware: str
    num_layers: int
    mlp_file: str
    attention_file: str
    max_context: int  # the model's context length: points past it never occur and are left out
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    network: str = ""

    def __post_init__(self) -> None:
        if any(tp > 1 for tp in self.tensor_parallel_sizes) and not self.network:
            raise ValueError(f"{self.sku}/{self.vidur_model}: TP > 1 needs a network.")

    def measured_attention(self, tensor_parallel_size: int) -> bool:
        return bool(self.attention_file) and tensor_parallel_size == 1

    def source(self, tensor_parallel_size: int = 1) -> str:
        """What a fit at this TP size rests on: which operators are measured, which roofline."""
        where = f"microsoft/vidur@{VIDUR_COMMIT[:7]}, data/profiling/compute/{self.sku}/{self.vidur_model}/"
        if self.measured_attention(tensor_parallel_size):
            return f"vidur:{self.sku}/{self.vidur_model} ({where}mlp.csv + attention.csv)"
        network = (f", all-reduce measured (network/{self.network}/all_reduce.csv)"
                   if tensor_parallel_size > 1 else "")
        why = "no attention profile at TP > 1" if self.attention_file else "no attention profile"
        return (f"vidur:{self.sku}/{self.vidur_model} at TP {tensor_parallel_size}: linear operators "
                f"measured (mlp.csv: norms, QKV/O projections, rope, MLP, residual add){network}; "
                f"attention and KV-cache writes on the roofline ({why}) ({where}mlp.csv)")


DATASETS: tuple[VidurDataset, ...] = (
    VidurDataset("a100", "meta-llama/Meta-Llama-3-8B", ("llama-3-8b", "llama-3.1-8b"), "a100-80gb",
                 32, "a100_meta-llama-3-8b_mlp.csv", "a100_meta-llama-3-8b_attention_subset.csv",
                 8192, (1, 2, 4, 8), "a100_dgx"),
    VidurDataset("a100", "meta-llama/Llama-2-70b-hf", ("llama-2-70b",), "a100-80gb", 80,
                 "a100_llama-2-70b-hf_mlp.csv", "", 4096, (2, 4, 8), "a100_dgx"),
    VidurDataset("a100", "meta-llama/Meta-Llama-3-70B", ("llama-3-70b", "llama-3.1-70b"),
                 "a100-80gb", 80, "a100_meta-llama-3-70b_mlp.csv", "", 8192, (2, 4, 8), "a100_dgx"),
    VidurDataset("h100", "meta-llama/Llama-2-7b-hf", ("llama-2-7b",), "h100-sxm", 32,
                 "h100_llama-2-7b-hf_mlp.csv", "", 4096, (1, 2, 4, 8), "h100_dgx"),
    VidurDataset("h100", "meta-llama/Llama-2-70b-hf", ("llama-2-70b",), "h100-sxm", 80,
                 "h100_llama-2-70b-hf_mlp.csv", "", 4096, (2, 4, 8), "h100_dgx"),
)
# The interconnect each bundled profile's link terms are fitted to (its SXM boards sit on
# NVSwitch, Vidur's "dgx" nodes); the pairwise-NVLink data is kept and reported beside.
PROFILE_NETWORKS = {"a100-80gb": "a100_dgx", "h100-sxm": "h100_dgx"}
NETWORKS = ("a100_dgx", "a100_pairwise_nvlink", "h100_dgx", "h100_pairwise_nvlink")
NCCL_LAUNCH_MS = 0.02  # Vidur's nccl_cpu_launch_overhead_ms, added to each all-reduce


# ---- the measurements ------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class MlpTable:
    """Per-layer milliseconds of the token-wise operators (``LAYER_OPS`` summed) by token count,
    at one tensor-parallel size; linear between measured counts (they are 8 to 512 apart)."""

    tokens: tuple[int, ...]
    layer_ms: tuple[float, ...]

    def at(self, num_tokens: int) -> float:
        if not self.tokens[0] <= num_tokens <= self.tokens[-1]:
            raise ValueError(f"num_tokens {num_tokens} outside the measured "
                             f"{self.tokens[0]}..{self.tokens[-1]}.")
        j = bisect.bisect_left(self.tokens, num_tokens)
        if self.tokens[j] == num_tokens:
            return self.layer_ms[j]
        (t0, t1), (y0, y1) = self.tokens[j - 1:j + 1], self.layer_ms[j - 1:j + 1]
        return y0 + (y1 - y0) * (num_tokens - t0) / (t1 - t0)


@dataclass(slots=True, frozen=True)
class AttentionPoint:
    """One measured attention row: milliseconds of the KV-cache write and of the kernel."""

    kv_save_ms: float
    attention_ms: float


@dataclass(slots=True)
class AttentionTable:
    """Measured prefill points keyed ``(chunk, kv)`` and decode points keyed ``(batch, kv)``."""

    prefill: dict[tuple[int, int], AttentionPoint] = field(default_factory=dict)
    decode: dict[tuple[int, int], AttentionPoint] = field(default_factory=dict)


def load_mlp(path: Path, tensor_parallel_size: int = 1) -> MlpTable:
    rows = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if int(r["num_tensor_parallel_workers"]) == tensor_parallel_size:
                rows.append((int(r["num_tokens"]), sum(float(r[f"{op}_ms"]) for op in LAYER_OPS)))
    if not rows:
        raise ValueError(f"{path} has no rows at tensor_parallel_size={tensor_parallel_size}.")
    rows.sort()
    return MlpTable(tuple(t for t, _ in rows), tuple(y for _, y in rows))


def load_attention(path: Path) -> AttentionTable:
    table = AttentionTable()
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            kv, save = int(r["kv_cache_size"]), float(r["attn_kv_cache_save_ms"])
            if r["is_prefill"] == "True":
                key = (int(r["prefill_chunk_size"]), kv)
                table.prefill[key] = AttentionPoint(save, float(r["attn_prefill_ms"]))
            else:
                table.decode[(int(r["batch_size"]), kv)] = AttentionPoint(save, float(r["attn_decode_ms"]))
    return table


# ---- a step as Vidur times it ----------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class OperatorStep:
    """A step made of measured points: ``decode`` = (batch, kv) or None; ``prefill`` = (chunk,
    kv) or None. ``kv`` is the tokens already in the cache (Vidur's ``kv_cache_size``)."""

    decode: tuple[int, int] | None = None
    prefill: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return (self.decode[0] if self.decode else 0) + (self.prefill[0] if self.prefill else 0)

    @property
    def num_seqs(self) -> int:
        return (self.decode[0] if self.decode else 0) + (1 if self.prefill else 0)

    @property
    def kind(self) -> str:
        if self.decode and self.prefill:
            return "mixed"
        return "decode" if self.decode else "prefill"

    def aggregates(self) -> dict[str, int]:
        """The scheduler's aggregate fields of this step (``core.outputs.AGGREGATE_FIELDS``):
        each decode attends to its kv + 1 positions; a chunk of c after kv to kv + 1 .. kv + c."""
        agg = dict.fromkeys(AGGREGATE_FIELDS, 0)
        if self.decode:
            b, kv = self.decode
            agg.update(num_decode_tokens=b, num_decode_seqs=b, sum_decode_context_tokens=b * (kv + 1),
                       max_decode_context=kv + 1)
            agg["sum_context_tokens"] += b * (kv + 1)
        if self.prefill:
            c, kv = self.prefill
            agg.update(num_prefill_tokens=c, num_prefill_seqs=1)
            agg["sum_context_tokens"] += c * kv + c * (c + 1) // 2
            agg["num_prefix_chunks"] = int(kv > 0)
            agg["sum_prefix_context_tokens"] = kv
            agg["sum_prefill_attention_area"] = c * (kv + c)
        agg["total_num_scheduled_tokens"] = self.num_tokens
        return agg


def rounded_tokens(tokens: int) -> int:
    """Vidur's ``_total_num_tokens_rounded``: up to a multiple of 8 past 4 tokens."""
    return -(-tokens // TOKEN_ROUNDING) * TOKEN_ROUNDING if tokens > 4 else tokens


def vidur_step_seconds(step: OperatorStep, mlp: MlpTable, attention: AttentionTable,
                       num_layers: int) -> float:
    """Vidur's model time of ``step`` from the measurements (see the module docstring). Raises
    KeyError when an attention point of the step was not measured."""
    layer_ms = mlp.at(rounded_tokens(step.num_tokens))
    save = 0.0
    if step.decode:
        point = attention.decode[step.decode]
        overhead = 1 + DECODE_BATCHING_OVERHEAD * (step.decode[0] > 1)
        layer_ms += point.attention_ms * overhead
        save = point.kv_save_ms
    if step.prefill:
        point = attention.prefill[step.prefill]
        layer_ms += point.attention_ms
        save = max(save, point.kv_save_ms)  # the chunk's write dominates a mixed step's
    return num_layers * (layer_ms + save) * 1e-3


def operator_steps(attention: AttentionTable, max_context: int, mixed_decodes: int = 6,
                   mixed_prefills: int = 6) -> list[OperatorStep]:
    """Every measured point within ``max_context`` positions as a step, plus decode + prefill
    pairs spread over them."""
    decodes = sorted(d for d in attention.decode if d[1] + 1 <= max_context)
    prefills = sorted(p for p in attention.prefill if p[0] + p[1] <= max_context)
    steps = [OperatorStep(decode=d) for d in decodes] + [OperatorStep(prefill=p) for p in prefills]
    some_d = decodes[:: max(1, len(decodes) // mixed_decodes)]
    some_p = [p for p in prefills if p[0] <= 1024][:: max(1, len(prefills) // mixed_prefills // 2)]
    steps += [OperatorStep(decode=d, prefill=p) for d in some_d for p in some_p]
    return steps


@dataclass(slots=True, frozen=True)
class RooflineAttentionStep:
    """How a step is timed where attention was not measured: the measured token-wise operators
    and all-reduces (two per layer at TP > 1, as Vidur's ``ExecutionTime``) plus the roofline's
    attention term (``CostModel.breakdown(out).attention_s``: the kernel and the KV writes)."""

    mlp: MlpTable
    roofline: CostModel
    all_reduce: AllReduceTable | None

    def max_tokens(self) -> int:
        """The most tokens a step may hold with every operator within its measurements."""
        most = self.mlp.tokens[-1]
        if self.all_reduce is not None:
            bytes_per_token = self.roofline.model.hidden_size * 2  # Vidur: 2 * h bytes a token
            most = min(most, self.all_reduce.max_size(self.roofline.tensor_parallel_size)
                       // bytes_per_token // TOKEN_ROUNDING * TOKEN_ROUNDING)
        return most

    def seconds(self, step: OperatorStep) -> float:
        tokens = rounded_tokens(step.num_tokens)
        layer_ms = self.mlp.at(tokens)
        if self.all_reduce is not None:
            nbytes = tokens * self.roofline.model.hidden_size * 2
            tp = self.roofline.tensor_parallel_size
            layer_ms += 2 * (self.all_reduce.at_ms(tp, nbytes) + NCCL_LAUNCH_MS)
        attention_s = self.roofline.breakdown(output_of(step.aggregates())).attention_s
        return self.roofline.model.num_hidden_layers * layer_ms * 1e-3 + attention_s


GRID_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRID_DECODE_KV = (128, 512, 1024, 2048, 4000, 8000)
GRID_CHUNKS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
GRID_PREFILL_KV = (0, 512, 2048, 6000)


def grid_steps(max_context: int, max_tokens: int) -> list[OperatorStep]:
    """Decodes, prefill chunks and decode + chunk pairs over the step space, within the model's
    context and ``max_tokens`` (steps where attention is the roofline's: any point can be timed)."""
    decodes = [(b, kv) for b in GRID_DECODE_BATCHES for kv in GRID_DECODE_KV
               if kv + 1 <= max_context and b <= max_tokens]
    prefills = [(c, kv) for c in GRID_CHUNKS for kv in GRID_PREFILL_KV
                if c + kv <= max_context and c <= max_tokens]
    steps = [OperatorStep(decode=d) for d in decodes] + [OperatorStep(prefill=p) for p in prefills]
    steps += [OperatorStep(decode=(b, 1024), prefill=(c, 0)) for b in (8, 32, 128)
              for c in (64, 256, 512, 1024) if b + c <= max_tokens and c + 1024 <= max_context]
    return steps


@dataclass(slots=True)
class DatasetSamples:
    """The steps of one dataset at one TP size and their samples (Vidur's seconds), index for
    index."""

    dataset: VidurDataset
    steps: list[OperatorStep]
    samples: list[StepSample]
    tensor_parallel_size: int = 1


def operator_samples(ds: VidurDataset, tensor_parallel_size: int = 1) -> DatasetSamples:
    """Every step of the dataset at this TP size, timed from its measurements (``OperatorStep``
    composition where attention was measured, ``RooflineAttentionStep`` elsewhere)."""
    if tensor_parallel_size not in ds.tensor_parallel_sizes:
        raise ValueError(f"{ds.sku}/{ds.vidur_model} is fitted at TP "
                         f"{ds.tensor_parallel_sizes}, not {tensor_parallel_size}.")
    mlp = load_mlp(VIDUR_DIR / ds.mlp_file, tensor_parallel_size)
    if ds.measured_attention(tensor_parallel_size):
        attention = load_attention(VIDUR_DIR / ds.attention_file)
        steps = operator_steps(attention, ds.max_context)
        seconds = [vidur_step_seconds(s, mlp, attention, ds.num_layers) for s in steps]
    else:
        roofline = CostModel(load_model_spec(ds.models[0]), load_hardware(ds.hardware),
                             tensor_parallel_size)
        network = (load_all_reduce(VIDUR_DIR / f"{ds.network}_all_reduce.csv")
                   if tensor_parallel_size > 1 else None)
        timing = RooflineAttentionStep(mlp, roofline, network)
        steps = grid_steps(ds.max_context, timing.max_tokens())
        seconds = [timing.seconds(s) for s in steps]
    samples = [StepSample(s.aggregates(), y, kind=s.kind) for s, y in zip(steps, seconds)]
    return DatasetSamples(ds, steps, samples, tensor_parallel_size)


def all_samples(datasets: Sequence[VidurDataset] = DATASETS) -> list[DatasetSamples]:
    return [operator_samples(ds, tp) for ds in datasets for tp in ds.tensor_parallel_sizes]


# ---- the fit and its error -------------------------------------------------------------------
def fit_dataset(data: DatasetSamples, model: str) -> FittedParams:
    """``FittedParams`` for ``model`` at the data's TP size fitted on the dataset (relative
    error), carrying its source and its error by step kind."""
    tp = data.tensor_parallel_size
    params = fit(data.samples, model, tp, "relative")
    errors = {}
    for e in fit_errors(params, data.samples):  # the max rounded up: a bound the data keep
        errors[f"{e.kind}_mape"] = round(e.mape, 2)
        errors[f"{e.kind}_max"] = math.ceil(e.max_ape * 100) / 100
    return FittedParams(params.intercept_s, params.coefficients, model, tp, params.num_samples,
                        params.rmse_s, data.dataset.source(tp), errors)


def batch_bucket(num_seqs: int) -> str:
    for lo, hi in BATCH_BUCKETS:
        if lo <= num_seqs <= hi:
            return f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f">{BATCH_BUCKETS[-1][1]}"


@dataclass(slots=True, frozen=True)
class BucketError:
    kind: str
    bucket: str
    count: int
    mape: float
    max_ape: float


def errors_by_batch(params: FittedParams, data: DatasetSamples) -> list[BucketError]:
    """Fit error per step kind and batch-size bucket (sequences in the step)."""
    from twinserve.simulator.calibration import predict
    groups: dict[tuple[str, str], list[float]] = {}
    for step, sample in zip(data.steps, data.samples):
        ape = abs(predict(params, sample.aggregates) - sample.seconds) / sample.seconds
        groups.setdefault((step.kind, batch_bucket(step.num_seqs)), []).append(100 * ape)
    order = {b: i for i, b in enumerate(batch_bucket(lo) for lo, _ in BATCH_BUCKETS)}
    keys = sorted(groups, key=lambda k: (k[0], order.get(k[1], 99)))
    return [BucketError(k, b, len(groups[(k, b)]), sum(groups[(k, b)]) / len(groups[(k, b)]),
                        max(groups[(k, b)])) for k, b in keys]


# ---- the bundled profiles --------------------------------------------------------------------
def network_fit(network: str) -> tuple[AllReduceTable, AllReduceFit]:
    table = load_all_reduce(VIDUR_DIR / f"{network}_all_reduce.csv")
    return table, fit_all_reduce(table)


def with_interconnect(profile: HardwareProfile, network: str) -> HardwareProfile:
    """``profile`` with its link terms fitted to ``network``'s all-reduce, source and error."""
    table, ar = network_fit(network)
    workers = ", ".join(map(str, table.num_workers))
    source = (f"fitted to vidur:network/{network}/all_reduce.csv (microsoft/vidur@{VIDUR_COMMIT[:7]}; "
              f"{ar.num_points} points on {workers} GPUs of one node; latency + 2(n-1)/n * bytes / "
              f"bandwidth, fit error {ar.fit_error['all_mape']:.1f}% mean)")
    return replace(profile, interconnect_latency_s=ar.latency_s, interconnect_bandwidth=ar.bandwidth,
                   interconnect_source=source, interconnect_fit_error=ar.fit_error)


def write_profiles(datasets: Sequence[VidurDataset] = DATASETS,
                   hardware_dir: Path = HARDWARE_DIR) -> list[Path]:
    """Fits every dataset at each of its TP sizes and stores the fits in its bundled hardware
    profile (replacing a fit for the same model and TP size), with the profile's link terms
    fitted to its node's all-reduce (``PROFILE_NETWORKS``)."""
    profiles: dict[str, HardwareProfile] = {}
    for ds in datasets:
        profile = profiles.get(ds.hardware) or load_hardware(hardware_dir / f"{ds.hardware}.json")
        if ds.hardware in PROFILE_NETWORKS and ds.hardware not in profiles:
            profile = with_interconnect(profile, PROFILE_NETWORKS[ds.hardware])
        for tp in ds.tensor_parallel_sizes:
            data = operator_samples(ds, tp)
            for model in ds.models:
                profile = profile.with_fitted(fit_dataset(data, model))
        profiles[ds.hardware] = profile
    return [p.save(hardware_dir / f"{name}.json") for name, p in profiles.items()]


def format_fit(params: FittedParams, data: DatasetSamples) -> str:
    lines = [f"{data.dataset.hardware} / {params.model} / TP {data.tensor_parallel_size}: "
             f"{params.describe()}",
             f"  {'kind':<8} {'batch':>8} {'steps':>6} {'MAPE %':>8} {'max %':>8}"]
    for e in errors_by_batch(params, data):
        lines.append(f"  {e.kind:<8} {e.bucket:>8} {e.count:>6} {e.mape:>8.1f} {e.max_ape:>8.1f}")
    for kind in ("prefill", "decode", "mixed", "all"):
        if f"{kind}_mape" in params.fit_error:
            lines.append(f"  {kind:<8} {'all':>8} {'':>6} {params.fit_error[f'{kind}_mape']:>8.1f} "
                         f"{params.fit_error[f'{kind}_max']:>8.1f}")
    return "\n".join(lines)


def format_all_reduce(network: str) -> str:
    """The all-reduce fit of one node and its error per size band (and per GPU count)."""
    table, ar = network_fit(network)
    lines = [f"all-reduce {network}: latency {ar.latency_s * 1e6:.1f} us, bandwidth "
             f"{ar.bandwidth / 1e9:.1f} GB/s (ring 2(n-1)/n), {ar.num_points} points",
             f"  {'size band':<10} {'GPUs':>5} {'points':>7} {'MAPE %':>8} {'max %':>8}"]
    groups: dict[tuple[str, str], list[float]] = {}
    for n, size, ms in table.rows():
        ape = 100 * abs(ar.seconds(n, size) - ms * 1e-3) / (ms * 1e-3)
        for key in ((size_band(size), str(n)), (size_band(size), "all")):
            groups.setdefault(key, []).append(ape)
    bands = [band_label(b) for b in SIZE_BANDS]
    for (band, gpus), apes in sorted(groups.items(), key=lambda kv: (bands.index(kv[0][0]),
                                                                     kv[0][1] == "all", kv[0][1].zfill(3))):
        lines.append(f"  {band:<10} {gpus:>5} {len(apes):>7} {sum(apes) / len(apes):>8.1f} {max(apes):>8.1f}")
    lines.append(f"  {'all':<10} {'all':>5} {ar.num_points:>7} {ar.fit_error['all_mape']:>8.1f} "
                 f"{ar.fit_error['all_max']:>8.1f}")
    return "\n".join(lines)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else math.nan


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m twinserve.simulator.vidur_profiles",
                                description="Fit the bundled GPU profiles to Vidur's operator data.")
    p.add_argument("--write", action="store_true",
                   help="store the fits in simulator/data/hardware/<profile>.json")
    args = p.parse_args(argv)
    for data in all_samples():
        print(format_fit(fit_dataset(data, data.dataset.models[0]), data))
    for network in NETWORKS:
        print(format_all_reduce(network))
    if args.write:
        for path in write_profiles():
            print(f"written: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
