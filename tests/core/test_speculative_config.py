"""SpeculativeConfig (vLLM's keys, refusals by name) and its way through EngineArgs, the CLI
flag, a --config YAML file and the engine config; the scheduler's per-request rules
(structured outputs get no drafts; LoRA requests do)."""

from __future__ import annotations

import argparse

import pytest
from core_helpers import make_req

from twinserve.core import SamplingParams, SchedulerConfig
from twinserve.core.engine_args import EngineArgs
from twinserve.core.scheduler import Scheduler
from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.core.structured_outputs import StructuredOutputsParams
from twinserve.entrypoints.engine_args import (
    add_engine_args,
    apply_config_file,
    engine_args_from,
)
from twinserve.policies import get_policy
from twinserve.policies.speculation import FixedSpeculation


def test_vllm_keys_and_defaults():
    spec = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 4, '
                                       '"prompt_lookup_max": 5}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 5)
    assert spec.policy == "adaptive" and spec.rejection_sample_method == "probabilistic"
    assert SpeculativeConfig.from_dict({"model": "/d", "num_speculative_tokens": 2}).method == \
        "draft_model"  # vLLM: a model without a method is a draft model
    synthetic = SpeculativeConfig.from_dict({"num_speculative_tokens": 3,
                                             "rejection_sample_method": "synthetic",
                                             "synthetic_acceptance_rate": [0.9, 0.5]})
    assert synthetic.acceptance_rates == (0.9, 0.5, 0.5)
    assert synthetic.to_dict()["synthetic_acceptance_rate"] == [0.9, 0.5]


@pytest.mark.parametrize("data, match", [
    ({"method": "eagle"}, "'eagle' is not implemented in twinserve"),
    ({"method": "mtp"}, "'mtp' is not implemented in twinserve"),
    ({"method": "medusa"}, "'medusa' is not implemented in twinserve"),
    ({"method": "ngram", "num_speculative_token": 3}, "unknown key.*num_speculative_token"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"model": "/d", "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
    ({"method": "draft_model"}, "model is required"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"rejection_sample_method": "synthetic"}, "synthetic_acceptance_rate is required"),
    ({"synthetic_acceptance_rate": 0.5}, "synthetic_acceptance_rate is required"),
    ({"rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 1.5},
     r"in \[0, 1\]"),
    ({"rejection_sample_method": "typical"}, "rejection_sample_method"),
])
def test_bad_configs_are_refused_by_name(data, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(data)


def test_engine_args_cli_and_yaml_reach_the_scheduler_config(tmp_path):
    args = EngineArgs(speculative_config={"num_speculative_tokens": 3, "policy": "fixed"})
    assert isinstance(args.speculative_config, SpeculativeConfig)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cli = engine_args_from(parser.parse_args(
        ["--speculative-config", '{"method": "suffix", "num_speculative_tokens": 5}']))
    assert cli.speculation == SpeculativeConfig(method="suffix", num_speculative_tokens=5)
    yaml_file = tmp_path / "engine.yaml"
    yaml_file.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    from_file = engine_args_from(apply_config_file(parser, ["--config", str(yaml_file)]))
    assert from_file.speculation.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="speculative_config.method 'eagle3' is not implemented"):
        EngineArgs.from_mapping({"speculative_config": {"method": "eagle3"}}, "engine.yaml")


def test_engine_config_records_speculation():
    from twinserve.simulator import SimConfig
    from twinserve.simulator.run import build_engine_config
    spec = {"num_speculative_tokens": 4, "policy": "fixed"}
    build = build_engine_config(SimConfig(EngineArgs(speculative_config=spec)))
    sched = build.engine_config.scheduler
    assert (sched.num_speculative_tokens, sched.speculation_policy) == (4, "fixed")
    recorded = build.engine_config.to_dict()
    assert recorded["speculative_config"]["num_speculative_tokens"] == 4
    assert build_engine_config(SimConfig()).engine_config.scheduler.num_speculative_tokens == 0


def test_scheduler_needs_a_policy_when_speculation_is_on():
    with pytest.raises(ValueError, match="needs a speculation policy"):
        Scheduler(SchedulerConfig(num_gpu_blocks=8, num_speculative_tokens=2), get_policy("fcfs"))


def _first_decode_entries(sched: Scheduler):
    out = sched.schedule(0.0)  # prefill
    sampled = {sr.request_id: [7] for sr in out.scheduled if sr.sample}
    sched.update_from_output(out, _with_drafts(out, sampled), 0.1)
    return sched.schedule(0.2)


def _with_drafts(out, sampled):
    from twinserve.core import ModelRunnerOutput
    return ModelRunnerOutput(sampled, spec_token_ids={
        sr.request_id: [7] * sr.num_draft_next for sr in out.scheduled if sr.num_draft_next})


def test_structured_requests_get_no_drafts_and_lora_requests_do():
    config = SchedulerConfig(num_gpu_blocks=64, block_size=4, max_num_batched_tokens=64,
                             num_speculative_tokens=3, max_loras=1)
    sched = Scheduler(config, get_policy("fcfs"), speculation=FixedSpeculation(3))
    grammar = SamplingParams(max_tokens=20, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    sched.add_request(make_req("g", 6, params=grammar))
    sched.add_request(make_req("l", 6, max_tokens=20, lora="ad"))
    sched.add_request(make_req("p", 6, max_tokens=20))
    out = _first_decode_entries(sched)
    spec = {sr.request_id: len(sr.spec_token_ids) for sr in out.scheduled}
    assert spec == {"g": 0, "l": 3, "p": 3}
    assert {sr.request_id: sr.num_draft_next for sr in out.scheduled}["g"] == 0
