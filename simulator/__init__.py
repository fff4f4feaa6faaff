"""The SimPy twin: replays traces through the shared scheduler with a modelled GPU."""

from twinserve.core.model_config import ModelConfig
from twinserve.simulator.cost_model import CostModel, FittedCostModel, make_cost_model
from twinserve.simulator.hardware import HardwareProfile, bundled_hardware_names, load_hardware
from twinserve.simulator.model_spec import bundled_model_names, load_model_spec
from twinserve.simulator.run import SimConfig, SimResult, simulate, write_sim_run

__all__ = [
    "CostModel", "FittedCostModel", "HardwareProfile", "ModelConfig", "SimConfig", "SimResult",
    "bundled_hardware_names", "bundled_model_names", "load_hardware", "load_model_spec",
    "make_cost_model", "simulate", "write_sim_run",
]
