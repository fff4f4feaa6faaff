import pytest
from core_helpers import make_req, make_scheduler, run_to_completion, step

from twinserve.core import ModelRunnerOutput
from twinserve.core.policy import SchedulingPolicy
from twinserve.policies import available_policies, get_policy, registry


def admission_order(policy, reqs, **opts):
    s = make_scheduler(max_num_seqs=1, policy=policy, policy_options=opts)
    for r in reqs:
        s.add_request(r)
    order = []
    now = 0.0
    while s.has_unfinished_requests():
        out, _ = step(s, now)
        order += [sr.request_id for sr in out.scheduled if sr.start == 0]
        now += 1
    return order


def test_fcfs_admits_in_arrival_order():
    reqs = [make_req(f"r{i}", 4, max_tokens=1, arrival=float(i)) for i in range(5)]
    assert admission_order("fcfs", reqs) == ["r0", "r1", "r2", "r3", "r4"]


def test_priority_orders_by_priority_then_arrival():
    reqs = [make_req("a", 4, max_tokens=1, priority=2, arrival=0.0),
            make_req("b", 4, max_tokens=1, priority=0, arrival=1.0),
            make_req("c", 4, max_tokens=1, priority=1, arrival=2.0),
            make_req("d", 4, max_tokens=1, priority=0, arrival=3.0)]
    assert admission_order("priority", reqs) == ["b", "d", "c", "a"]


def test_priority_victim_is_lowest_priority_latest_arrival():
    policy = get_policy("priority")
    running = [make_req("a", 4, priority=1, arrival=0.0), make_req("b", 4, priority=3, arrival=1.0),
               make_req("c", 4, priority=3, arrival=2.0), make_req("d", 4, priority=0, arrival=3.0)]
    assert policy.select_victim(running).request_id == "c"
    assert get_policy("fcfs").select_victim(running).request_id == "d"


def test_waiting_high_priority_preempts_running_low_priority():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    s.add_request(make_req("low", 4, max_tokens=50, priority=5))
    step(s, 0.0)
    s.add_request(make_req("high", 4, max_tokens=2, priority=0, arrival=1.0))
    out, _ = step(s, 1.0)
    assert out.preempted_request_ids == ["low"]
    assert [sr.request_id for sr in out.scheduled] == ["high"]
    run_to_completion(s)
    # without the option, it waits
    s = make_scheduler(max_num_seqs=1, policy="priority", policy_options={"preempt_running": False})
    s.add_request(make_req("low", 4, max_tokens=5, priority=5))
    step(s, 0.0)
    s.add_request(make_req("high", 4, max_tokens=2, priority=0, arrival=1.0))
    out, _ = step(s, 1.0)
    assert out.preempted_request_ids == [] and [sr.request_id for sr in out.scheduled] == ["low"]


def test_sjf_admits_shortest_expected_output_first():
    reqs = [make_req("long", 4, max_tokens=50, arrival=0.0),
            make_req("short", 4, max_tokens=3, arrival=1.0),
            make_req("mid", 4, max_tokens=10, arrival=2.0)]
    reqs[0].hints["output_len_hint"] = 1.0  # a hint overrides max_tokens
    assert admission_order("sjf", reqs) == ["long", "short", "mid"]


def service_gap(policy: str) -> tuple[float, dict[str, int]]:
    """Heavy tenant floods the queue first; light tenant is backlogged too. Returns the largest
    gap in served tokens (input + 2 * output) while both are backlogged."""
    s = make_scheduler(num_blocks=400, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                       policy=policy)
    for i in range(60):
        s.add_request(make_req(f"h{i}", 16, max_tokens=16, tenant="heavy", arrival=0.0))
    for i in range(20):
        s.add_request(make_req(f"l{i}", 16, max_tokens=16, tenant="light", arrival=0.001))
    served = {"heavy": 0, "light": 0}
    left = {"heavy": 60, "light": 20}
    gap = 0.0
    now = 0.0
    while left["light"] and left["heavy"]:
        out = s.schedule(now)
        outs = s.update_from_output(out, ModelRunnerOutput(
            {sr.request_id: [7] for sr in out.scheduled if sr.sample}), now)
        for sr in out.scheduled:
            served[sr.request.tenant] += (sr.num_new_tokens if sr.is_prefill else 0) + 2 * sr.sample
        for o in outs:
            if o.finished:
                left["heavy" if o.request_id[0] == "h" else "light"] -= 1
        gap = max(gap, abs(served["heavy"] - served["light"]))
        now += 1
    return gap, served


def test_vtc_bounds_the_service_gap_where_fcfs_does_not():
    fcfs_gap, _ = service_gap("fcfs")
    fair_gap, served = service_gap("fair")
    # VTC's bound is a few requests' worth of service (max_num_seqs * request cost = 4 * 48)
    assert fair_gap <= 4 * 48
    assert fcfs_gap > 5 * fair_gap
    assert served["light"] > 0


def test_vtc_lifts_a_returning_tenant_to_the_backlogged_minimum():
    policy = get_policy("fair")
    policy.add(make_req("a1", 10, tenant="a"))
    policy.pop()
    policy.on_admit(make_req("a1x", 100, tenant="a"), 0.0, True)
    policy.add(make_req("a2", 10, tenant="a"))
    policy.add(make_req("b1", 10, tenant="b"))  # b is new: lifted to a's counter
    assert policy.counters["b"] == policy.counters["a"] == 100.0


def test_tenant_weights_share_service_in_proportion():
    policy = get_policy("fair", tenant_weights={"gold": 2.0})
    policy.counters.update({"gold": 0.0, "free": 0.0})
    policy.on_output_tokens(make_req("g", 4, tenant="gold"), 10)
    policy.on_output_tokens(make_req("f", 4, tenant="free"), 10)
    assert policy.counters["gold"] * 2 == policy.counters["free"]


def test_registry_lists_valid_names_and_loads_entry_points(monkeypatch):
    assert {"fcfs", "priority", "fair", "sjf"} <= set(available_policies())
    with pytest.raises(ValueError, match="valid: fair, fcfs, lora_affinity, priority, sjf"):
        get_policy("nope")
    with pytest.raises(ValueError, match="bad options"):
        get_policy("fcfs", bogus=1)

    class LIFO(SchedulingPolicy):
        def __init__(self):
            self.items = []
        def add(self, r): self.items.append(r)
        def peek(self): return self.items[-1] if self.items else None
        def pop(self): return self.items.pop()
        def remove(self, r): self.items.remove(r)
        def __len__(self): return len(self.items)

    class EP:
        name = "lifo"
        def load(self): return LIFO

    monkeypatch.setattr(registry, "entry_points", lambda group: [EP()] if group == "twinserve.policies" else [])
    reqs = [make_req(f"r{i}", 4, max_tokens=1) for i in range(3)]
    assert admission_order("lifo", reqs) == ["r2", "r1", "r0"]

    def no_scan(group):
        raise AssertionError("a built-in name scanned the entry points")

    monkeypatch.setattr(registry, "entry_points", no_scan)  # built-ins need no scan (start-up)
    assert get_policy("fcfs").name == "fcfs"


# ---- VTC's state: active tenants only, O(log tenants) per operation ------------------------------
class _ReferenceVTC(SchedulingPolicy):
    """VTC as first written: every tenant kept forever, O(tenants) scans (the oracle)."""

    accounts_tokens = True

    def __init__(self) -> None:
        from twinserve.core.policy import FifoQueue
        self._fifo = FifoQueue
        self.counters: dict[str, float] = {}
        self.queues: dict = {}
        self.last = 0.0

    def add(self, r, front=False):
        q = self.queues.setdefault(r.tenant, self._fifo())
        if len(q) == 0:
            others = [self.counters[t] for t, o in self.queues.items() if len(o) and t != r.tenant]
            floor = min(others) if others else self.last
            self.counters[r.tenant] = max(self.counters.get(r.tenant, 0.0), floor)
        (q.add_front if front else q.add)(r)

    def requeue(self, r):
        self.add(r, front=True)

    def _best(self):
        best = None
        for t, q in self.queues.items():
            if q.peek() is not None and (best is None or self.counters[t] < self.counters[best]):
                best = t
        return best

    def peek(self):
        t = self._best()
        return None if t is None else self.queues[t].peek()

    def pop(self):
        t = self._best()
        self.last = self.counters[t]
        return self.queues[t].pop()

    def remove(self, r):
        self.queues[r.tenant].remove(r)

    def __len__(self):
        return sum(len(q) for q in self.queues.values())

    def on_admit(self, r, now, first_time):
        if first_time:
            self.counters[r.tenant] += r.num_prompt_tokens

    def on_output_tokens(self, r, n):
        self.counters[r.tenant] += 2 * n

    def select_victim(self, running):
        top = max(self.counters[r.tenant] for r in running)
        return next(r for r in reversed(running) if self.counters[r.tenant] == top)


def _admissions(policy, seed: int) -> list[str]:
    """A random workload (every tenant's requests queued at the start, aborts, n > 1, memory
    pressure) run through the scheduler; the order in which requests are first admitted."""
    import random

    from twinserve.core import Scheduler, SchedulerConfig
    rng = random.Random(seed)
    s = Scheduler(SchedulerConfig(num_gpu_blocks=40, block_size=4, max_num_seqs=6,
                                  max_num_batched_tokens=48, max_model_len=128), policy)
    reqs = []
    for i in range(60):
        tenant = f"t{rng.randrange(12)}"
        n = rng.choice([1, 1, 1, 2])
        from twinserve.core import SamplingParams
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, n=n)
        reqs.append(make_req(f"r{i}", rng.randint(2, 20), tenant=tenant, params=params))
    for r in reqs:
        s.add_request(r)
    order, now = [], 0.0
    while s.has_unfinished_requests():
        out, _ = step(s, now)
        order += [sr.request_id for sr in out.scheduled if sr.start == 0]
        if rng.random() < 0.1 and s.num_waiting:
            victim = rng.choice(reqs)
            s.abort_requests([victim.request_id], now)
        now += 1
        assert now < 5000
    return order


@pytest.mark.parametrize("seed", range(8))
def test_vtc_admits_as_the_reference_while_no_tenant_returns(seed):
    from twinserve.policies.fair import VTCPolicy
    fast = VTCPolicy()
    assert _admissions(fast, seed) == _admissions(_ReferenceVTC(), seed)
    assert fast.num_tenants == 0 and not fast.counters and len(fast) == 0


def test_vtc_forgets_drained_tenants_and_costs_log_tenants_per_operation():
    from twinserve.policies.fair import VTCPolicy
    policy = VTCPolicy()
    num_tenants = 20_000
    reqs = [make_req(f"r{i}", 4, tenant=f"tenant-{i}") for i in range(num_tenants)]
    largest_heap = 0
    for r in reqs:
        policy.add(r)
        largest_heap = max(largest_heap, policy.heap_size)
    assert len(policy) == num_tenants and policy.num_tenants == num_tenants
    # one entry per backlogged tenant (plus bounded slack): peek/pop touch O(log tenants) levels
    assert largest_heap <= 2 * num_tenants + 64
    for i in range(num_tenants):
        request = policy.peek()
        assert request is not None
        assert policy.pop() is request
        policy.on_admit(request, 0.0, True)
        policy.on_output_tokens(request, 3)
        request.status = request.status.FINISHED_LENGTH_CAPPED
        policy.on_finish(request)
        assert policy.heap_size <= 2 * (num_tenants - i) + 64
    assert len(policy) == 0 and policy.peek() is None
    assert policy.num_tenants == 0 and policy.counters == {} and policy.heap_size == 0


def test_vtc_heap_stays_bounded_under_abort_churn():
    """Tenants that enter and leave the backlog by aborts leave stale heap entries behind;
    the heap is rebuilt before they outnumber the backlogged tenants."""
    from twinserve.policies.fair import VTCPolicy
    policy = VTCPolicy()
    keep = [make_req(f"k{i}", 4, tenant=f"keep-{i}") for i in range(10)]
    for r in keep:
        policy.add(r)
    for i in range(5_000):
        r = make_req(f"c{i}", 4, tenant=f"churn-{i}")
        policy.add(r)
        r.status = r.status.FINISHED_ABORTED
        policy.on_finish(r)
        policy.remove(r)
        assert policy.heap_size <= 2 * 11 + 64
    assert policy.num_tenants == 10 and len(policy) == 10


def test_vtc_returning_tenant_is_lifted_to_the_floor():
    from twinserve.policies.fair import VTCPolicy
    policy = VTCPolicy()
    a, b = make_req("a", 10, tenant="a"), make_req("b", 10, tenant="b")
    policy.add(a)
    policy.add(b)
    first = policy.pop()
    policy.on_admit(first, 0.0, True)
    first.status = first.status.FINISHED_STOPPED
    policy.on_finish(first)  # a has nothing left: forgotten
    assert set(policy.counters) == {"b"}
    policy.add(make_req("a2", 10, tenant="a"))
    assert policy.counters["a"] == policy.counters["b"] == 0.0  # b is the backlogged minimum
