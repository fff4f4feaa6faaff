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


# The tolerance, for a shared 2-core host (five other sessions beside this one): the held-out
# cells within 35% of the twin on average, and each within a factor of 3. Quiet, the cells land
# within 5-46% of the twin (docs/disaggregation.md); a cell's median moves by up to ~1.6x between
# runs; under heavy load (load average ~7) four concurrent 4 MiB loads took 7.5 ms against the
# twin's 2.9 (other processes' memory traffic, reproducibly), while the rest stayed within 15%.
# A model without contention misses the bandwidth-bound cells at 4 at once by 4x or more (checked
# by breaking the max-min share: the test fails, quiet or loaded).
# A burst can also stall most rounds of a fitted cell and skew the fit itself: a miss measures
# the grid again and judges, per cell, the quieter of the two (stalls only add time).
CELL_FACTOR = 3.0
MEAN_ERROR = 0.35


def _measure(layout: KVLayout) -> list[TransferSample]:
    return measure_transfers(layout, blocks=(1, 4, 16, 64), concurrency=(1, 2, 4), repeats=9)


def _quieter(a: list[TransferSample], b: list[TransferSample]) -> list[TransferSample]:
    """Per (bytes, concurrency) cell, the samples of the measurement with the lower median."""
    medians = [{(r.num_bytes, r.concurrency): r.seconds for r in transfer_table(x)} for x in (a, b)]
    def pick(s: TransferSample) -> int:
        cell = (s.num_bytes, s.concurrency)
        return 0 if medians[0][cell] <= medians[1][cell] else 1
    return [s for s in a if pick(s) == 0] + [s for s in b if pick(s) == 1]


def _judge(layout: KVLayout, samples: list[TransferSample]) -> tuple[bool, str]:
    """Whether the twin predicts the held-out cells within the tolerance, and the table."""
    _, rows = predict(samples, {n * layout.bytes_per_block for n in (1, 16, 64)}, {1, 2})
    held = [r for r in rows if r.held_out]
    assert len(held) == 6 and {r.concurrency for r in held} == {1, 2, 4}
    ok = all(abs(math.log(r.predicted_s / r.measured_s)) <= math.log(CELL_FACTOR) for r in held) \
        and sum(abs(r.error) for r in held) / len(held) <= MEAN_ERROR
    return ok, "\n".join(f"{r.num_bytes} x {r.concurrency}: measured {r.measured_s * 1e3:.3f} ms,"
                         f" twin {r.predicted_s * 1e3:.3f} ms{' (held out)' if r.held_out else ''}"
                         for r in rows)


@pytest.mark.slow
def test_the_twin_predicts_held_out_sizes_and_concurrency() -> None:
    layout = KVLayout(4, 16, 2, 64, "float32", 256)  # 64 KiB a block: 64 KiB to 4 MiB a load
    first = _measure(layout)
    ok, table = _judge(layout, first)
    if ok:
        return
    ok, quieter = _judge(layout, _quieter(first, _measure(layout)))
    assert ok, f"the twin missed the measured transfers:\n{table}\n\nquieter of two:\n{quieter}"


def test_the_fit_recovers_a_link_capacity_above_one_flows_rate() -> None:
    truth = LinkSpec("truth", 3.6e9, 1e-4, overhead_s=2e-4, flow_bandwidth_bytes_per_s=2e9)
    samples = _synthetic(truth, [1 << 16, 1 << 20, 1 << 24], [1, 2, 4])
    fit = fit_link(samples)
    assert fit.flow_rate == pytest.approx(2e9, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(3.6e9, rel=1e-3)
    assert (fit.latency_s, fit.overhead_s) == (pytest.approx(1e-4, rel=1e-3),
                                               pytest.approx(2e-4, rel=1e-3))
    # fitted on one and two at a time (two already feel the capacity), four at a time held out
    link, rows = predict(samples, {1 << 16, 1 << 24}, {1, 2})
    assert link.flow_bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-6)
    assert link.bandwidth_bytes_per_s == pytest.approx(3.6e9, rel=1e-3)
    assert max(abs(r.error) for r in rows) < 1e-3
    # the model before flow caps (capacity = one flow's rate) misses four at a time
    _, flat = predict(samples, {1 << 16, 1 << 24}, {1, 2}, capacity=False)
    assert max(abs(r.error) for r in flat if r.concurrency == 4) > 0.3


@pytest.mark.slow
def test_a_cpu_consumer_pays_for_fresh_pages_and_slows_beside_a_step() -> None:
    from twinserve.gpu.measurement.kv_transfer import LinkFit, measure_consumer
    found = measure_consumer(KVLayout(30, 16, 3, 64, "bfloat16", 256))  # SmolLM2's blocks
    # fresh pages are allocated and zeroed at first write; the stand-in step takes the core
    assert found.cold_s > 1.2 * found.warm_s and found.first_touch_s_per_byte > 0
    assert found.cold_beside_step_s > 1.2 * found.cold_s and found.consumer_step_share < 0.85
    fit = LinkFit(4e9, 1e-4, first_touch_s_per_byte=found.first_touch_s_per_byte,
                  consumer_step_share=found.consumer_step_share)
    link = LinkSpec.from_dict(fit.to_kv_link())
    assert (link.first_touch_s_per_byte, link.consumer_step_share) == \
        (found.first_touch_s_per_byte, found.consumer_step_share)
