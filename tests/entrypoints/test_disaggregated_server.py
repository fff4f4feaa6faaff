"""One command, ``serve --prefill-instances 1 --decode-instances 1``: the same greedy tokens as
one engine, both instances in /health, ``kv_transfer_params`` accepted only with a connector
(vLLM's way: a prefill-only request returns the producer's params at the top level)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixture import LiveServer, start_server, stop_server

from twinserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "1, 2, 3, 4,"]
MAX_TOKENS = 8
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    srv = start_server(["--prefill-instances", "1", "--decode-instances", "1",
                        "--kv-transfer-config", '{"kv_port": 15350}'])
    try:
        yield srv
    finally:
        stop_server(srv)


def complete(server: LiveServer, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=120)


def test_disaggregated_server_matches_one_engine(server: LiveServer) -> None:
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    llm.shutdown()
    for prompt, out in zip(PROMPTS, outs):
        r = complete(server, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == out.outputs[0].text
    health = httpx.get(server.url("/health"), timeout=10)
    assert health.status_code == 200
    assert [row["engine"] for row in health.json()["replicas"]] == ["0", "1"]
    # the front sets the params itself: a client's are refused, naming the field
    r = complete(server, PROMPTS[0], kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400 and "kv_transfer_params" in r.text


def test_kv_transfer_params_on_single_instances() -> None:
    plain = start_server([])
    try:
        r = complete(plain, PROMPTS[0], kv_transfer_params={"do_remote_decode": True})
        assert r.status_code == 400 and "kv_transfer_config" in r.text
    finally:
        stop_server(plain)
    producer = start_server(["--kv-transfer-config", '{"kv_role": "kv_producer", "kv_port": 15360}'])
    try:
        r = complete(producer, PROMPTS[0], max_tokens=1,
                     kv_transfer_params={"do_remote_decode": True})
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_port"] == 15360
        assert params["remote_num_tokens"] == len(prompt_tokens(PROMPTS[0]))
    finally:
        stop_server(producer)


def prompt_tokens(prompt: str) -> list[int]:
    from twinserve.gpu.engine.tokenizer import Tokenizer
    from twinserve.gpu.models.default_model import resolve_model_source
    return Tokenizer.from_dir(resolve_model_source(None)[0]).encode(prompt, add_special_tokens=True)
