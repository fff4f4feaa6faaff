"""Disaggregated prefill/decode through LLM and the P/D front: X prefill and Y decode engine
processes; greedy tokens equal one engine's; a decode instance killed mid-transfer ends its
request with an error, nothing hangs and the prefill side frees its blocks."""

from __future__ import annotations

import os
import signal

import pytest

from tests.entrypoints.test_data_parallel import Collect, alive, wait_until
from twinserve import LLM, SamplingParams
from twinserve.core.engine_args import EngineArgs
from twinserve.entrypoints.dp_front import ReplicaDied
from twinserve.entrypoints.pd_front import DisaggregatedFront, PDDeployment, instance_args

SMALL = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
             kv_cache_memory_bytes=16 << 20)
SHARED = "You are a terse assistant. Answer in one short sentence. "
PROMPTS = [SHARED + "The capital of France is", SHARED + "Count: 1, 2, 3, 4,", "Water boils at",
           SHARED + "The capital of France is"]
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def kv(port: int, **extra) -> dict:
    return {"kv_port": port, **extra}


def test_instances_get_their_roles_ports_and_ids() -> None:
    args = EngineArgs(kv_transfer_config=kv(15300, kv_load_failure_policy="fail"))
    per = instance_args(args, PDDeployment(2, 1))
    configs = [a.kv_transfer_config for a in per]
    assert [c.kv_role for c in configs] == ["kv_producer", "kv_producer", "kv_consumer"]
    assert [c.kv_port for c in configs] == [15300, 15301, 15302]
    assert [c.engine_id for c in configs] == ["prefill-0", "prefill-1", "decode-0"]
    assert {c.kv_load_failure_policy for c in configs} == {"fail"}
    with pytest.raises(ValueError, match="decode_instances"):
        PDDeployment(1, 0)
    with pytest.raises(ValueError, match="give both"):
        PDDeployment.of(1, None)
    with pytest.raises(ValueError, match="data_parallel_size"):
        instance_args(EngineArgs(data_parallel_size=2), PDDeployment(1, 1))
    with pytest.raises(ValueError, match="kv_port"):
        instance_args(EngineArgs(kv_transfer_config=kv(65535)), PDDeployment(1, 1))


@pytest.mark.slow
@pytest.mark.parametrize("x", [1, 2])
def test_llm_disaggregated_matches_one_engine(x: int) -> None:
    one = LLM(**SMALL)
    expected = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    one.shutdown()
    pd = LLM(prefill_instances=x, decode_instances=1, kv_transfer_config=kv(15310 + 4 * x), **SMALL)
    try:
        outs = pd.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        served = [r.served for r in pd.engine.front.snapshot()]
        assert served[x] == 2 * len(PROMPTS) - sum(served[:x]) and all(served[:x])
        pids = [pd.engine.front.pid(i) for i in range(x + 1)]
    finally:
        pd.shutdown()
    assert not any(alive(p) for p in pids if p is not None)


@pytest.mark.slow
def test_decode_instance_killed_mid_transfer() -> None:
    args = EngineArgs(**SMALL, kv_transfer_config=kv(15330, kv_connector_extra_config={
        "transfer_timeout_s": 3.0}), restart_dead_replicas=True)
    front = DisaggregatedFront(args, PDDeployment(1, 1), "llm", on_cuda=False)
    try:
        aborted = Collect()
        front.submit("z", PROMPTS[2], GREEDY, {}, aborted)
        front.abort("z")  # never reaches the decode instance, whichever phase it was in
        assert front._prefilling == {}
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        sink = Collect()
        front.submit("a", PROMPTS[0], long, {}, sink)
        assert sink.items.get(timeout=60) is None  # accepted by the prefill instance
        wait_until(lambda: front.snapshot()[1].stats is not None
                   and front.snapshot()[1].stats.num_running + front.snapshot()[1].stats.num_waiting)
        os.kill(front.pid(1), signal.SIGKILL)
        assert isinstance(sink.last(60), ReplicaDied)
        wait_until(lambda: front.health() == ["ready", "ready"])  # restarted
        # the producer freed the blocks it published (reader gone or timeout): usage back to 0
        wait_until(lambda: front.snapshot()[0].stats.kv_cache_usage == 0.0, 30)
        again = Collect()
        front.submit("b", PROMPTS[1], GREEDY, {}, again)
        out = again.last(120)
        assert not isinstance(out, BaseException) and len(out.outputs[0].token_ids) == 8
        assert front.snapshot()[1].served == 2  # a (before the kill) and b: not z
        assert front._prefilling == {}
    finally:
        front.shutdown()
