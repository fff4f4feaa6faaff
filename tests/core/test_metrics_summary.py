"""``summarize``'s ITL figures over every gap of every successful record: the same whether the
records hold compact arrays (one copy of their bytes) or plain lists, and as numpy computes
them over the gaps directly."""

from __future__ import annotations

import math
import random
from array import array

import numpy as np

from twinserve.core.metrics import RequestRecord, summarize


def _records(rng: random.Random, as_list: bool = False) -> list[RequestRecord]:
    out = []
    for i in range(40):
        gaps = [rng.expovariate(50) for _ in range(rng.randint(0, 30))]
        out.append(RequestRecord(f"r{i}", i * 0.1, i * 0.1, i * 0.1 + 0.05, i * 0.1 + 1.0, 10,
                                 len(gaps) + 1, success=i % 7 != 3,
                                 itls=gaps if as_list else array("d", gaps)))
    return out


def test_itl_figures_over_arrays_and_lists_are_numpys() -> None:
    compact, plain = _records(random.Random(2)), _records(random.Random(2), as_list=True)
    got = summarize(compact, duration_s=5.0)
    assert got == summarize(plain, duration_s=5.0)
    mixed = compact[:20] + plain[20:]
    assert summarize(mixed, duration_s=5.0) == got
    gaps = np.array([g for r in compact if r.success for g in r.itls]) * 1000.0
    assert got["mean_itl_ms"] == float(gaps.mean())
    assert got["p99_itl_ms"] == float(np.percentile(gaps, 99))
    assert got["median_itl_ms"] == float(np.percentile(gaps, 50))


def test_no_successful_record_has_no_itl_figures() -> None:
    failed = RequestRecord("x", 0.0, math.nan, math.nan, math.nan, 5, 0, success=False)
    assert math.isnan(summarize([failed], duration_s=1.0)["mean_itl_ms"])
    assert math.isnan(summarize([], duration_s=1.0)["p90_itl_ms"])
