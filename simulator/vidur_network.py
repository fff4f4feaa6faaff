"""The all-reduce of one node from Vidur's measurements, and its fit to the cost model's link terms.

Vidur (microsoft/vidur, MIT) timed NCCL all-reduce of ``size`` bytes (fp16, 2 bytes per element)
on ``n`` GPUs of one node (``data/profiling/network/<sku>_<node>/all_reduce.csv``; kept here as
``<sku>_<node>_all_reduce.csv``, see ``PROVENANCE.md``). The roofline times one all-reduce as

    seconds = interconnect_latency_s + ring(n) * bytes / interconnect_bandwidth,  ring(n) = 2 (n - 1) / n

(``cost_model.CostModel``), so ``fit_all_reduce`` fits those two numbers over every measured
``n`` and size at once, minimising the relative error (a 10 us all-reduce weighs as much as a
1 ms one), and states the error per size band.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SIZE_BANDS: tuple[tuple[int, int], ...] = ((0, 2**16), (2**16, 2**20), (2**20, 2**24),
                                           (2**24, 2**40))


def ring(num_workers: int) -> float:
    """Bytes each GPU sends per byte reduced in a ring all-reduce."""
    return 2.0 * (num_workers - 1) / num_workers


def _size_label(nbytes: int) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def band_label(band: tuple[int, int]) -> str:
    lo, hi = band
    return f"<{_size_label(hi)}" if lo == 0 else (f">={_size_label(lo)}" if hi >= 2**40
                                                   else f"{_size_label(lo)}-{_size_label(hi)}")


def size_band(nbytes: int) -> str:
    for band in SIZE_BANDS:
        if band[0] <= nbytes < band[1]:
            return band_label(band)
    raise ValueError(f"size {nbytes} outside every band.")


@dataclass(slots=True, frozen=True)
class AllReduceTable:
    """Measured milliseconds by byte size, per number of workers; linear between sizes."""

    name: str  # e.g. "h100_dgx"
    points: dict[int, tuple[tuple[int, ...], tuple[float, ...]]] = field(default_factory=dict)

    @property
    def num_workers(self) -> tuple[int, ...]:
        return tuple(sorted(self.points))

    def rows(self) -> list[tuple[int, int, float]]:
        """Every measured (workers, bytes, ms)."""
        return [(n, s, ms) for n in self.num_workers for s, ms in zip(*self.points[n])]

    def max_size(self, num_workers: int) -> int:
        return self.points[num_workers][0][-1]

    def at_ms(self, num_workers: int, nbytes: int) -> float:
        """Milliseconds of one all-reduce of ``nbytes`` (raises outside the measured sizes)."""
        if num_workers not in self.points:
            raise ValueError(f"{self.name} has no all-reduce on {num_workers} GPUs; measured: "
                             f"{', '.join(map(str, self.num_workers))}.")
        sizes, ms = self.points[num_workers]
        if not sizes[0] <= nbytes <= sizes[-1]:
            raise ValueError(f"{nbytes} bytes outside the measured {sizes[0]}..{sizes[-1]}.")
        j = bisect.bisect_left(sizes, nbytes)
        if sizes[j] == nbytes:
            return ms[j]
        return ms[j - 1] + (ms[j] - ms[j - 1]) * (nbytes - sizes[j - 1]) / (sizes[j] - sizes[j - 1])


def load_all_reduce(path: Path) -> AllReduceTable:
    by_n: dict[int, list[tuple[int, float]]] = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            by_n.setdefault(int(r["num_workers"]), []).append((int(r["size"]), float(r["all_reduce_ms"])))
    if not by_n:
        raise ValueError(f"{path} holds no all-reduce rows.")
    points = {n: (tuple(s for s, _ in sorted(v)), tuple(y for _, y in sorted(v)))
              for n, v in by_n.items()}
    return AllReduceTable(path.name.removesuffix("_all_reduce.csv"), points)


@dataclass(slots=True, frozen=True)
class AllReduceFit:
    """``latency_s + ring(n) * bytes / bandwidth`` and its error on the data, in percent
    (``<band>_mape`` / ``<band>_max`` per size band, and ``all_*``)."""

    latency_s: float
    bandwidth: float  # bytes/s
    num_points: int
    fit_error: dict[str, float]

    def seconds(self, num_workers: int, nbytes: int) -> float:
        return self.latency_s + ring(num_workers) * nbytes / self.bandwidth


def fit_all_reduce(table: AllReduceTable) -> AllReduceFit:
    """Relative least squares of the two link terms over every measured point (both kept
    positive: a negative latency is clipped to zero and the bandwidth refitted)."""
    rows = table.rows()
    x = np.array([[1.0, ring(n) * s] for n, s, _ in rows])
    y = np.array([ms * 1e-3 for _, _, ms in rows])
    w = 1.0 / y
    latency, s_per_byte = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    if latency < 0:
        latency = 0.0
        s_per_byte = float(np.sum(x[:, 1] * w * w * y) / np.sum((x[:, 1] * w) ** 2))
    fit = AllReduceFit(float(latency), 1.0 / float(s_per_byte), len(rows), {})
    return AllReduceFit(fit.latency_s, fit.bandwidth, len(rows), all_reduce_errors(fit, table))


def all_reduce_errors(fit: AllReduceFit, table: AllReduceTable) -> dict[str, float]:
    """Mean and max relative error per size band (max rounded up: a bound the data keep)."""
    groups: dict[str, list[float]] = {}
    for n, s, ms in table.rows():
        ape = 100 * abs(fit.seconds(n, s) - ms * 1e-3) / (ms * 1e-3)
        groups.setdefault(size_band(s), []).append(ape)
        groups.setdefault("all", []).append(ape)
    errors = {}
    for key in [band_label(b) for b in SIZE_BANDS if band_label(b) in groups] + ["all"]:
        errors[f"{key}_mape"] = round(sum(groups[key]) / len(groups[key]), 2)
        errors[f"{key}_max"] = math.ceil(max(groups[key]) * 100) / 100
    return errors
