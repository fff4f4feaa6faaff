"""core.metrics.percentiles against np.percentile, value for value (bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from twinserve.core.metrics import PERCENTILES, percentiles

PERCENTS = (0, 1, 25, 50, 90, 99, 99.9, 100, 33.3, 66.7, 12.5)


def _same(a: list[float], b: list[float]) -> bool:
    return np.array_equal(np.asarray(a).view(np.int64), np.asarray(b).view(np.int64))


@pytest.mark.parametrize("seed", range(6))
def test_percentiles_equal_numpys_linear_percentile(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for n in [*range(1, 60), 101, 999, 1000, 1001, 4096, 77_777]:
        for values in (rng.random(n) * 10.0 ** int(rng.integers(-6, 6)),
                       rng.integers(0, 5, n).astype(np.float64),  # ties
                       np.round(rng.exponential(7.0, n), 3),
                       -rng.random(n)):
            expected = np.percentile(values, PERCENTS).tolist()
            assert _same(percentiles(values, PERCENTS), expected), (n, values[:5])
            mine = values.copy()  # partitioned in place: the same figures
            assert _same(percentiles(mine, PERCENTS, overwrite=True), expected), n
            assert sorted(mine.tolist()) == sorted(values.tolist())


def test_percentiles_edge_values() -> None:
    for values in ([0.0], [-0.0], [-0.0, 0.0], [0.0, -0.0, -0.0], [1.0, np.inf],
                   [-np.inf, 2.0, np.inf], [5e-324, 1.7e308, 1.7e308], [3.0, 3.0, 3.0]):
        arr = np.asarray(values, dtype=np.float64)
        for percents in (PERCENTS, (50, *PERCENTILES)):
            with np.errstate(invalid="ignore"):
                expected = np.percentile(arr, percents).tolist()
            assert _same(percentiles(arr, percents), expected), values
    with pytest.raises(ValueError):
        percentiles(np.array([], dtype=np.float64), (50,))
