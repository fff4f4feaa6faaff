"""The step-time protocol (simulator/step_time.py): every cost model and wrapper answers
``step_time`` and declares its decode-run shortcut itself, wrappers name what they rest on, and
the engine loop takes a model's shortcut with the results of stepping one step at a time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import simpy

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.scheduler import Scheduler
from twinserve.core.step_driver import RunRecorder, StepDriver
from twinserve.policies import get_policy
from twinserve.routers import make_router
from twinserve.simulator.cost_model import CostModel, FittedCostModel, make_cost_model
from twinserve.simulator.engine import Replica, arrival_process, engine_process
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.lora_run import LoadTally
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.run import EngineBuild, SimConfig, build_engine_config, to_request
from twinserve.simulator.step_time import StepTimeFunction, StepTimeModel
from twinserve.simulator.structured_cost import StructuredCost
from twinserve.traces.trace_request import TraceRequest


def _decodes(batch: int, context: int) -> SchedulerOutput:
    return SchedulerOutput(total_num_scheduled_tokens=batch, num_decode_tokens=batch,
                           num_decode_seqs=batch, sum_context_tokens=batch * context,
                           sum_decode_context_tokens=batch * context, max_decode_context=context)


def test_each_cost_model_names_its_roofline_and_describes_itself() -> None:
    spec = load_model_spec("llama-3-8b")
    roofline = make_cost_model(spec, load_hardware("h100-sxm"))
    fitted = make_cost_model(spec, load_hardware("h200"))
    assert isinstance(roofline, CostModel) and roofline.roofline is roofline
    assert isinstance(fitted, FittedCostModel) and fitted.roofline is fitted.base
    assert fitted.describe() == f"{fitted.hardware.name}: {fitted.params.describe()}"
    assert roofline.describe().startswith(f"{roofline.hardware.name}: ")
    assert roofline.describe() != fitted.describe()


def test_a_fitted_build_sizes_memory_from_its_roofline(tmp_path: Path) -> None:
    bare = dataclasses.replace(load_hardware("h200"), fitted=())
    bare_path = str(bare.save(tmp_path / "h200-bare.json"))
    fitted, plain = (build_engine_config(SimConfig(hardware=hw)) for hw in ("h200", bare_path))
    assert isinstance(fitted, EngineBuild) and isinstance(plain, EngineBuild)
    assert isinstance(fitted.cost_model, FittedCostModel) and isinstance(plain.cost_model, CostModel)
    assert fitted.engine_config.scheduler.num_gpu_blocks \
        == plain.engine_config.scheduler.num_gpu_blocks > 0
    assert fitted.model == plain.model


def test_wrappers_add_their_terms_and_decline_the_decode_run_shortcut() -> None:
    cost = build_engine_config(SimConfig(hardware="h100-sxm")).cost_model  # Llama-3-8B's roofline
    out = _decodes(8, 300)
    fitted = make_cost_model(load_model_spec("llama-3-8b"), load_hardware("h200"))
    for model in (cost, fitted):  # each cost model's own shortcut
        ends = model.decode_run_ends(out, 0.0, 10.0, 0.0, 3)
        assert ends is not None and len(ends) == 3 and ends[0] == model.step_time(out)
    loading = dataclasses.replace(out, lora_loads=[("a", 0), ("b", 1)])
    tally = LoadTally(cost, lambda loads: 0.5 * len(loads))
    masks = StructuredCost(mask_s_per_row=1e-3, mask_s_per_step=2e-3).wrap(cost)
    function = StepTimeFunction(lambda o: 0.25)
    wrappers: list[StepTimeModel] = [tally, masks, function]
    for model in wrappers:
        assert model.decode_run_ends(out, 0.0, 10.0, 0.0, 3) is None
    assert tally.step_time(loading) == cost.step_time(loading)
    assert (tally.loads, tally.load_s) == (2, 1.0)
    assert masks.step_time(out) == cost.step_time(out)  # no constrained row: no mask
    assert function.step_time(out) == 0.25


class _Spy:
    """A roofline whose shortcut calls are counted."""

    def __init__(self, inner: CostModel) -> None:
        self.inner, self.runs = inner, 0

    def step_time(self, out: SchedulerOutput) -> float:
        return self.inner.step_time(out)

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        self.runs += 1
        return self.inner.decode_run_ends(out, now, horizon, base, max_steps)


def _replay(build: EngineBuild, model: StepTimeModel, trace: list[TraceRequest]) -> tuple:
    env, recorder = simpy.Environment(), RunRecorder()
    driver = StepDriver(Scheduler(build.engine_config.scheduler, get_policy("fcfs"),
                                  stream_outputs=False), recorder, 0)
    replica = Replica(0, driver, model, alone=True)
    requests = (to_request(tr, build.model.vocab_size, 16) for tr in trace)
    env.process(arrival_process(env, requests, [replica], make_router("round-robin", 16), recorder))
    env.process(engine_process(env, replica))
    env.run()
    return ([dataclasses.astuple(r) for r in recorder.requests],
            [dataclasses.astuple(s) for s in recorder.steps])


def test_the_engine_loop_takes_a_models_shortcut_with_the_reference_results() -> None:
    build = build_engine_config(SimConfig(hardware="h100-sxm"))
    assert isinstance(build.cost_model, CostModel)
    trace = [TraceRequest(f"r{i}", 0.02 * i, 30 + 11 * i, 40 + 9 * i) for i in range(12)]
    spy = _Spy(build.cost_model)
    fast = _replay(build, spy, trace)
    reference = _replay(build, StepTimeFunction(build.cost_model.step_time), trace)
    assert spy.runs > 0
    assert fast == reference
    assert len(fast[0]) == 12
