"""best.yaml against serve and simulate, memory pruning, bad input refused by name, the command."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from twinserve.entrypoints.cli.main import build_parser, main, parse_args
from twinserve.entrypoints.engine_args import engine_args_from
from twinserve.planner.output import _sim_of, best_config, vllm_command, write_best
from twinserve.planner.pareto import Searched, capacity_bound, is_dominated, pareto_mask
from twinserve.planner.plan import PRUNED
from twinserve.planner.space import Candidate, PlanSpace, memory_verdict
from twinserve.planner.spec import parse_plan
from twinserve.simulator.run import SimConfig, build_engine_config

BASE = {"model": "llama-3-8b", "hardware": ["h100-sxm"], "max_gpus": 2,
        "workload": {"num_requests": 200, "duration_s": 5}, "slo": {"ttft_p90_ms": 2000}}


def _row(**changes) -> dict:
    row = {"hardware": "h100-sxm", "tensor_parallel_size": 2, "pipeline_parallel_size": 1,
           "num_replicas": 2, "router": "cache-aware", "max_num_seqs": 64,
           "max_num_batched_tokens": 2048, "enable_chunked_prefill": True,
           "scheduling_policy": "fcfs", "quantization": None, "speculative_config": None,
           "capacity_rps": 12.5, "cost_per_m_output_tokens": 0.3, "gpus": 4}
    return {**row, **changes}


def test_best_yaml_gives_serve_and_simulate_the_same_configuration(tmp_path) -> None:
    spec = parse_plan({**BASE, "max_gpus": 4})
    path = tmp_path / "best.yaml"
    written = write_best(_row(), spec, path)
    text = path.read_text()
    assert text.startswith("# capacity_rps: 12.5\n") and "# vLLM: vllm serve llama-3-8b" in text
    assert yaml.safe_load(text) == written
    resolved = {}
    for command in ("serve", "simulate"):
        args = parse_args(build_parser(only=command), [command, "--config", str(path)])
        engine = engine_args_from(args, model=args.model)
        # simulate's own --router (the twin's replicas) takes the key; serve's is the engine's
        router = args.router if command == "simulate" else engine.router
        resolved[command] = (engine.replace(router=router), args.hardware)
    assert resolved["serve"] == resolved["simulate"]
    engine, hardware = resolved["simulate"]
    assert (hardware, engine.tensor_parallel_size, engine.data_parallel_size, engine.router,
            engine.max_num_seqs) == ("h100-sxm", 2, 2, "cache-aware", 64)


def test_the_vllm_line_names_vllm_flags_only() -> None:
    config = best_config(_row(scheduling_policy="fair"), parse_plan({**BASE, "max_gpus": 4}))
    line = vllm_command(config)
    assert "--tensor-parallel-size 2" in line and "--data-parallel-size 2" in line
    assert "fair" not in line and "--router" not in line


def test_memory_prunes_what_cannot_hold_the_weights_or_one_request() -> None:
    seventy = dict(pipeline_parallel_size=1, num_replicas=1, router="round-robin", engine=())
    assert "no memory is left" in memory_verdict(
        Candidate("a100-80gb", tensor_parallel_size=1, **seventy), "llama-3-70b", {}, 1000)
    assert memory_verdict(Candidate("a100-80gb", tensor_parallel_size=2, **seventy),
                          "llama-3-70b", {}, 1000) == ""
    reason = memory_verdict(Candidate("a100-80gb", tensor_parallel_size=2, **seventy), "llama-3-70b",
                            {}, 10_000_000)
    assert "KV cache holds" in reason


def test_a_plan_marks_pruned_configurations(tmp_path) -> None:
    from twinserve.planner.plan import run_plan
    spec = parse_plan({**BASE, "model": "llama-3-70b", "hardware": ["a100-80gb"], "max_gpus": 2,
                       "space": {"pipeline_parallel_size": [1], "max_num_seqs": [64],
                                 "max_num_batched_tokens": [2048]},
                       "search": {"tolerance": 0.5, "max_rps": 4}})
    result = run_plan(spec, tmp_path)
    status = {r["name"].split(" enable")[0]: r["status"] for r in result.rows}
    assert status["a100-80gb tp1 pp1 x1"] == PRUNED and status["a100-80gb tp1 pp1 x2 round-robin"] == PRUNED
    assert status["a100-80gb tp2 pp1 x1"] != PRUNED


def test_the_space_respects_gpus_and_nodes() -> None:
    space = PlanSpace("llama-3-8b", ("h100-sxm",), max_gpus=8, max_num_seqs=(64,),
                      max_num_batched_tokens=(2048,))
    cands = list(space.candidates())
    assert all(c.gpus <= 8 for c in cands)
    assert all(c.router == "round-robin" for c in cands if c.num_replicas == 1)
    assert {c.tensor_parallel_size for c in cands} == {1, 2, 4, 8}
    assert len({c.candidate_id for c in cands}) == len(cands)


def test_the_bound_and_the_fronts() -> None:
    key = ("h100-sxm", ())
    searched = [Searched(key, 1, 10.0), Searched(key, 2, 16.0), Searched(("a100-80gb", ()), 1, 50.0)]
    assert capacity_bound(key, 4, searched, 1.5) == pytest.approx(1.5 * 10.0 * 4)
    assert capacity_bound(key, 1, searched, 1.5) is None  # nothing smaller
    assert capacity_bound(key, 4, searched, 0) is None
    assert is_dominated(60.0, 4, 3.5, best_per_dollar=5.0)  # 60 / 14 < 5
    assert not is_dominated(60.0, 4, 3.5, best_per_dollar=4.0)
    assert pareto_mask([(1, 5), (2, 4), (1, 4), (3, 1), (float("nan"), 9)], (True, True)) == \
        [True, True, False, True, False]


@pytest.mark.parametrize(("change", "message"), [
    ({"hardware": ["b200"]}, "hardware 'b200'"),
    ({"slo": {"ttft_p90": 2000}}, "slo key 'ttft_p90'"),
    ({"slo": {"latency_ms": 5}}, "slo key 'latency_ms'"),
    ({"slo": {"ttft_p90_ms": -1}}, "ttft_p90_ms"),
    ({"max_gpus": 0}, "max_gpus"),
    ({"model": "gpt-9"}, "unknown model 'gpt-9'"),
    ({"prices": {"h100-sxm": 0}}, "price of 'h100-sxm'"),
    ({"space": {"tensor_parallel_sizes": [1]}}, "space.tensor_parallel_sizes: unknown key"),
    ({"space": {"router": ["teleport"]}}, "routers: unknown value 'teleport'"),
    ({"space": {"prefill_instances": [1]}}, "space.prefill_instances: unknown key"),
    ({"space": {"disaggregation": ["1P0D"]}}, "disaggregation: expected 'off' or xPyD"),
    ({"space": {"disaggregation": ["PD"]}}, "disaggregation: expected 'off' or xPyD"),
    ({"space": {"disaggregation": [2]}}, "disaggregation: expected 'off' or xPyD"),
    ({"space": {"max_pd_instances": 1}}, "max_pd_instances: xPyD needs"),
    ({"space": {"max_pd_instances": "4"}}, "max_pd_instances: expected an integer"),
    ({"space": {"kv_link": ["warp"]}}, "kv_links: unknown value 'warp'"),
    ({"space": {"disaggregation": ["1P1D"]}, "engine": {"kv_offloading_size": 4}},
     "kv_offloading_size cannot run with disaggregated"),
    ({"space": {"quantization": ["gptq"]}}, "quantizations: unknown value 'gptq'"),
    ({"search": {"tolerance": 0}}, "tolerance"),
    ({"attainment": 1.5}, "attainment"),
    ({"hardware": ["a100-40gb"]}, "no price for hardware"),
    ({"workload": {"num_apps": 4}}, "workload.num_apps: applies only to trace multi-app"),
    ({"workload": {"trace": "multi-app", "num_apps": 0}}, "workload.num_apps: num_apps must"),
    ({"workload": {"trace": "multi-app", "system_len_min": 90, "system_len_max": 80}},
     "workload.system_len_max"),
    ({"workload": {"trace": "multi-app", "apps": 4}}, "workload.apps: unknown key"),
    ({"workload": {"trace": "multi-app", "seed": -1}}, "workload.seed: seed must be"),
])
def test_bad_input_is_refused_by_name(change, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        parse_plan({**BASE, **change}, "plan.yaml")


def test_a_multi_app_plan_generates_its_workload_from_the_flags(tmp_path) -> None:
    """``--trace multi-app`` and its settings (the workload routers differ on): the plan's
    requests are that workload, and its settings are part of a replay's fingerprint."""
    from twinserve.entrypoints.cli.plan import plan_mapping
    from twinserve.planner.plan import _fingerprint, plan_trace
    from twinserve.traces.multi_app import MultiAppConfig, multi_app_trace
    flags = ["plan", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--max-gpus", "2",
             "--slo", "ttft_p90_ms=2000", "--trace", "multi-app", "--num-requests", "300",
             "--num-apps", "40", "--zipf-s", "0.8", "--system-len-max", "512",
             "--out", str(tmp_path)]
    spec = parse_plan(*plan_mapping(parse_args(build_parser(only="plan"), flags)))
    assert plan_trace(spec) == multi_app_trace(MultiAppConfig(
        num_requests=300, num_apps=40, zipf_s=0.8, system_len_max=512))
    seeded = parse_plan(*plan_mapping(parse_args(build_parser(only="plan"), [*flags, "--seed", "3"])))
    assert plan_trace(seeded) == multi_app_trace(MultiAppConfig(
        num_requests=300, num_apps=40, zipf_s=0.8, system_len_max=512, seed=3))
    other = parse_plan(*plan_mapping(parse_args(build_parser(only="plan"),
                                                [*flags, "--num-apps", "41"])))
    assert _fingerprint(spec, 300) != _fingerprint(other, 300)
    assert len(plan_trace(parse_plan({**BASE, "workload": {"trace": "multi-app"}}))) == 10_000


def test_the_command_refuses_bad_flags_by_name(tmp_path, capsys) -> None:
    code = main(["plan", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--max-gpus", "1",
                 "--slo", "ttft_p90=2000", "--out", str(tmp_path)])
    assert code == 2 and "slo key 'ttft_p90'" in capsys.readouterr().err
    code = main(["plan", "--model", "llama-3-8b", "--hardware", "h100-sxm", "--max-gpus", "2",
                 "--slo", "ttft_p90_ms=2000", "--disaggregation", "off,2P", "--out", str(tmp_path)])
    assert code == 2 and "disaggregation: expected 'off' or xPyD" in capsys.readouterr().err


def _pd_space(**changes) -> PlanSpace:
    axes = {"max_num_seqs": (64,), "max_num_batched_tokens": (2048,), **changes}
    return PlanSpace("llama-3-8b", ("h100-sxm",), **axes)


def test_the_space_adds_xpyd_deployments() -> None:
    cands = list(_pd_space(max_gpus=6, tensor_parallel_sizes=(1, 2), pipeline_parallel_sizes=(1, 2),
                           max_pd_instances=3, speculative_configs=(None, {"method": "ngram",
                                                                            "num_speculative_tokens": 3}),
                           gpus_per_node=4).candidates())
    pd = [c for c in cands if c.disaggregated]
    shapes = {(c.tensor_parallel_size, c.prefill_instances, c.decode_instances, c.kv_link) for c in pd}
    # tp 1: 1P1D, 2P1D, 1P2D within a node; tp 2: 1P1D (4 GPUs, one node), 2P1D/1P2D (6: across)
    assert shapes == {(1, 1, 1, None), (1, 2, 1, None), (1, 1, 2, None), (2, 1, 1, None),
                      (2, 2, 1, "infiniband"), (2, 1, 2, "infiniband")}
    assert all(c.pipeline_parallel_size == 1 and c.num_replicas == 1 for c in pd)
    assert all(dict(c.engine)["speculative_config"] is None for c in pd)  # the fleet has no drafts
    assert all(c.gpus == c.tensor_parallel_size * (c.prefill_instances + c.decode_instances) <= 6
               for c in pd)
    assert len({c.candidate_id for c in cands}) == len(cands)
    assert [c for c in cands if not c.disaggregated] == list(_pd_space(
        max_gpus=6, tensor_parallel_sizes=(1, 2), pipeline_parallel_sizes=(1, 2), gpus_per_node=4,
        speculative_configs=(None, {"method": "ngram", "num_speculative_tokens": 3})).candidates())
    only = list(_pd_space(max_gpus=4, disaggregation=("2P1D",), kv_links=("auto", "pcie")).candidates())
    assert {(c.prefill_instances, c.decode_instances, c.kv_link) for c in only} == \
        {(2, 1, None), (2, 1, "pcie")}


def test_a_spec_file_names_the_pd_axis(tmp_path) -> None:
    from twinserve.planner.spec import load_plan_file
    path = tmp_path / "plan.yaml"  # a bare off is YAML's false
    path.write_text(yaml.safe_dump(BASE, sort_keys=False) + "space:\n  disaggregation: [off, 2P1D]\n"
                    "  max_pd_instances: 2\n  kv_link: [auto, pcie]\n")
    space = parse_plan(load_plan_file(path), str(path)).space
    assert space.disaggregation == ("off", "2P1D") and space.kv_links == ("auto", "pcie")
    assert space.pd_shapes == [(2, 1), (1, 1)]


def test_the_bound_never_crosses_deployment_shapes() -> None:
    engine = (("max_num_seqs", 64),)
    one = Candidate("h100-sxm", 1, 1, 1, "round-robin", engine, 1, 1)
    two = Candidate("h100-sxm", 1, 1, 1, "round-robin", engine, 2, 2)
    skew = Candidate("h100-sxm", 1, 1, 1, "round-robin", engine, 2, 1)
    replicas = Candidate("h100-sxm", 1, 1, 4, "round-robin", engine)
    assert one.replica_key == two.replica_key != skew.replica_key
    assert replicas.replica_key not in (one.replica_key, skew.replica_key)
    searched = [Searched(one.replica_key, one.gpus, 100.0),
                Searched(Candidate("h100-sxm", 1, 1, 1, "round-robin", engine).replica_key, 1, 90.0)]
    assert capacity_bound(two.replica_key, two.gpus, searched, 1.5) == pytest.approx(1.5 * 50 * 4)
    assert capacity_bound(skew.replica_key, skew.gpus, searched, 1.5) is None
    assert capacity_bound(replicas.replica_key, 4, searched, 1.5) == pytest.approx(1.5 * 90 * 4)


def test_memory_prunes_each_pool() -> None:
    pd = Candidate("a100-80gb", 1, 1, 1, "round-robin", (), 1, 1)
    assert memory_verdict(pd, "llama-3-8b", {}, 1000, 900) == ""
    assert "per decode instance" in memory_verdict(pd, "llama-3-8b", {}, 10_000_000, 900)
    assert "per prefill instance" in memory_verdict(pd, "llama-3-8b", {}, 10_000_000, 9_000_000)
    # a link the profile has no preset of
    assert "kv_link 'infiniband'" in memory_verdict(
        Candidate("cpu", 1, 1, 1, "round-robin", (), 1, 1, "infiniband"), "smollm2-135m", {}, 100)


def test_a_disaggregated_best_yaml_gives_simulate_the_planned_configuration(tmp_path) -> None:
    spec = parse_plan({**BASE, "max_gpus": 4, "space": {"disaggregation": ["2P1D"]}})
    row = _row(tensor_parallel_size=1, num_replicas=1, router="round-robin", gpus=3,
               prefill_instances=2, decode_instances=1, kv_link="infiniband")
    path = tmp_path / "best.yaml"
    written = write_best(row, spec, path)
    text = path.read_text()
    assert (written["prefill_instances"], written["decode_instances"], written["kv_link"]) == \
        (2, 1, "infiniband")
    assert written["data_parallel_size"] == 1 and "as 2P1D" in text and "replicas behind" not in text
    assert text.count("--kv-transfer-config") == 2 and "# vLLM prefill x2: vllm serve" in text
    assert "# vLLM decode x1: vllm serve" in text and "proxy" in text
    out = tmp_path / "run"
    assert main(["simulate", "--config", str(path), "--num-requests", "20", "--out", str(out),
                 "--disable-tqdm"]) == 0
    ran = json.loads((out / "config.json").read_text())
    planned = SimConfig.from_flat(_sim_of(row, spec))
    assert {k: ran[k] for k in ("prefill_instances", "decode_instances", "kv_link", "hardware")} == \
        {"prefill_instances": 2, "decode_instances": 1, "kv_link": "infiniband", "hardware": "h100-sxm"}
    resolved = build_engine_config(planned).engine_config.to_dict()
    assert {k: ran[k] for k in resolved} == json.loads(json.dumps(resolved, default=str))


def test_the_command_writes_the_plan(tmp_path, capsys) -> None:
    spec = tmp_path / "plan.yaml"
    spec.write_text(yaml.safe_dump({**BASE, "max_gpus": 1, "space": {"max_num_seqs": [64, 128],
                                    "max_num_batched_tokens": [2048]}}))
    out = tmp_path / "out"
    code = main(["plan", "--spec", str(spec), "--slo", "ttft_p90_ms=1500", "--slo", "tpot_p99_ms=80",
                 "--out", str(out), "--workers", "1", "--verify-top", "1"])
    printed = capsys.readouterr().out
    assert code == 0
    for name in ("plan.csv", "front.csv", "best.yaml", "plan.html", "verify.csv"):
        assert (out / name).is_file(), name
    assert "tpot_p99_ms=80" in (out / "best.yaml").read_text()
    page = (out / "plan.html").read_text()
    assert 'data-plots-expected="3"' in page and "Top configurations" in page
    plan = pd.read_csv(out / "plan.csv")
    assert set(plan["status"]) <= {"fitted", "no-capacity", "dominated", "pruned-memory"}
    assert {"capacity_rps", "cost_per_m_output_tokens", "output_tokens_per_s_per_gpu",
            "output_tokens_per_s_per_user", "prefill_instances", "decode_instances",
            "kv_link"} <= set(plan.columns)
    assert "needs 1 x h100-sxm" in printed or "checkpoint" in printed  # not verifiable here


def test_the_example_spec_parses() -> None:
    from twinserve.planner.spec import load_plan_file
    path = Path(__file__).resolve().parents[2] / "examples" / "plan_azure.yaml"
    spec = parse_plan(load_plan_file(path), str(path))
    assert spec.space.hardware == ("a100-80gb", "h100-sxm", "h200")
    assert [s.key for s in spec.slos] == ["ttft_p90_ms", "tpot_p99_ms"]
    assert spec.duration_s == 60.0 and spec.price("h100-sxm") == 3.5


def test_only_what_this_machine_runs_is_verifiable() -> None:
    import torch

    from twinserve.entrypoints.cli.plan_verify import verifiable
    gpu = {"hardware": "h100-sxm", "gpus": 2}
    cpu = {"hardware": "cpu", "gpus": 1}
    assert "checkpoint" in verifiable(gpu, "llama-3-8b")
    if torch.cuda.is_available():
        pytest.skip("the CPU cases assume a machine without CUDA")
    assert "needs 2 x h100-sxm (cuda); this machine has cpu" in verifiable(gpu, "smollm2-135m")
    assert verifiable(cpu, "smollm2-135m") == ""
    assert "needs 2 devices" in verifiable({**cpu, "gpus": 2}, "smollm2-135m")


def test_serve_refuses_an_unknown_planned_hardware() -> None:
    from twinserve.entrypoints.openai.server import warn_other_hardware
    with pytest.raises(ValueError, match="b200"):
        warn_other_hardware("b200")


def test_a_calibrated_profile_file_is_planned_by_its_path(tmp_path) -> None:
    import shutil

    from twinserve.simulator import hardware
    profile = tmp_path / "my-cpu.json"
    shutil.copy(Path(hardware.__file__).parent / "data" / "hardware" / "cpu.json", profile)
    spec = parse_plan({**BASE, "model": "smollm2-135m", "hardware": [str(profile)],
                       "prices": {"cpu": 0.05}})
    assert spec.space.hardware == (str(profile),)
    assert spec.price(str(profile)) == 0.05  # priced by the profile's name


def test_a_calibrated_profile_is_priced_by_its_own_name(tmp_path) -> None:
    import json

    from twinserve.simulator import hardware
    data = json.loads((Path(hardware.__file__).parent / "data" / "hardware" / "cpu.json").read_text())
    profile = tmp_path / "calibrated.json"
    profile.write_text(json.dumps({**data, "name": "cpu-calibrated"}))
    spec = parse_plan({**BASE, "model": "smollm2-135m", "hardware": [str(profile)],
                       "prices": {"cpu-calibrated": 0.07}})
    assert spec.price(str(profile)) == 0.07
    with pytest.raises(ValueError, match="no price for hardware"):
        parse_plan({**BASE, "model": "smollm2-135m", "hardware": [str(profile)],
                    "prices": {"cpu": 0.05}}).price(str(profile))


POOLED = {"max_num_seqs": (64,), "max_num_batched_tokens": (2048,), "max_gpus": 2,
          "tensor_parallel_sizes": (1,), "pipeline_parallel_sizes": (1,),
          "disaggregation": ("off", "1P1D")}


def test_the_pool_axes_make_xpyd_candidates_only() -> None:
    plain = list(_pd_space(**POOLED).candidates())
    cands = list(_pd_space(**POOLED, prefill_max_num_batched_tokens=(None, 8192),
                           decode_max_num_seqs=(None, 64, 128)).candidates())
    aggregated = [c for c in cands if not c.disaggregated]
    assert aggregated == [c for c in plain if not c.disaggregated]  # untouched, ids and all
    pools = {(c.prefill_args, c.decode_args) for c in cands if c.disaggregated}
    # decode 64 is the deployment's own max_num_seqs: no override, not searched twice
    assert pools == {((), ()), ((), (("max_num_seqs", 128),)),
                     ((("max_num_batched_tokens", 8192),), ()),
                     ((("max_num_batched_tokens", 8192),), (("max_num_seqs", 128),))}
    assert len({c.candidate_id for c in cands}) == len(cands)
    # an xPyD deployment without overrides keeps its id
    assert {c.candidate_id for c in cands if c.disaggregated and not c.prefill_args
            and not c.decode_args} == {c.candidate_id for c in plain if c.disaggregated}
    pooled = next(c for c in cands if c.prefill_args and c.decode_args)
    assert pooled.settings["prefill_max_num_batched_tokens"] == 8192
    assert pooled.settings["decode_max_num_seqs"] == 128 and pooled.settings["decode_max_num_batched_tokens"] is None
    assert pooled.sim("llama-3-8b", {})["decode_args"] == {"max_num_seqs": 128}
    assert "decode.max_num_seqs=128" in pooled.name
    assert len({c.replica_key for c in cands if c.disaggregated}) == 4  # no bound across pools
    # without chunked prefill a pool's token budget is no override either
    unchunked = list(_pd_space(**POOLED, enable_chunked_prefill=(False,),
                               prefill_max_num_batched_tokens=(8192,)).candidates())
    assert all(c.prefill_args == () for c in unchunked)


def test_memory_is_checked_with_each_pool_s_own_limits() -> None:
    engine = (("enable_chunked_prefill", True), ("max_num_batched_tokens", 2048), ("max_num_seqs", 64))

    def pd(prefill=(), decode=()):
        return Candidate("a100-80gb", 1, 1, 1, "round-robin", engine, 1, 1, None, prefill, decode)
    huge = (("max_num_batched_tokens", 262_144),)  # its activations leave ~228k tokens of KV
    assert memory_verdict(pd(), "llama-3-8b", {}, 300_000, 299_000) == ""
    assert "per prefill instance" in memory_verdict(pd(prefill=huge), "llama-3-8b", {}, 300_000, 299_000)
    assert "per decode instance" in memory_verdict(pd(decode=huge), "llama-3-8b", {}, 300_000, 1000)
    assert memory_verdict(pd(decode=huge), "llama-3-8b", {}, 200_000, 1000) == ""
    assert memory_verdict(pd(prefill=(("max_num_batched_tokens", 1_000_000),)), "llama-3-8b", {},
                          1000, 900).startswith("prefill_args: no memory is left")


def test_the_pool_axes_come_from_flags_and_spec_files(tmp_path) -> None:
    from twinserve.entrypoints.cli.plan import plan_mapping
    from twinserve.planner.spec import load_plan_file
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(BASE, sort_keys=False) + "space:\n  disaggregation: [1P1D]\n"
                    "  prefill_max_num_batched_tokens: [none, 8192]\n  decode_max_num_seqs: [null, 32]\n")
    space = parse_plan(load_plan_file(path), str(path)).space
    assert space.prefill_max_num_batched_tokens == (None, 8192) and space.decode_max_num_seqs == (None, 32)
    args = parse_args(build_parser(only="plan"), [
        "plan", "--spec", str(path), "--decode-max-num-seqs", "16,none",
        "--prefill-max-num-seqs", "4", "--out", str(tmp_path)])
    space = parse_plan(*plan_mapping(args)).space
    assert (space.decode_max_num_seqs, space.prefill_max_num_seqs) == ((16, None), (4,))
    assert space.prefill_max_num_batched_tokens == (None, 8192)  # the file's, kept
    with pytest.raises(ValueError, match="decode_max_num_seqs: expected an integer >= 1"):
        parse_plan({**BASE, "space": {"decode_max_num_seqs": [0]}})
    with pytest.raises(ValueError, match="--decode-max-num-seqs: expected int"):
        plan_mapping(parse_args(build_parser(only="plan"), [
            "plan", "--spec", str(path), "--decode-max-num-seqs", "many", "--out", str(tmp_path)]))


def test_a_best_yaml_with_pool_arguments_resolves_in_simulate_and_serve(tmp_path) -> None:
    spec = parse_plan({**BASE, "space": {"disaggregation": ["1P1D"]}})
    row = _row(tensor_parallel_size=1, num_replicas=1, router="round-robin", gpus=2,
               prefill_instances=1, decode_instances=1, kv_link=None,
               prefill_max_num_batched_tokens=8192, prefill_max_num_seqs=None,
               decode_max_num_seqs=128, decode_max_num_batched_tokens=None)
    path = tmp_path / "best.yaml"
    written = write_best(row, spec, path)
    assert (written["prefill_args"], written["decode_args"]) == \
        ({"max_num_batched_tokens": 8192}, {"max_num_seqs": 128})
    text = path.read_text()
    prefill_line = next(line for line in text.splitlines() if line.startswith("# vLLM prefill"))
    decode_line = next(line for line in text.splitlines() if line.startswith("# vLLM decode"))
    assert "--max-num-batched-tokens 8192" in prefill_line and "--max-num-seqs 64" in prefill_line
    assert "--max-num-seqs 128" in decode_line and "--max-num-batched-tokens 2048" in decode_line
    from twinserve.entrypoints.pd_front import PDDeployment, instance_args
    serve = parse_args(build_parser(only="serve"), ["serve", "--config", str(path)])
    pd = PDDeployment.of(*(getattr(serve, k) for k in ("prefill_instances", "decode_instances",
                                                       "prefill_args", "decode_args")))
    prefill, decode = instance_args(engine_args_from(serve, model=serve.model), pd)  # serve's
    assert (prefill.max_num_batched_tokens, prefill.max_num_seqs) == (8192, 64)
    assert (decode.max_num_batched_tokens, decode.max_num_seqs) == (2048, 128)
    out = tmp_path / "run"
    assert main(["simulate", "--config", str(path), "--num-requests", "20", "--out", str(out),
                 "--disable-tqdm"]) == 0
    ran = json.loads((out / "config.json").read_text())
    assert (ran["prefill_args"], ran["decode_args"]) == (written["prefill_args"], written["decode_args"])
    assert ran["max_num_seqs"] == 64


def test_acceptance_profiles_are_one_file_or_several_merged(tmp_path) -> None:
    from twinserve.entrypoints.cli.plan import plan_mapping
    from twinserve.planner.verify import TwinSide
    from twinserve.simulator.acceptance import AcceptanceProfile
    files = [str(AcceptanceProfile.from_totals(n, 100, 400, a).save(tmp_path / f"{n}.json"))
             for n, a in (("edits", 300), ("chat", 60))]
    assert parse_plan({**BASE, "search": {"acceptance_profile": files[0]}}).acceptance_profile \
        == (files[0],)
    assert parse_plan(BASE).acceptance_profile == ()
    for bad in ([], [files[0], 3], {"a": 1}):
        with pytest.raises(ValueError, match="search.acceptance_profile: expected a file name"):
            parse_plan({**BASE, "search": {"acceptance_profile": bad}})
    args = parse_args(build_parser(only="plan"), ["plan", "--model", "llama-3-8b", "--max-gpus", "2", "--hardware",
                      "h100-sxm", "--slo", "ttft_p90_ms=2000", "--acceptance-profile", *files,
                      "--out", str(tmp_path / "out")])
    spec = parse_plan(*plan_mapping(args))
    assert spec.acceptance_profile == tuple(files)
    merged = TwinSide(spec, tmp_path / "out")._acceptance  # what the verified replays draw
    assert merged is not None and merged.workload == "edits + chat"
    assert merged.num_accepted_tokens == 360


def test_a_capacity_found_only_as_a_lower_bound_says_so(tmp_path, capsys) -> None:
    # 40 requests over 20 s hold at most 1.95 req/s: an H100 passes there, and the search ends
    spec = tmp_path / "plan.yaml"
    spec.write_text(yaml.safe_dump({**BASE, "max_gpus": 1, "workload": {"num_requests": 40,
                                    "duration_s": 20}, "space": {"max_num_seqs": [64]}}))
    out = tmp_path / "out"
    assert main(["plan", "--spec", str(spec), "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    plan = pd.read_csv(out / "plan.csv")
    fitted = plan[plan["status"] == "fitted"]
    assert len(fitted) and fitted["capacity_lower_bound"].all()
    assert (fitted["capacity_rps"] < 1.95).all()
    assert ">= " in printed and "pass at the highest rate searched" in printed
    assert "most 40 requests hold" in printed
    assert "(a lower bound" in (out / "best.yaml").read_text().splitlines()[0]
    assert "pass at the highest rate searched" in (out / "plan.html").read_text()


def test_a_capacity_found_inside_the_grid_is_no_bound() -> None:
    from twinserve.planner.output import capacity_text, lower_bound_note
    row = {"capacity_rps": 3.25, "capacity_lower_bound": False}
    assert capacity_text(row) == "3.25" and lower_bound_note([row], 100) is None
    assert capacity_text({**row, "capacity_lower_bound": True}) == ">= 3.25"
