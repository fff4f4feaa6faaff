"""The run folder's ITL column, each distinct gap formatted once, against the plain per-gap
format (``run_dir._request_row``'s), including the values ``np.unique`` treats specially."""

from __future__ import annotations

import math
import random
from array import array

import pytest

from twinserve.core import run_dir
from twinserve.core.metrics import RequestRecord


def _record(i: int, itls: list[float]) -> RequestRecord:
    return RequestRecord(f"r{i}", 0.0, 0.1, 0.2, 1.0, 10, len(itls) + 1, itls=array("d", itls))


@pytest.mark.parametrize("extra", [[], [0.0, -0.0], [math.nan, math.inf, -1.5e-7, 0.0]],
                         ids=["gaps", "signed-zeros", "nan-inf-negative"])
def test_itl_texts_equal_the_plain_format(extra: list[float]) -> None:
    rng = random.Random(3)
    steps = [rng.expovariate(40) for _ in range(300)]  # gaps shared between requests
    records = [_record(i, [rng.choice(steps) for _ in range(rng.randint(0, 60))] + extra)
               for i in range(50)]
    records.append(_record(50, []))
    want = [" ".join(f"{g * 1e3:.6g}" for g in r.itls) for r in records]
    assert run_dir._itl_texts(records) == want
    assert run_dir._itl_texts([_record(0, [])]) == [""]
