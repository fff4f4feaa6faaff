"""Speculative decoding through the OpenAI server (``--speculative-config``): greedy completions,
streamed and not, equal the engine's without speculation (the bundled model, fp32)."""

from __future__ import annotations

import json

import pytest

PROMPT = ("Repeat this list exactly: apple, banana, cherry, date, apple, banana, cherry, date, "
          "apple, banana")
MAX_TOKENS = 32


@pytest.mark.slow
def test_server_greedy_completions_with_ngram_equal_those_without(default_model_dir):
    import openai
    from server_fixture import live_server  # (fp32, seed 0: SMALL_SERVER_ARGS)

    from twinserve.core.engine_args import EngineArgs
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.gpu.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(dtype="float32", max_model_len=256,
                                  kv_cache_memory_bytes=64 << 20, seed=0))
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    expected = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            expected = out.outputs[0].text
    spec = {"method": "ngram", "num_speculative_tokens": 4, "policy": "fixed"}
    with live_server(["--speculative-config", json.dumps(spec)]) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120,
                               max_retries=0)
        model = client.models.list().data[0].id
        plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                          temperature=0)
        assert plain.choices[0].text == expected
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected
