"""A twin replica running PP=2's batch queue on a constant base step, for the pipeline tests."""

from __future__ import annotations

import dataclasses

import simpy

from twinserve.core.config import SchedulerConfig
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import Scheduler, make_request
from twinserve.core.step_driver import StepDriver
from twinserve.policies import get_policy
from twinserve.simulator.engine import Replica
from twinserve.simulator.hardware import HardwareProfile, load_hardware
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.pipeline import PipelineCost, pipelined_engine_process
from twinserve.simulator.step_time import StepTimeFunction

SPEC = load_model_spec("llama-3-8b")
# a slow link, so that the transfers show in the interval
SLOW_LINK = dataclasses.replace(load_hardware("h100-sxm"), interconnect_bandwidth=1e9,
                                interconnect_latency_s=1e-3)


def run_pp2_queue(arrivals: list[float], hw: HardwareProfile = SLOW_LINK, base_s: float = 0.040,
                  output_tokens: int = 20):
    """``len(arrivals)`` requests of 20-token prompts through the twin's PP=2 queue on a
    constant base step time; returns the recorded steps, the model and the replica."""
    pipe = PipelineCost(StepTimeFunction(lambda out: base_s), SPEC, hw, 2)
    cfg = SchedulerConfig(num_gpu_blocks=64, block_size=16, max_num_seqs=8,
                          max_num_batched_tokens=256, max_model_len=1024)
    replica = Replica(0, StepDriver(Scheduler(cfg, get_policy("fcfs"), stream_outputs=False)), pipe)
    requests = [make_request(f"r{i}", list(range(100 + 50 * i, 120 + 50 * i)), t,
                             SamplingParams(max_tokens=output_tokens, ignore_eos=True))
                for i, t in enumerate(arrivals)]
    env = simpy.Environment()

    def arrive(env: simpy.Environment):
        for request in requests:
            yield env.timeout(request.arrival_time - env.now)
            replica.driver.add_request(request)
            replica.tokens.admit(request.request_id)
            if replica.wakeup is not None and not replica.wakeup.triggered:
                replica.wakeup.succeed()

    env.process(arrive(env))
    env.process(pipelined_engine_process(env, replica, pipe))
    env.run()
    return list(replica.driver.recorder.steps), pipe, replica
