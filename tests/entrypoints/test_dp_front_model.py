"""The data-parallel server's front reads the model's facts without loading its weights."""

from __future__ import annotations

import pytest

from twinserve.core.engine_args import EngineArgs
from twinserve.core.sampling_params import SamplingParams
from twinserve.entrypoints.front_model import FrontModel
from twinserve.entrypoints.openai.dp_async_engine import front_engine
from twinserve.gpu.engine.llm_engine import LLMEngine
from twinserve.gpu.worker import model_runner


def test_the_front_engine_holds_no_weights_and_has_one_engines_facts(monkeypatch) -> None:
    args = EngineArgs(dtype="float32", max_model_len=256, data_parallel_size=2)

    def no_load(*args, **kwargs):
        raise AssertionError("the front loaded the model's weights")

    monkeypatch.setattr(model_runner, "load_model", no_load)
    front = front_engine(args)
    assert isinstance(front.runner, FrontModel) and front.runner.model is None
    monkeypatch.undo()
    one = LLMEngine(args.replace(data_parallel_size=1, num_gpu_blocks_override=4))
    assert (front.runner.max_model_len, front.runner.vocab_size) == \
        (one.runner.max_model_len, one.runner.vocab_size) == (256, one.runner.config.vocab_size)
    assert front.runner.config.hidden_size == one.runner.config.hidden_size
    text = "The capital of France is"
    assert front.tokenizer.encode(text) == one.tokenizer.encode(text)
    assert front.policy.name == one.policy.name
    # the request checks of one engine, e.g. token ids beyond the vocabulary
    with pytest.raises(ValueError, match="stop_token_ids"):
        front.add_request("hi", SamplingParams(stop_token_ids=[front.runner.vocab_size]))
    front.shutdown()
    one.shutdown()
