"""One measured step of the real backend, and the CSV that holds them (``step_features.csv``).

A sample is the scheduler's totals of one ``SchedulerOutput`` (``AGGREGATE_FIELDS``: what the
simulator's cost model reads) and the seconds the step took. ``gpu.profiler`` measures samples
(hand-built steps, the steps of a live engine); ``simulator.calibration`` fits the cost model on
them. The CSV has one row per sample::

    kind, <AGGREGATE_FIELDS...>, seconds, execute_seconds[, <LORA_FEATURE_NAMES...>]

``execute_seconds`` is empty when the forward pass was not timed apart from the whole step; the
LoRA columns are there when a sample ran adapters (empty in the rows of the others); the
repeats of a micro-benchmark are not written (``seconds`` is their median).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from twinserve.core.lora import LORA_FEATURE_NAMES
from twinserve.core.outputs import AGGREGATE_FIELDS, SchedulerOutput

STEP_KINDS = ("prefill", "decode", "mixed", "swap")
SAMPLE_COLUMNS = ("kind", *AGGREGATE_FIELDS, "seconds", "execute_seconds")
# absent from files of older versions: ``_prefix_chunks``, ``_prefix_context`` and
# ``_attention_area`` fill them in
_PREFIX_CHUNKS = "num_prefix_chunks"
_PREFIX_CONTEXT = "sum_prefix_context_tokens"
_AREA = "sum_prefill_attention_area"
_DERIVED = (_PREFIX_CHUNKS, _PREFIX_CONTEXT, _AREA)
# Columns newer than some recorded files, read as 0 where absent (drafts: speculative decoding).
_OPTIONAL = ("num_spec_tokens",)
SAMPLES_FILE = "step_features.csv"


@dataclass(slots=True)
class StepSample:
    """One timed step. ``seconds`` is what the engine step (or, for a micro-benchmark, the forward
    pass) took; ``execute_seconds`` the forward pass alone (``nan`` when not timed apart);
    ``repeats`` the timings a median was taken of. ``kind`` (``prefill``, ``decode``, ``mixed`` or
    ``swap``) is derived from the aggregates when not given. ``lora_features`` are the step's
    ``core.lora.lora_step_features`` (empty: no adapter ran or was loaded)."""

    aggregates: dict[str, int]
    seconds: float
    execute_seconds: float = math.nan
    kind: str = ""
    repeats: list[float] = field(default_factory=list)
    lora_features: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.aggregates) - set(AGGREGATE_FIELDS))
        if unknown:
            raise ValueError(f"unknown aggregate field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(AGGREGATE_FIELDS)}.")
        if len(self.aggregates) < len(AGGREGATE_FIELDS):  # every field, as the CSV holds them
            self.aggregates = {k: self.aggregates.get(k, 0) for k in AGGREGATE_FIELDS}
        if not math.isfinite(self.seconds) or self.seconds < 0:
            raise ValueError(f"seconds must be finite and >= 0, got {self.seconds!r}.")
        if not math.isnan(self.execute_seconds) and not self.execute_seconds >= 0:
            raise ValueError(f"execute_seconds must be >= 0 or nan, got {self.execute_seconds!r}.")
        unknown = sorted(set(self.lora_features) - set(LORA_FEATURE_NAMES))
        if unknown:
            raise ValueError(f"unknown LoRA feature(s) {', '.join(unknown)}; "
                             f"known: {', '.join(LORA_FEATURE_NAMES)}.")
        if not self.kind:
            self.kind = step_kind(self.aggregates)
        elif self.kind not in STEP_KINDS:
            raise ValueError(f"kind must be one of {', '.join(STEP_KINDS)}, got {self.kind!r}.")

    @classmethod
    def of_step(cls, out: SchedulerOutput, seconds: float, execute_seconds: float = math.nan,
                repeats: Iterable[float] = ()) -> StepSample:
        """The sample of a timed ``SchedulerOutput``."""
        return cls(aggregates(out), seconds, execute_seconds, repeats=list(repeats))


def aggregates(out: SchedulerOutput) -> dict[str, int]:
    """The scheduler-filled totals of one step (what the cost model reads)."""
    return {name: int(getattr(out, name)) for name in AGGREGATE_FIELDS}


def step_kind(aggregates: Mapping[str, int]) -> str:
    """``prefill`` (chunks only), ``decode`` (decodes only), ``mixed`` or ``swap`` (no tokens)."""
    prefill, decode = aggregates.get("num_prefill_seqs", 0), aggregates.get("num_decode_seqs", 0)
    if prefill and decode:
        return "mixed"
    if prefill:
        return "prefill"
    return "decode" if decode else "swap"


def write_samples(path: str | Path, samples: Iterable[StepSample]) -> Path:
    path = Path(path)
    samples = list(samples)
    lora = LORA_FEATURE_NAMES if any(s.lora_features for s in samples) else ()
    # an optional column is written only when some sample has it (files without drafts keep
    # their bytes)
    fields = [k for k in AGGREGATE_FIELDS
              if k not in _OPTIONAL or any(s.aggregates.get(k) for s in samples)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(("kind", *fields, "seconds", "execute_seconds", *lora))
        for s in samples:
            w.writerow([s.kind, *(int(s.aggregates.get(k, 0)) for k in fields),
                        repr(round(s.seconds, 9)),
                        "" if math.isnan(s.execute_seconds) else repr(round(s.execute_seconds, 9)),
                        *(repr(s.lora_features[n]) if n in s.lora_features else "" for n in lora)])
    return path


def read_samples(path: str | Path) -> list[StepSample]:
    """Samples from a CSV written by ``write_samples``, or from a run folder holding one
    (``step_features.csv``)."""
    path = Path(path)
    if path.is_dir():
        path = path / SAMPLES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no step samples (validate writes {SAMPLES_FILE} into "
                                "the real run folder).")
    out = []
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f), start=2):
            try:
                counts = {k: int(row[k]) for k in AGGREGATE_FIELDS
                          if k not in _DERIVED and k not in _OPTIONAL}
                counts.update({k: int(row.get(k) or 0) for k in _OPTIONAL})
                counts[_PREFIX_CHUNKS] = _prefix_chunks(row, counts)
                counts[_PREFIX_CONTEXT] = _prefix_context(row, counts)
                counts[_AREA] = _attention_area(row, counts)
                execute = float(row["execute_seconds"]) if row.get("execute_seconds") else math.nan
                lora = {n: float(row[n]) for n in LORA_FEATURE_NAMES if row.get(n)}
                out.append(StepSample(counts, float(row["seconds"]), execute, row.get("kind") or "",
                                      lora_features=lora))
            except (KeyError, ValueError) as exc:
                raise ValueError(f"{path}:{i}: bad step sample row ({exc}).") from None
    return out


def _prefix_chunks(row: Mapping[str, str], counts: Mapping[str, int]) -> int:
    """The row's ``num_prefix_chunks``. Files written before twinserve counted it
    lack the column: exact (0) for a step without prefill chunks, unknown for one with them."""
    value = row.get(_PREFIX_CHUNKS)
    if value:
        return int(value)
    if counts["num_prefill_seqs"]:
        raise ValueError(f"no {_PREFIX_CHUNKS} for a step with prefill chunks: the file was "
                         "recorded by an older twinserve; record the run again")
    return 0


def _prefix_context(row: Mapping[str, str], counts: Mapping[str, int]) -> int:
    """The row's ``sum_prefix_context_tokens``. Files written before twinserve counted it lack
    the column: derived from the prefill part of ``sum_context_tokens`` as if the step's prefill
    chunks were of equal length (exact for one chunk and for the grid's steps, whose chunks are
    equal): ``k`` chunks of ``n`` tokens after prefixes ``s_i`` sum ``n * sum(s_i) + k * n(n+1)/2``."""
    value = row.get(_PREFIX_CONTEXT)
    if value:
        return int(value)
    if not counts[_PREFIX_CHUNKS]:
        return 0
    k, n = counts["num_prefill_seqs"], counts["num_prefill_tokens"] / counts["num_prefill_seqs"]
    return max(0, round((_prefill_context(counts) - k * n * (n + 1) / 2) / n))


def _attention_area(row: Mapping[str, str], counts: Mapping[str, int]) -> int:
    """The row's ``sum_prefill_attention_area``. Files written before twinserve counted it lack
    the column: derived as if the step's prefill chunks were of equal length (exact for one chunk
    and for the grid's steps; a lower bound for unequal chunks): ``k`` chunks of ``n`` tokens add
    ``k * n(n-1)/2`` to the context their tokens attend to (the rectangle less the triangle)."""
    value = row.get(_AREA)
    if value:
        return int(value)
    k = counts["num_prefill_seqs"]
    if not k:
        return 0
    n = counts["num_prefill_tokens"] / k
    return round(_prefill_context(counts) + k * n * (n - 1) / 2)


def _prefill_context(counts: Mapping[str, int]) -> int:
    """The prefill chunks' part of ``sum_context_tokens``."""
    return counts["sum_context_tokens"] - counts["sum_decode_context_tokens"]


def read_recorded_samples(run_dirs: Iterable[str | Path]) -> list[StepSample]:
    """The samples of every run folder that recorded its steps, in order (the others skipped)."""
    samples: list[StepSample] = []
    for run_dir in run_dirs:
        try:
            samples += read_samples(run_dir)
        except FileNotFoundError:
            continue
    return samples
