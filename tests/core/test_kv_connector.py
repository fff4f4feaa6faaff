"""The KV connector's scheduler side: a consumer loads a producer's prompt KV and decodes the
same tokens a single engine would; no block leaks after aborts, failed loads or timed-out sends."""

import json

import pytest
from core_helpers import make_req
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kv_fakes import FakeKVBackend, FakePeerWorker, pd_step

from twinserve.core import RequestStatus, SamplingParams, Scheduler, SchedulerConfig
from twinserve.core.engine_args import EngineArgs
from twinserve.core.kv_connector import PeerConnectorScheduler, make_connector_scheduler
from twinserve.core.kv_transfer_config import KVTransferConfig
from twinserve.policies import get_policy

BS = 4


def pd_scheduler(role: str, engine_id: str, num_blocks: int = 32, policy: str = "recompute",
                 **kwargs) -> Scheduler:
    cfg = KVTransferConfig(kv_role=role, engine_id=engine_id, kv_load_failure_policy=policy)
    config = SchedulerConfig(num_gpu_blocks=num_blocks, block_size=BS, max_num_seqs=4,
                             max_num_batched_tokens=kwargs.pop("max_num_batched_tokens", 64),
                             max_model_len=128, **kwargs)
    return Scheduler(config, get_policy("fcfs"), kv_connector=make_connector_scheduler(cfg, BS))


class Pair:
    """One producer and one consumer engine with their fake caches and workers."""

    def __init__(self, auto: bool = True, policy: str = "recompute", **kwargs) -> None:
        peers: dict = {}
        self.p = pd_scheduler("kv_producer", "P", policy=policy, **kwargs)
        self.d = pd_scheduler("kv_consumer", "D", policy=policy, **kwargs)
        self.pb, self.db = FakeKVBackend(BS), FakeKVBackend(BS)
        self.pw = FakePeerWorker("P", self.pb, peers)
        self.dw = FakePeerWorker("D", self.db, peers, auto=auto)
        self.now = 0.0
        self.p_prompts: dict[str, list[int]] = {}

    def prefill(self, rid: str, prompt: list[int]) -> dict:
        req = make_req(rid, len(prompt), prefix=prompt, params=SamplingParams(max_tokens=1,
                       ignore_eos=True), kv_transfer_params={"do_remote_decode": True})
        self.p.add_request(req)
        while True:
            _, outs = self.step_p()
            done = [o for o in outs if o.request_id == rid and o.finished]
            if done:
                assert done[0].kv_transfer_params is not None
                self.step_p()  # its worker publishes the blocks before any reader asks
                return done[0].kv_transfer_params

    def step_p(self):
        self.now += 1.0
        return pd_step(self.p, self.pb, self.pw, self.now)

    def step_d(self):
        self.now += 1.0
        return pd_step(self.d, self.db, self.dw, self.now)

    def assert_no_leak(self) -> None:
        for s in (self.p, self.d):
            s.kv.check_consistency()
            assert not s.kv.tables and not s.sending and not s.waiting_for_remote
            assert s.kv.num_free_blocks == s.config.num_gpu_blocks
            assert not s.has_unfinished_requests()


def reference_tokens(prompt: list[int], max_tokens: int, **kwargs) -> list[int]:
    config = SchedulerConfig(num_gpu_blocks=32, block_size=BS, max_num_seqs=4,
                             max_num_batched_tokens=kwargs.pop("max_num_batched_tokens", 64),
                             max_model_len=128, **kwargs)
    s, backend = Scheduler(config, get_policy("fcfs")), FakeKVBackend(BS)
    req = make_req("x", len(prompt), prefix=prompt,
                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    s.add_request(req)
    now = 0.0
    while s.has_unfinished_requests():
        out = s.schedule(now)
        s.update_from_output(out, backend.execute(out), now)
        now += 1.0
    return list(req.output_token_ids)


def decode_request(rid: str, prompt: list[int], params: dict, max_tokens: int = 5):
    return make_req(rid, len(prompt), prefix=prompt, kv_transfer_params=params,
                    params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


@pytest.mark.parametrize("prompt_len", [3, 8, 10, 17])
@pytest.mark.parametrize("chunk", [64, 5])
def test_a_consumer_loads_the_prompt_then_decodes_the_single_engine_tokens(prompt_len, chunk):
    prompt = [100 + 3 * i for i in range(prompt_len)]
    want = reference_tokens(prompt, 5, max_num_batched_tokens=chunk)
    pair = Pair(max_num_batched_tokens=chunk)
    params = pair.prefill("a", prompt)
    assert params["remote_engine_id"] == "P" and params["remote_num_tokens"] == prompt_len
    assert params["remote_block_ids"] == pair.p.kv.tables["a"].ids  # kept for the reader
    assert "a" in pair.p.sending and len(params["remote_block_ids"]) == -(-prompt_len // BS)
    req = decode_request("a", prompt, params)
    pair.d.add_request(req)
    out, _ = pair.step_d()  # a load ordered and (this worker is quick) reported in one step
    assert not out.scheduled and req.status == RequestStatus.WAITING
    assert req.num_computed_tokens == prompt_len - 1
    assert len(out.kv_connector_metadata.loads) == 1
    while pair.d.has_unfinished_requests() or pair.p.has_unfinished_requests():
        pair.step_d()
        pair.step_p()  # the producer learns the read is done and frees its blocks
    assert req.output_token_ids == want
    assert req.num_cached_tokens == 0
    pair.assert_no_leak()


def test_the_consumer_recomputes_only_the_last_prompt_token_and_caches_the_loaded_blocks():
    prompt = list(range(200, 212))  # three full blocks
    pair = Pair()
    params = pair.prefill("a", prompt)
    req = decode_request("a", prompt, params, max_tokens=3)
    pair.d.add_request(req)
    pair.step_d()  # the load is ordered and reported: requeued first in line
    out, _ = pair.step_d()
    (sr,) = out.scheduled
    assert (sr.start, sr.num_new_tokens) == (11, 1)
    # the loaded full blocks are in the consumer's prefix cache: a twin prompt hits them
    twin = make_req("b", 12, prefix=prompt, params=SamplingParams(max_tokens=1, ignore_eos=True))
    pair.d.add_request(twin)
    pair.step_d()
    assert twin.num_cached_tokens == 8  # two whole blocks; the last token is always computed


def test_local_prefix_hits_are_not_loaded_again():
    prompt = list(range(300, 314))
    pair = Pair()
    pair.d.add_request(make_req("warm", 9, prefix=prompt[:9],
                                params=SamplingParams(max_tokens=1, ignore_eos=True)))
    while pair.d.has_unfinished_requests():
        pair.step_d()
    params = pair.prefill("a", prompt)
    req = decode_request("a", prompt, params)
    pair.d.add_request(req)
    out, _ = pair.step_d()
    (load,) = out.kv_connector_metadata.loads
    assert req.num_cached_tokens == 8 and load.remote_block_ids == params["remote_block_ids"][2:]
    while pair.d.has_unfinished_requests() or pair.p.has_unfinished_requests():
        pair.step_d()
        pair.step_p()
    assert req.output_token_ids == reference_tokens(prompt, 5)
    pair.assert_no_leak()


def test_abort_while_waiting_for_remote_kvs_frees_blocks_and_cancels_the_load():
    pair = Pair(auto=False)
    prompt = list(range(50, 60))
    req = decode_request("a", prompt, pair.prefill("a", prompt))
    pair.d.add_request(req)
    pair.step_d()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not pair.d.running
    assert pair.d.kv.num_free_blocks < 32 and pair.d.has_unfinished_requests()
    assert len(pair.d.policy) == 0 and pair.d.num_queued == 1
    (out,) = pair.d.abort_requests(["a"], pair.now)
    assert out.finished and out.finish_reason == "abort"
    sched_out, _ = pair.step_d()
    assert sched_out.kv_connector_metadata.cancelled == ["a"]
    pair.step_p()  # the worker's cancel released the producer's blocks
    pair.assert_no_leak()


def test_a_failed_load_recomputes_the_prompt_under_the_recompute_policy():
    pair = Pair(auto=False)
    prompt = list(range(70, 81))
    req = decode_request("a", prompt, pair.prefill("a", prompt))
    pair.d.add_request(req)
    pair.step_d()
    pair.dw.fail("a")
    out, _ = pair.step_d()
    assert req.status == RequestStatus.WAITING and req.num_computed_tokens == 0
    pair.dw.auto = True
    while pair.d.has_unfinished_requests() or pair.p.has_unfinished_requests():
        pair.step_d()
        pair.step_p()
    assert req.output_token_ids == reference_tokens(prompt, 5)
    pair.assert_no_leak()


def test_a_failed_load_ends_the_request_with_an_error_under_the_fail_policy():
    pair = Pair(auto=False, policy="fail")
    prompt = list(range(70, 81))
    req = decode_request("a", prompt, pair.prefill("a", prompt))
    pair.d.add_request(req)
    pair.step_d()
    pair.dw.fail("a")
    _, outs = pair.step_d()
    (out,) = outs
    assert out.finished and out.finish_reason == "error" and "'P'" in out.error
    assert req.status == RequestStatus.FINISHED_ERROR and not req.output_token_ids
    pair.step_p()
    pair.assert_no_leak()
    assert pair.d.num_queued == 0 and pair.d.num_queued_tokens == 0


def test_a_send_nobody_reads_is_freed_when_the_worker_reports_its_timeout():
    pair = Pair()
    pair.prefill("a", list(range(10)))
    assert pair.p.has_unfinished_requests()  # the send is pending: the loop keeps polling
    out, _ = pair.step_p()
    assert not out.scheduled and "a" in pair.p.sending
    pair.pw.release("a")  # the worker's transfer_timeout_s ran out
    pair.step_p()
    pair.assert_no_leak()


def test_a_producer_request_aborted_before_it_finishes_publishes_nothing():
    pair = Pair()
    req = make_req("a", 20, params=SamplingParams(max_tokens=1, ignore_eos=True),
                   kv_transfer_params={"do_remote_decode": True})
    pair.p.add_request(req)
    (out,) = pair.p.abort_requests(["a"], 0.0)
    assert out.kv_transfer_params is None and not pair.p.sending
    pair.assert_no_leak()


def test_kv_transfer_params_need_a_connector_and_valid_keys():
    plain = Scheduler(SchedulerConfig(num_gpu_blocks=8, block_size=BS), get_policy("fcfs"))
    with pytest.raises(ValueError, match="kv_transfer_params needs"):
        plain.add_request(make_req("a", 5, kv_transfer_params={"do_remote_decode": True}))
    s = pd_scheduler("kv_consumer", "D")
    with pytest.raises(ValueError, match="remote_block_ids"):
        s.add_request(make_req("a", 5, kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "h",
            "remote_port": 1, "remote_request_id": "a", "remote_num_tokens": 5}))
    with pytest.raises(ValueError, match="do_remote_decode must be a boolean"):
        s.add_request(make_req("b", 5, kv_transfer_params={"do_remote_decode": "yes"}))
    with pytest.raises(ValueError, match="kv_transfer_params must be a mapping"):
        make_req("c", 5, kv_transfer_params=[1])


def test_the_kv_transfer_config_refuses_what_it_does_not_implement_by_name():
    with pytest.raises(ValueError, match="NixlConnector.*not implemented"):
        KVTransferConfig(kv_connector="NixlConnector")
    with pytest.raises(ValueError, match="unknown key.*kv_buffer_size"):
        KVTransferConfig.from_dict({"kv_buffer_size": 1})
    with pytest.raises(ValueError, match="extra_config: unknown key.*backends"):
        KVTransferConfig(kv_connector_extra_config={"backends": ["UCX"]})
    with pytest.raises(ValueError, match="transfer_timeout_s"):
        KVTransferConfig(kv_connector_extra_config={"transfer_timeout_s": 0})
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig(kv_role="producer")
    with pytest.raises(ValueError, match="kv_port"):
        KVTransferConfig(kv_port=70000)
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_json("{kv_role")
    cfg = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "PeerConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"transfer_timeout_s": 2.5}}))
    assert cfg.transfer_timeout_s == 2.5 and cfg.is_producer and not cfg.is_consumer
    assert cfg.engine_id.startswith("engine-") and cfg.engine_id != KVTransferConfig().engine_id


def test_engine_args_accept_a_kv_transfer_config_as_json_or_mapping():
    args = EngineArgs(kv_transfer_config='{"kv_role": "kv_consumer", "engine_id": "d0"}')
    assert args.kv_transfer_config == KVTransferConfig(kv_role="kv_consumer", engine_id="d0")
    args = EngineArgs.from_mapping({"kv-transfer-config": {"kv_role": "kv_both", "engine_id": "x"}})
    assert isinstance(args.kv_transfer_config, KVTransferConfig)
    with pytest.raises(ValueError, match="kv_transfer_config.kv_role"):
        EngineArgs(kv_transfer_config={"kv_role": "both"})
    assert EngineArgs().kv_transfer_config is None


def test_make_connector_scheduler_builds_the_peer_side():
    side = make_connector_scheduler(KVTransferConfig(engine_id="e"), 16)
    assert isinstance(side, PeerConnectorScheduler) and side.block_size == 16


pd_op = st.one_of(
    st.tuples(st.just("prefill"), st.integers(1, 30)),
    st.tuples(st.just("step_p"), st.integers(1, 3)),
    st.tuples(st.just("step_d"), st.integers(1, 3)),
    st.tuples(st.just("forward"), st.integers(0, 40)),
    st.tuples(st.just("complete"), st.integers(0, 40)),
    st.tuples(st.just("fail"), st.integers(0, 40)),
    st.tuples(st.just("abort_d"), st.integers(0, 40)),
    st.tuples(st.just("abort_p"), st.integers(0, 40)),
    st.tuples(st.just("timeout"), st.integers(0, 40)),
)


def _pick(seq, k):
    seq = sorted(seq)
    return seq[k % len(seq)] if seq else None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(pd_op, max_size=50), policy=st.sampled_from(["recompute", "fail"]),
       caching=st.booleans(), chunk=st.sampled_from([6, 64]))
def test_random_interleavings_leak_no_block_and_end_every_request(ops, policy, caching, chunk):
    pair = Pair(auto=False, policy=policy, enable_prefix_caching=caching,
                max_num_batched_tokens=chunk)
    shared = list(range(900, 912))
    made, ended, ready = [], [], {}  # ready: producer params not yet sent to the consumer

    def collect(outs, side):
        for o in outs:
            if o.finished:
                ended.append((side, o.request_id))
                if side == "p" and o.kv_transfer_params is not None:
                    ready[o.request_id] = o.kv_transfer_params

    def forward(rid):
        params = ready.pop(rid)
        prompt = pair.p_prompts[rid]
        pair.d.add_request(decode_request(rid, prompt, params, max_tokens=3))
        made.append(("d", rid))

    for o in ops:
        kind, k = o
        if kind == "prefill":
            rid = f"r{len(pair.p_prompts)}"
            prompt = shared[:k % 9] + [5000 + 50 * len(pair.p_prompts) + i for i in range(k)]
            pair.p_prompts[rid] = prompt
            pair.p.add_request(make_req(rid, len(prompt), prefix=prompt,
                                        params=SamplingParams(max_tokens=1, ignore_eos=True),
                                        kv_transfer_params={"do_remote_decode": True}))
            made.append(("p", rid))
        elif kind in ("step_p", "step_d"):
            for _ in range(k):
                collect(getattr(pair, kind)()[1], kind[-1])
        elif kind == "forward" and ready:
            forward(_pick(ready, k))
        elif kind in ("complete", "fail") and pair.dw.pending:
            getattr(pair.dw, kind)(_pick(pair.dw.pending, k))
        elif kind == "abort_d" and pair.d.requests:
            collect(pair.d.abort_requests([_pick(pair.d.requests, k)], pair.now), "d")
        elif kind == "abort_p" and pair.p.requests:
            collect(pair.p.abort_requests([_pick(pair.p.requests, k)], pair.now), "p")
        elif kind == "timeout" and pair.pw.published:
            pair.pw.release(_pick(pair.pw.published, k))
    pair.dw.auto = True
    for _ in range(500):
        if not (pair.p.has_unfinished_requests() or pair.d.has_unfinished_requests() or ready):
            break
        for rid in list(ready):
            forward(rid)
        collect(pair.step_p()[1], "p")
        collect(pair.step_d()[1], "d")
        pair.d.kv.check_consistency()
        pair.p.kv.check_consistency()
    assert len(ended) == len(set(ended)), "a request ended twice"
    assert set(ended) == set(made), "a request never ended"
    pair.assert_no_leak()
