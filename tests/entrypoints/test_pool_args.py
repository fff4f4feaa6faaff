"""Per-pool engine arguments on the real path: ``serve --prefill-args/--decode-args`` (and
``--config``'s mappings), ``LLM(prefill_args=, decode_args=)``, down to the arguments each
engine process is started with; refusals by name."""

from __future__ import annotations

import pytest

import twinserve.entrypoints.dp_front as dp_front
import twinserve.entrypoints.llm as llm_module
import twinserve.entrypoints.openai.dp_async_engine as dp_async
from twinserve import LLM, SamplingParams
from twinserve.core.engine_args import EngineArgs
from twinserve.entrypoints.cli.main import build_parser, parse_args
from twinserve.entrypoints.openai.server import build_async_engine
from twinserve.entrypoints.pd_front import DisaggregatedFront, PDDeployment, instance_args


class Captured(Exception):
    """Stops a constructor once it handed over what the test reads."""


def test_each_instance_gets_its_pools_arguments() -> None:
    args = EngineArgs(max_num_seqs=16, max_num_batched_tokens=2048)
    pd = PDDeployment(2, 1, {"max_num_batched_tokens": 512},
                      {"max_num_seqs": 8, "enable_prefix_caching": False})
    per = instance_args(args, pd)
    assert [(a.max_num_seqs, a.max_num_batched_tokens, a.enable_prefix_caching) for a in per] == [
        (16, 512, True), (16, 512, True), (8, 2048, False)]
    assert [a.kv_transfer_config.kv_role for a in per] == ["kv_producer"] * 2 + ["kv_consumer"]
    assert instance_args(args, PDDeployment(1, 1))[1].max_num_seqs == 16  # no overrides


def test_the_front_starts_each_process_with_its_pools_arguments(monkeypatch) -> None:
    seen: list[EngineArgs] = []

    def fake_replica_set(args, usage_context, on_cuda, kv_events, replica_args, record_steps):
        seen.extend(replica_args)
        raise Captured
    monkeypatch.setattr(dp_front, "make_replica_set", fake_replica_set)
    with pytest.raises(Captured):
        DisaggregatedFront(EngineArgs(max_num_seqs=16), PDDeployment(1, 2, {}, {"max_num_seqs": 4}),
                           "server", False)
    assert [a.max_num_seqs for a in seen] == [16, 4, 4]


@pytest.mark.parametrize("pools, match", [
    ({"decode_args": {"block_size": 32}}, "decode_args: 'block_size' must be the same in both pools"),
    ({"prefill_args": {"model": "other"}}, "prefill_args: 'model' must be the same"),
    ({"prefill_args": {"dtype": "bfloat16"}}, "prefill_args: 'dtype' must be the same"),
    ({"decode_args": {"kv_transfer_config": {}}}, "decode_args: 'kv_transfer_config' must be"),
    ({"decode_args": {"max_num_seq": 4}}, "decode_args: unknown engine argument 'max_num_seq'"),
    ({"decode_args": {"cpu_offload_gb": 4}}, "decode_args: engine argument 'cpu_offload_gb' is not"),
    ({"prefill_args": "not json"}, "prefill_args is not valid JSON"),
])
def test_bad_pool_arguments_are_refused_by_name(pools, match) -> None:
    with pytest.raises(ValueError, match=match):
        PDDeployment.of(1, 1, pools.get("prefill_args"), pools.get("decode_args"))


def test_a_bad_value_is_refused_naming_the_pool() -> None:
    pd = PDDeployment(1, 1, {}, {"max_num_seqs": "eight"})
    with pytest.raises(ValueError, match="decode_args: max_num_seqs must be"):
        instance_args(EngineArgs(), pd)
    with pytest.raises(ValueError, match="decode_args is set but the deployment is not"):
        PDDeployment.of(None, None, None, {"max_num_seqs": 4})


def _serve_pd(monkeypatch, argv: list[str]) -> tuple[EngineArgs, PDDeployment]:
    got: list = []

    class FakeEngine:
        def __init__(self, args, pd=None):
            got.extend([args, pd])
    monkeypatch.setattr(dp_async, "DPAsyncEngine", FakeEngine)
    build_async_engine(parse_args(build_parser(only="serve"), ["serve", *argv]))
    return got[0], got[1]


def test_serve_flags_and_config_file_reach_the_deployment(monkeypatch, tmp_path) -> None:
    args, pd = _serve_pd(monkeypatch, ["--prefill-instances", "1", "--decode-instances", "1",
                                       "--decode-args", '{"max_num_seqs": 4}'])
    assert pd.decode_args == {"max_num_seqs": 4} and pd.prefill_args == {}
    assert [a.max_num_seqs for a in instance_args(args, pd)][1] == 4
    config = tmp_path / "pd.yaml"
    config.write_text("prefill_instances: 1\ndecode_instances: 2\nprefill_args:\n"
                      "  max_num_batched_tokens: 256\ndecode-args:\n  max-num-seqs: 2\n")
    args, pd = _serve_pd(monkeypatch, ["--config", str(config)])
    per = instance_args(args, pd)
    assert per[0].max_num_batched_tokens == 256 and [a.max_num_seqs for a in per[1:]] == [2, 2]
    with pytest.raises(ValueError, match="decode_args: 'block_size' must be the same"):
        _serve_pd(monkeypatch, ["--prefill-instances", "1", "--decode-instances", "1",
                                "--decode-args", '{"block_size": 8}'])


def test_llm_takes_pool_arguments(monkeypatch) -> None:
    got: list = []

    def fake_make_engine(args, pd=None):
        got.extend([args, pd])
        raise Captured
    monkeypatch.setattr(llm_module, "_make_engine", fake_make_engine)
    with pytest.raises(Captured):
        LLM(prefill_instances=1, decode_instances=1, max_num_seqs=16,
            prefill_args={"max_num_batched_tokens": 64}, decode_args='{"max_num_seqs": 2}')
    args, pd = got
    per = instance_args(args, pd)
    assert (per[0].max_num_batched_tokens, per[0].max_num_seqs, per[1].max_num_seqs) == (64, 16, 2)
    with pytest.raises(ValueError, match="prefill_args: 'block_size' must be the same"):
        LLM(prefill_instances=1, decode_instances=1, prefill_args={"block_size": 32})


@pytest.mark.slow
def test_pools_with_their_own_limits_give_one_engines_tokens() -> None:
    small = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                 kv_cache_memory_bytes=16 << 20)
    prompts = ["The capital of France is", "Count: 1, 2, 3, 4,", "Water boils at"]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    one = LLM(**small)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    one.shutdown()
    # a prefill pool chunking every prompt into 4-token steps, a decode pool of one seat
    pd = LLM(prefill_instances=1, decode_instances=1, kv_transfer_config={"kv_port": 15390},
             prefill_args={"max_num_batched_tokens": 4}, decode_args={"max_num_seqs": 1}, **small)
    try:
        outs = pd.generate(prompts, greedy, use_tqdm=False)
    finally:
        pd.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == expected
