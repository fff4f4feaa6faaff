"""The Peer connector's measured link: the fit the twin's ``kv_link`` takes, and a short
measurement between two processes feeding it."""

from __future__ import annotations

import pytest

from twinserve.gpu.kv_transfer.region import KVLayout
from twinserve.gpu.measurement.kv_transfer import (
    TransferSample,
    aggregate_bandwidth,
    fit_link,
    measure_link,
)
from twinserve.simulator.kv_transfer import LinkSpec


def test_fit_recovers_latency_and_bandwidth() -> None:
    bw, lat = 2e9, 1e-4
    samples = [TransferSample(b, 1, lat + b / bw) for b in (1 << 16, 1 << 20, 1 << 24)]
    samples += [TransferSample(1 << 20, 1, 5.0)]  # one stalled transfer (median of two: ok)
    samples += [TransferSample(1 << 20, 1, lat + (1 << 20) / bw)]
    samples += [TransferSample(1 << 24, 4, lat + 4 * (1 << 24) / bw)]  # four share one flow's rate
    fit = fit_link(samples)
    assert fit.flow_rate == pytest.approx(bw, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert fit.latency_s == pytest.approx(lat, rel=1e-6)
    spec = LinkSpec.from_dict(fit.to_kv_link())  # what calibrate writes, the twin reads
    assert spec.bandwidth_bytes_per_s == pytest.approx(bw, rel=1e-6)
    assert aggregate_bandwidth(samples)[4] == pytest.approx(bw, rel=0.01)


def test_fit_clamps_a_negative_latency_and_refuses_too_little() -> None:
    fit = fit_link([TransferSample(1000, 1, 0.0009), TransferSample(2000, 1, 0.0021)])
    # the line through both points meets the axis below 0: refitted through the origin
    assert fit.latency_s == 0.0
    assert fit.bandwidth_bytes_per_s == pytest.approx(5e6 / 5.1e-6 * 1e-6, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([TransferSample(1000, 1, 0.001), TransferSample(1000, 2, 0.002)])
    with pytest.raises(ValueError, match="grow"):
        fit_link([TransferSample(1000, 1, 0.002), TransferSample(2000, 1, 0.001)])


@pytest.mark.slow
def test_measured_transfers_feed_a_link() -> None:
    layout = KVLayout(4, 16, 2, 64, "float32", 64)
    fit, samples = measure_link(layout, blocks=(1, 16), concurrency=(1, 2), repeats=3)
    assert {s.concurrency for s in samples} == {1, 2} and len(samples) == 2 * 3 + 2 * 3 * 2
    assert {s.num_bytes for s in samples} == {layout.bytes_per_block, 16 * layout.bytes_per_block}
    assert fit.bandwidth_bytes_per_s > 1e7 and 0 <= fit.latency_s < 0.1
