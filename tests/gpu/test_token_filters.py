"""``logit_bias`` and ``allowed_token_ids`` (vLLM's SamplingParams, OpenAI's logit_bias): checked
when the request is added, applied per row in the batched sampler."""

from __future__ import annotations

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.llm_engine import LLMEngine

PROMPTS = [[5, 17, 33, 9, 48, 3], [11, 120, 7, 200]]


def _greedy(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    return [got[i] for i in ids]


@pytest.fixture(scope="module")
def engine(tiny_model_dirs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=str(tiny_model_dirs["llama-tied"]), dtype="float32",
                                kv_cache_memory_bytes=1 << 22))


def test_bias_removes_a_greedy_token_and_allowed_ids_hold(engine) -> None:
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    base = _greedy(engine, [plain, plain])
    banned = base[0][0]
    biased = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                            logit_bias={str(banned): -100})
    got = _greedy(engine, [biased, plain])
    assert banned not in got[0] and got[1] == base[1]  # the other row is untouched
    allowed = [7, 42, 99]
    only = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True,
                          allowed_token_ids=allowed)
    got = _greedy(engine, [only, plain])
    assert set(got[0]) <= set(allowed) and got[1] == base[1]


def test_bad_values_are_refused_naming_the_field(engine) -> None:
    with pytest.raises(ValueError, match=r"logit_bias\[5\] must be in \[-100, 100\]"):
        SamplingParams(logit_bias={5: 150})
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(ValueError, match="allowed_token_ids must be a non-empty list"):
        SamplingParams(allowed_token_ids=[])
    assert SamplingParams(logit_bias={"7": 2}).logit_bias == {7: 2.0}
    for params, name in ((SamplingParams(logit_bias={100000: 1}), "logit_bias"),
                         (SamplingParams(allowed_token_ids=[1, 100000]), "allowed_token_ids")):
        with pytest.raises(ValueError, match=f"{name}: token ids must be in"):
            engine.add_request([5, 6], params)
    assert not engine.has_unfinished_requests()
