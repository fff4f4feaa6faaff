"""The twin's transfer model against transfers measured on this machine: the Peer connector's
real load path between two processes over a grid of sizes and concurrency, a link fitted on
part of the grid, and the rest predicted through the twin's own transfer code."""

from __future__ import annotations

import math

import pytest

from twinserve.benchmarks.kv_link_fit import predict
from twinserve.gpu.kv_transfer.region import KVLayout
from twinserve.gpu.measurement.kv_transfer import TransferSample, fit_link, measure_transfers, transfer_table
from twinserve.simulator.kv_transfer import LinkSpec, concurrent_load_seconds


def _synthetic(link: LinkSpec, sizes: list[int], concurrency: list[int]) -> list[TransferSample]:
    return [TransferSample(b, c, t) for b in sizes for c in concurrency
            for t in concurrent_load_seconds(link, b, c)]


def test_the_fit_recovers_a_split_fixed_cost_from_concurrent_rows() -> None:
    truth = LinkSpec("truth", 2e9, 1e-4, overhead_s=3e-4)
    samples = _synthetic(truth, [1 << 16, 1 << 20, 1 << 24], [1, 2, 4])
    fit = fit_link(samples)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert (fit.latency_s, fit.overhead_s) == (pytest.approx(1e-4, rel=1e-6),
                                               pytest.approx(3e-4, rel=1e-6))
    one_at_a_time = fit_link([s for s in samples if s.concurrency == 1])
    assert (one_at_a_time.latency_s, one_at_a_time.overhead_s) == (pytest.approx(4e-4), 0.0)


def test_predict_holds_out_what_it_did_not_fit() -> None:
    truth = LinkSpec("truth", 1e9, 2e-4, overhead_s=1e-4)
    samples = _synthetic(truth, [1 << 16, 1 << 18, 1 << 20], [1, 2, 4])
    link, rows = predict(samples, {1 << 16, 1 << 20}, {1, 2})
    assert link.overhead_s == pytest.approx(1e-4, rel=1e-6)
    held = {(r.num_bytes, r.concurrency) for r in rows if r.held_out}
    assert held == {(1 << 18, 1), (1 << 18, 2), (1 << 16, 4), (1 << 18, 4), (1 << 20, 4)}
    assert all(abs(r.error) < 1e-6 for r in rows)
    assert [r.concurrency for r in transfer_table(samples)][:3] == [1, 2, 4]


# A shared 2-core host (five other sessions beside this one) moves a cell's median between runs
# by up to ~1.6x (4 MB x 4 at once: 2.3 to 3.4 ms), more for the sub-millisecond cells whose
# time is thread hand-offs. So each held-out cell must be within a factor of 2 and the held-out
# cells within 35% on average: loose for noise, yet a model that ignored contention (4x at 4
# at once), charged the latency per byte or lost the fixed cost (3x on the small cells) fails.
# Now and then a burst of load stalls most rounds of one fitted cell and skews the fit itself
# (seen once in ~15 runs): the grid is then measured anew, once; a broken model fails both.
CELL_FACTOR = 2.0
MEAN_ERROR = 0.35
ATTEMPTS = 2


def _verdict(layout: KVLayout) -> str | None:
    """None when the twin predicts the held-out cells within the tolerance, else the table."""
    samples = measure_transfers(layout, blocks=(1, 4, 16, 64), concurrency=(1, 2, 4), repeats=9)
    fit_bytes = {n * layout.bytes_per_block for n in (1, 16, 64)}
    _, rows = predict(samples, fit_bytes, {1, 2})
    held = [r for r in rows if r.held_out]
    assert len(held) == 6 and {r.concurrency for r in held} == {1, 2, 4}
    if all(abs(math.log(r.predicted_s / r.measured_s)) <= math.log(CELL_FACTOR) for r in held) \
            and sum(abs(r.error) for r in held) / len(held) <= MEAN_ERROR:
        return None
    return "\n".join(f"{r.num_bytes} x {r.concurrency}: measured {r.measured_s * 1e3:.3f} ms, "
                     f"twin {r.predicted_s * 1e3:.3f} ms{' (held out)' if r.held_out else ''}"
                     for r in rows)


@pytest.mark.slow
def test_the_twin_predicts_held_out_sizes_and_concurrency() -> None:
    layout = KVLayout(4, 16, 2, 64, "float32", 256)  # 64 KiB a block: 64 KiB to 4 MiB a load
    tables = []
    for _ in range(ATTEMPTS):
        table = _verdict(layout)
        if table is None:
            return
        tables.append(table)
    pytest.fail("the twin missed the measured transfers:\n\n" + "\n\n".join(tables))
