"""The twin's multi-LoRA: the workload's adapters (--loras, a trace column), the cost model's LoRA
terms and adapter loads, max_loras in simulation, the lora_affinity policy, and the CLI."""

import json
import math

import pytest
from core_helpers import make_req

from twinserve.core.lora import PEFT_TARGET_MODULES, LoRASlots
from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.entrypoints.cli.main import main
from twinserve.policies import get_policy
from twinserve.simulator import SimConfig, simulate
from twinserve.simulator import run as sim_run
from twinserve.simulator.cost_model import (
    LORA_FEATURE_NAMES,
    CostModel,
    FittedCostModel,
    fit_step_time,
    step_features,
)
from twinserve.simulator.hardware import load_hardware
from twinserve.simulator.lora_cost import LoRACost, lora_elements_per_rank, lora_step_features
from twinserve.simulator.lora_run import LoadTally
from twinserve.simulator.model_spec import load_model_spec
from twinserve.traces import AdapterShape, LoRAAdapters, TraceRequest, assign_loras, load_trace
from twinserve.traces.lora import parse_loras, parse_target_modules

MODEL, HW = load_model_spec("llama-3.1-8b"), load_hardware("h100")


def _lora_cost(rank: int = 16, modules=PEFT_TARGET_MODULES, **kw) -> LoRACost:
    return LoRACost(MODEL, HW, LoRAAdapters(AdapterShape(rank, modules)), rank, **kw)


def _step(*chunks: tuple[str | None, int], loads=()) -> SchedulerOutput:
    """A step of decodes/prefill chunks: (adapter, new tokens) each, with 2000 tokens of context."""
    scheduled, tokens = [], 0
    for i, (lora, n) in enumerate(chunks):
        req = make_req(f"r{i}", 2000, lora=lora)
        scheduled.append(ScheduledRequest(req, 2000 - n, n, [], True))
        tokens += n
    return SchedulerOutput(scheduled, tokens, num_decode_tokens=tokens, num_decode_seqs=len(chunks),
                           sum_context_tokens=2000 * len(chunks),
                           sum_decode_context_tokens=2000 * len(chunks), max_decode_context=2000,
                           lora_loads=tuple(loads))


# ---- the workload -----------------------------------------------------------------------------
def test_loras_flag_counts_weights_ranks_and_the_base_share() -> None:
    weights, ranks = parse_loras("3,big=2:64,base=1")
    assert weights == {"lora0": 1.0, "lora1": 1.0, "lora2": 1.0, "big": 2.0, "base": 1.0}
    assert ranks == {"big": 64}
    with pytest.raises(ValueError, match="NAME=WEIGHT"):
        parse_loras("a=x")
    assert parse_target_modules("all") == PEFT_TARGET_MODULES
    assert parse_target_modules("v_proj,q_proj") == ("q_proj", "v_proj")  # canonical order


def test_assign_loras_is_seeded_and_independent_of_the_tenant_draw() -> None:
    reqs = load_trace("azure-conv")[:2000]
    a = assign_loras(reqs, {"x": 1.0, "y": 1.0, "base": 2.0}, seed=3)
    assert a == assign_loras(reqs, {"x": 1.0, "y": 1.0, "base": 2.0}, seed=3)
    share = sum(r.lora is None for r in a) / len(a)
    assert share == pytest.approx(0.5, abs=0.05)
    from twinserve.traces import assign_tenants
    t = assign_tenants(reqs, {"x": 1.0, "y": 1.0, "base": 2.0}, seed=3)
    assert [r.tenant for r in t] != [r.lora or "base" for r in a]  # not the same index stream


def test_a_plain_trace_carries_the_adapter_column(tmp_path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_time_s,input_tokens,output_tokens,lora\n0,10,5,sql\n1,10,5,\n")
    reqs = load_trace(path)
    assert [r.lora for r in reqs] == ["sql", None]
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"arrival_time_s": 0, "input_tokens": 5, "output_tokens": 2,
                               "lora": "a", "adapter": "b"}) + "\n")
    with pytest.raises(ValueError, match="lora or adapter, not both"):
        load_trace(bad)


# ---- the cost model ---------------------------------------------------------------------------
def test_lora_terms_are_zero_without_adapters() -> None:
    base, lora = CostModel(MODEL, HW), CostModel(MODEL, HW, lora=_lora_cost())
    out = _step((None, 1), (None, 1), (None, 300))
    assert lora.step_time(out) == base.step_time(out)
    assert lora.breakdown(out).lora_s == 0.0 and lora.breakdown(out).lora_load_s == 0.0


def test_lora_terms_grow_with_rank_adapters_and_tokens() -> None:
    def lora_s(out, rank=16, **kw):
        model = CostModel(MODEL, HW, lora=_lora_cost(rank, **kw))
        cost = model.breakdown(out)
        assert model.step_time(out) == cost.total_s
        return cost.lora_s

    one = _step(("a", 1), ("a", 1))
    assert 0 < lora_s(one, 8) < lora_s(one) < lora_s(one, 64)
    assert lora_s(one) < lora_s(_step(("a", 1), ("b", 1)))  # a second adapter's weights
    big = _step(("a", 4000))  # compute-bound: FLOPs grow with the tokens
    assert lora_s(big) > lora_s(_step(("a", 2000))) > lora_s(one)
    assert lora_s(one, modules=("q_proj", "v_proj")) < lora_s(one)


def test_lora_flops_and_bytes_follow_the_shapes() -> None:
    # Llama-3-8B: sum over the seven projections of in + out = 81,920 per layer, 32 layers
    assert lora_elements_per_rank(MODEL, PEFT_TARGET_MODULES) == 81_920 * 32
    assert lora_elements_per_rank(MODEL, ("q_proj",)) == (4096 + 4096) * 32
    # tensor parallelism: q keeps A whole and splits B; o splits A and keeps B
    assert lora_elements_per_rank(MODEL, ("q_proj", "o_proj"), 2) == (4096 + 2048 + 2048 + 4096) * 32
    work = _lora_cost().work(_step(("a", 3), ("a", 2), ("b", 1)))
    assert work.num_adapters == 2
    assert work.flops == 2 * 6 * 16 * 81_920 * 32
    assert work.weight_bytes == 2 * 16 * 81_920 * 32 * 2  # two adapters' A and B in bf16


def test_steps_charge_the_padded_rank_and_loads_the_adapters_own() -> None:
    cost = LoRACost(MODEL, HW, LoRAAdapters(AdapterShape(8)), max_lora_rank=32)
    per_token, step_bytes, load_bytes = cost.terms("a")
    assert step_bytes == 4 * load_bytes  # slots of max_lora_rank rows, as vLLM's
    unpadded = LoRACost(MODEL, HW, LoRAAdapters(AdapterShape(8)), 32, pad_to_max_rank=False)
    assert unpadded.terms("a")[1] == load_bytes
    with pytest.raises(ValueError, match="above max_lora_rank"):
        LoRACost(MODEL, HW, LoRAAdapters(AdapterShape(64)), 16).terms("a")


def test_load_time_is_adapter_bytes_over_the_host_to_device_bandwidth() -> None:
    model = CostModel(MODEL, HW, lora=_lora_cost())
    adapter_bytes = 16 * 81_920 * 32 * 2  # ~84 MB: a rank-16 all-projection Llama-3-8B adapter
    out = _step(("a", 1), ("b", 1), loads=[("a", 0), ("b", 1)])
    assert model.breakdown(out).lora_load_s == pytest.approx(2 * adapter_bytes / HW.pcie_bandwidth)
    assert HW.pcie_bandwidth == 50e9  # PCIe Gen5 x16 (A100 profiles: Gen4, 25 GB/s)
    assert load_hardware("a100").pcie_bandwidth == 25e9
    # two loads into one slot in one step: the later replaces the earlier
    assert model.lora_load_time([("a", 0), ("b", 0)]) == pytest.approx(adapter_bytes / 50e9)
    no_load = model.step_time(_step(("a", 1), ("b", 1)))
    assert model.step_time(out) == pytest.approx(no_load + 2 * adapter_bytes / 50e9)


def test_profile_lora_fields_scale_the_terms() -> None:
    from dataclasses import replace
    out = _step(("a", 1), ("b", 1))
    slow = replace(HW, lora_efficiency=0.5, lora_step_overhead_s=1e-3, lora_per_adapter_s=1e-4)
    base = LoRACost(MODEL, HW).forward_time(LoRACost(MODEL, HW).work(out))
    scaled = LoRACost(MODEL, slow)
    assert scaled.forward_time(scaled.work(out)) == pytest.approx(2 * base + 1e-3 + 2e-4)
    with pytest.raises(ValueError, match="lora_efficiency"):
        replace(HW, lora_efficiency=1.5)


def test_fits_take_lora_features_when_samples_carry_them() -> None:
    cost = _lora_cost()
    plain = [(step_features(_step((None, n))), 0.01 + 1e-5 * n) for n in (1, 8, 64, 512)]
    params = fit_step_time(plain, MODEL.name)
    assert not set(LORA_FEATURE_NAMES) & set(params.coefficients)
    fitted = FittedCostModel(params, CostModel(MODEL, HW, lora=cost))
    out = _step(("a", 8))
    assert fitted.lora_time(cost.work(out)) == cost.forward_time(cost.work(out))  # roofline's
    samples = list(plain)
    for n, k in ((1, 1), (8, 2), (64, 1), (512, 2)):
        step = _step(*((f"a{i}", n) for i in range(k)))
        work = cost.work(step)
        samples.append(({**step_features(step), **lora_step_features(work)},
                        0.01 + 1e-5 * n * k + 2e-3 * k))
    lora_params = fit_step_time(samples, MODEL.name)
    assert set(LORA_FEATURE_NAMES) <= set(lora_params.coefficients)
    lora_fit = FittedCostModel(lora_params, CostModel(MODEL, HW, lora=cost))
    two = _step(("a0", 8), ("a1", 8))
    assert lora_fit.step_time(two) == pytest.approx(0.01 + 1e-5 * 16 + 4e-3, rel=0.05)


# ---- simulation ---------------------------------------------------------------------------------
def _cycling_trace(n: int = 120, adapters: int = 8, gap: float = 0.05) -> list[TraceRequest]:
    return [TraceRequest(f"q{i}", i * gap, 200, 20, lora=f"l{i % adapters}") for i in range(n)]


def test_simulation_never_exceeds_max_loras_and_charges_loads(monkeypatch) -> None:
    seen: list[int] = []

    class Checked(LoadTally):
        def step_time(self, out):
            seen.append(len({sr.request.lora for sr in out.scheduled} - {None}))
            return super().step_time(out)

    monkeypatch.setattr(sim_run, "LoadTally", Checked)
    loads = {}
    for max_loras in (2, 8):
        cfg = SimConfig(model="llama-3.1-8b", hardware="h100-sxm", enable_lora=True,
                        max_loras=max_loras)
        result = simulate(cfg, _cycling_trace())
        s = result.summary
        assert s["completed"] == 120 and max(seen) <= max_loras
        loads[max_loras] = s["lora_loads"]
        per_load = 16 * 81_920 * 32 * 2 / 50e9
        assert s["lora_load_time_s"] == pytest.approx(s["lora_loads"] * per_load)
        assert s["num_lora_adapters"] == 8 and s["lora_request_share"] == 1.0
        assert set(s["lora_mean_ttft_ms"]) == {f"l{i}" for i in range(8)}
        seen.clear()
    assert loads[8] == 8 < loads[2]  # 8 slots hold every adapter: each is loaded once


def test_adapter_steps_take_longer_than_the_base_models() -> None:
    trace = [TraceRequest(f"q{i}", 0.0, 100, 50, lora=f"l{i % 4}") for i in range(32)]
    base = simulate(SimConfig(model="llama-3.1-8b", hardware="h100-sxm"),
                    [TraceRequest(r.request_id, 0.0, 100, 50) for r in trace])
    lora = simulate(SimConfig(model="llama-3.1-8b", hardware="h100-sxm", enable_lora=True,
                              max_loras=4), trace)
    assert lora.summary["duration"] > base.summary["duration"]
    assert "lora_loads" not in base.summary


def test_adapters_without_enable_lora_are_refused() -> None:
    with pytest.raises(ValueError, match="add --enable-lora"):
        simulate(SimConfig(model="llama-3.1-8b", hardware="h100-sxm"), _cycling_trace(4))


# ---- the policy --------------------------------------------------------------------------------
def _policy(max_loras: int | None = 2, **options):
    policy = get_policy("lora_affinity", **options)
    slots = LoRASlots(max_loras) if max_loras else None
    if slots is not None:
        policy.attach_lora_slots(slots)
    return policy, slots


def _drain(policy) -> list[str]:
    taken = []
    while policy.peek() is not None:
        taken.append(policy.pop())
    for r in reversed(taken):
        policy.unpop(r)
    return [r.request_id for r in taken]


def test_without_lora_it_is_fcfs() -> None:
    policy, _ = _policy(None)
    reqs = [make_req(f"r{i}", 4, arrival=i, lora=None) for i in range(4)]
    for r in reqs:
        policy.add(r)
    assert policy.pop() is reqs[0] and policy.pop() is reqs[1]
    policy.requeue(reqs[1])  # preempted: back at the front
    assert _drain(policy) == ["r1", "r2", "r3"] and len(policy) == 3


def test_resident_adapters_and_the_base_model_go_first_in_arrival_order() -> None:
    policy, slots = _policy(2)
    slots.acquire("x")
    slots.release("x")  # x resident, idle
    for rid, lora in (("a", "y"), ("b", "x"), ("c", None), ("d", "y"), ("e", "x")):
        policy.add(make_req(rid, 4, lora=lora))
    policy.on_schedule(0.0)
    assert _drain(policy) == ["b", "c", "e", "a", "d"]
    assert _drain(policy) == ["b", "c", "e", "a", "d"]  # unpop puts them back where they were


def test_an_overdue_request_goes_first() -> None:
    policy, slots = _policy(2, max_wait_s=1.0)
    slots.acquire("x")
    policy.add(make_req("old", 4, arrival=0.0, lora="y"))
    policy.add(make_req("warm", 4, arrival=0.5, lora="x"))
    policy.on_schedule(0.9)
    assert policy.peek().request_id == "warm"
    policy.on_schedule(1.1)
    assert policy.peek().request_id == "old"


def test_an_overdue_request_without_a_slot_closes_an_adapter_until_it_drains() -> None:
    policy, slots = _policy(1, max_wait_s=1.0)
    running = make_req("run", 4, lora="x")
    slots.acquire("x")
    policy.on_admit(running, 0.0, True)
    for rid, lora, t in (("cold", "y", 0.0), ("hot", "x", 0.5), ("plain", None, 0.6)):
        policy.add(make_req(rid, 4, arrival=t, lora=lora))
    policy.on_schedule(2.0)
    cold = policy.pop()  # the scheduler passes it over: no slot for y
    assert cold.request_id == "cold" and not slots.can_acquire("y")
    assert policy.pop().request_id == "plain"  # base requests still run; "hot" does not
    assert policy.peek() is None
    policy.unpop(cold)
    policy.on_schedule(2.1)
    assert policy.peek().request_id == "cold"
    slots.release("x")  # "run" finished: x drained, its slot is free
    policy.on_finish(running)
    assert policy.pop().request_id == "cold" and slots.can_acquire("y")


def test_policy_options_are_checked() -> None:
    with pytest.raises(ValueError, match="max_wait_s"):
        get_policy("lora_affinity", max_wait_s=-1)
    assert get_policy("lora_affinity", max_wait_s=math.inf).max_wait_s == math.inf


def test_the_wait_bound_keeps_a_cold_adapter_from_starving() -> None:
    # one slot; a hot adapter's requests arrive faster than they finish, a cold one comes once
    hot = [TraceRequest(f"h{i}", 0.05 * i, 64, 100, lora="hot") for i in range(400)]
    trace = sorted([*hot, TraceRequest("cold", 1.0, 64, 10, lora="cold")],
                   key=lambda r: r.arrival_time)

    def cold_ttft(policy: str) -> float:
        cfg = SimConfig(model="llama-3.1-8b", hardware="h100-sxm", enable_lora=True, max_loras=1,
                        scheduling_policy=policy, policy_options={"max_wait_s": 1.0}
                        if policy == "lora_affinity" else {})
        records = simulate(cfg, trace).records
        return next(r.ttft for r in records if r.request_id == "cold")

    assert cold_ttft("fcfs") > 15.0  # served once the hot stream ends
    assert cold_ttft("lora_affinity") < 1.0 + 3.0  # the bound, then the hot requests drain


# ---- the command line and the report -----------------------------------------------------------
def test_cli_simulates_adapters_and_reports_policies(tmp_path, capsys) -> None:
    runs = []
    for policy in ("fcfs", "lora_affinity"):
        out = tmp_path / policy
        rc = main(["simulate", "--num-requests", "60", "--model", "llama-3.1-8b", "--enable-lora",
                   "--max-loras", "4", "--loras", "8,base=1", "--lora-rank", "8",
                   "--policy", policy, "--out", str(out), "--disable-tqdm"])
        assert rc == 0
        summary = json.loads((out / "summary.json").read_text())
        assert summary["lora_loads"] >= 4 and summary["completed"] == 60
        assert json.loads((out / "config.json").read_text())["loras"] == "8,base=1"
        from twinserve.reports.runs import read_requests
        adapters = set(read_requests(out / "requests.csv")["lora"])  # "" for the base model
        assert "" in adapters and {f"lora{k}" for k in range(8)} >= adapters - {""} != set()
        runs.append(str(out))
    html = tmp_path / "report.html"
    assert main(["report", *runs, "--out", str(html)]) == 0
    assert "lora_loads" in html.read_text()


def test_cli_refuses_adapters_without_enable_lora(tmp_path, capsys) -> None:
    rc = main(["simulate", "--num-requests", "10", "--loras", "4", "--out", str(tmp_path / "r"),
               "--disable-tqdm"])
    err = capsys.readouterr().err
    assert rc == 2 and "add --enable-lora" in err and "Traceback" not in err
