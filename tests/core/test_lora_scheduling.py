"""The shared scheduler's LoRA rules: at most ``max_loras`` distinct adapters run in any step, the
adapters' device slots are loaded and evicted as ``SchedulerOutput.lora_loads`` says, requests
passed over keep their place, and nothing leaks."""

from collections import Counter

import pytest
from core_helpers import make_req, make_scheduler, run_to_completion, step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinserve.core import ModelRunnerOutput, RequestStatus, SamplingParams
from twinserve.core.lora import LoRAConfig, LoRARequest, LoRASlots


def test_slots_pin_running_adapters_and_evict_the_least_recently_released() -> None:
    slots = LoRASlots(2)
    assert slots.acquire("a") == 0 and slots.acquire("b") == 1
    assert slots.take_loads() == [("a", 0), ("b", 1)]
    assert not slots.can_acquire("c") and slots.can_acquire("a")
    slots.acquire("a")
    slots.release("a")
    assert slots.num_active == 2  # one request of "a" still runs
    slots.release("a")
    slots.release("b")
    assert slots.acquire("a") == 0 and slots.take_loads() == []  # still resident: no load
    assert slots.acquire("c") == 1  # "b" was the only idle one
    assert slots.take_loads() == [("c", 1)] and not slots.is_resident("b")
    with pytest.raises(RuntimeError, match="exceeds max_loras"):
        slots.acquire("d")


def test_lora_request_and_config_validate() -> None:
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "/p")
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)


def test_adapter_requests_are_refused_without_lora() -> None:
    s = make_scheduler()
    with pytest.raises(ValueError, match="LoRA adapter 'x' but LoRA is not enabled"):
        s.add_request(make_req("a", 8, lora="x"))


def test_a_request_whose_adapter_has_no_slot_is_passed_over_and_keeps_its_place() -> None:
    s = make_scheduler(max_loras=1)
    for rid, lora in (("a", "x"), ("b", "y"), ("c", "x"), ("d", None), ("e", "y")):
        s.add_request(make_req(rid, 8, max_tokens=3, lora=lora))
    out, _ = step(s, 0.0)
    assert [sr.request_id for sr in out.scheduled] == ["a", "c", "d"]
    assert out.lora_loads == [("x", 0)]
    assert [r.request_id for r in _drain(s.policy)] == ["b", "e"]


def _drain(policy):
    taken = []
    while policy.peek() is not None:
        taken.append(policy.pop())
    for request in reversed(taken):
        policy.unpop(request)
    return taken


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf", "fair", "static", "lora_affinity"])
def test_every_policy_puts_passed_over_requests_back_in_order(policy) -> None:
    s = make_scheduler(max_loras=1, policy=policy)
    for k in range(6):
        s.add_request(make_req(f"r{k}", 6, max_tokens=2, lora="x" if k % 3 == 0 else "y",
                               tenant=f"t{k % 2}"))
    before = [r.request_id for r in _drain(s.policy)]
    _drain(s.policy)
    assert [r.request_id for r in _drain(s.policy)] == before  # unpop undoes pop exactly
    run_to_completion(s)
    assert s.loras.num_active == 0 and not s.requests


op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 8), st.integers(0, 6),
              st.integers(1, 2)),
    st.tuples(st.just("step"), st.integers(0, 6)),
    st.tuples(st.just("abort"), st.integers(0, 40)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=50), max_loras=st.integers(1, 3),
       policy=st.sampled_from(["fcfs", "priority", "fair", "sjf", "lora_affinity"]),
       mode=st.sampled_from(["recompute", "swap"]), caching=st.booleans())
def test_random_workloads_never_exceed_max_loras(ops, max_loras, policy, mode, caching) -> None:
    s = make_scheduler(num_blocks=20, block_size=4, max_num_seqs=5, max_num_batched_tokens=40,
                       max_model_len=40, policy=policy, preemption_mode=mode, num_cpu_blocks=8,
                       enable_prefix_caching=caching, max_loras=max_loras)
    device: dict[int, str] = {}  # what a backend applying lora_loads holds in each slot
    added: list[str] = []
    now = 0.0

    def one_step(token: int) -> None:
        out = s.schedule(now)
        for lora, slot in out.lora_loads:
            device[slot] = lora
        adapters = {sr.request.lora for sr in out.scheduled} - {None}
        assert len(adapters) <= max_loras
        running = {r.lora for r in s.running} - {None}
        assert len(running) <= max_loras and set(s.loras.users) == running
        for lora in adapters:
            assert device[s.loras.slot_of[lora]] == lora  # the slot holds the right weights
        waiting = Counter(r.lora for r in s.requests.values() if r.status != RequestStatus.RUNNING)
        assert s.loras.num_base_waiting == waiting.pop(None, 0) and s.loras.waiting == waiting
        s.update_from_output(out, ModelRunnerOutput(
            {sr.request_id: [token] for sr in out.scheduled if sr.sample}), now + 0.01)

    for o in ops:
        if o[0] == "add":
            _, plen, max_tokens, adapter, n = o
            rid = f"r{len(added)}"
            s.add_request(make_req(rid, plen, arrival=now, tenant=f"t{adapter % 2}",
                                   priority=adapter % 3, lora=None if adapter == 0 else f"a{adapter}",
                                   params=SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)))
            added.append(rid)
        elif o[0] == "step":
            one_step(o[1])
        elif added:
            s.abort_requests([added[o[1] % len(added)]], now)
        now += 0.01
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        one_step(3)
        now += 0.01
    assert not s.has_unfinished_requests()
    assert s.loras.num_active == 0 and s.kv.pool.free_queue.num_free == 20
    assert not s.loras.waiting and s.loras.num_base_waiting == 0
