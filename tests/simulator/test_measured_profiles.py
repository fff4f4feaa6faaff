"""simulator/measured_profiles.py: the bundled GPU fits that rest on twinserve's own calibrations
(the H200) reproduce the samples bundled beside them, within the error they state."""

from __future__ import annotations

import pytest

from twinserve.simulator.calibration import fit_backend, fit_errors, output_of
from twinserve.simulator.cost_model import FittedCostModel, make_cost_model
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.measured_profiles import (
    MEASURED_DIR,
    MeasuredProfile,
    bundled_measurements,
    report,
)
from twinserve.simulator.model_spec import load_model_spec


def test_the_h200_fit_is_twinserves_own_measurement_within_its_stated_error() -> None:
    assert ("h200", "llama-3-8b") in bundled_measurements()
    m = MeasuredProfile.load("h200", "llama-3-8b")
    assert "NVIDIA H200" in m.params.source and "h200_llama-3-8b.csv" in m.params.source
    assert "h200_llama-3-8b.csv" in (MEASURED_DIR / "PROVENANCE.md").read_text()
    assert len(m.micro) > 200 and len(m.loop) > 200
    # the bundled samples refit to the bundled coefficients: the data is the fit's
    refit = fit_backend(m.micro, m.loop, "llama-3-8b").params
    assert refit.intercept_s == pytest.approx(m.params.intercept_s, rel=1e-6)
    for name in set(refit.coefficients) | set(m.params.coefficients):
        assert refit.coefficients.get(name, 0.0) == pytest.approx(
            m.params.coefficients.get(name, 0.0), rel=1e-6, abs=1e-15), name
    # the stated error is the fit's on the measured whole steps, kind by kind
    stated = m.params.fit_error
    for error in fit_errors(m.params, m.loop, "seconds"):
        assert error.mape == pytest.approx(stated[f"{error.kind}_mape"], abs=0.01)
    # a handful of measured steps through the simulator's cost model: within the stated maximum
    twin = make_cost_model(load_model_spec("llama-3-8b"), load_hardware("h200"))
    assert isinstance(twin, FittedCostModel)
    for sample in m.loop[::40]:
        predicted = twin.step_time(output_of(sample.aggregates))
        assert abs(predicted / sample.seconds - 1) <= stated[f"{sample.kind}_max"] / 100, sample
    text = report("h200", "llama-3-8b")
    assert "measured / fitted / roofline" in text and "earlier calibration" in text
