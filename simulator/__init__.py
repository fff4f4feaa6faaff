"""The SimPy twin: replays traces through the shared scheduler with a modelled GPU."""

from twinserve.core.model_config import ModelConfig
from twinserve.simulator.cost_model import (
    CostModel,
    DeviceCostModel,
    FittedCostModel,
    make_cost_model,
)
from twinserve.simulator.hardware import HardwareProfile, bundled_hardware_names, load_hardware
from twinserve.simulator.model_spec import bundled_model_names, load_model_spec
from twinserve.simulator.run import (
    EngineBuild,
    SimConfig,
    SimResult,
    build_engine_config,
    simulate,
    write_sim_run,
)
from twinserve.simulator.step_time import StepTimeFunction, StepTimeModel

__all__ = [
    "CostModel", "DeviceCostModel", "EngineBuild", "FittedCostModel", "HardwareProfile",
    "ModelConfig", "SimConfig", "SimResult", "StepTimeFunction", "StepTimeModel",
    "build_engine_config", "bundled_hardware_names", "bundled_model_names", "load_hardware",
    "load_model_spec", "make_cost_model", "simulate", "write_sim_run",
]
