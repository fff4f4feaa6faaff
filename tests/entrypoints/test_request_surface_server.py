"""The request surface over HTTP, with the official ``openai`` client, on a tiny random-weight
model served positionally (``twinserve serve MODEL``) behind an API key and CORS for one origin:
prompt logprobs and echo (against HF's fp32 log-softmax), bad_words, truncate_prompt_tokens,
/v1/embeddings (against HF's last hidden state), CORS preflights, the vLLM metrics, and
``bench serve --api-key``."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from prometheus_client.parser import text_string_to_metric_families
from server_fixture import LiveServer, live_server

from twinserve.entrypoints.cli.bench_serve import (
    ServerUnavailableError,
    add_bench_serve_args,
    benchmark,
    run_config,
)
from twinserve.entrypoints.openai.server import add_serve_args
from twinserve.entrypoints.openai.server_cors import resolve_model_tag
from twinserve.traces.trace_request import TraceRequest

KEY = "sk-surface"
ORIGIN = "https://app.example"
PROMPT = [1, *range(5, 45)]
CORPUS = ["the cat sat on the mat", "a dog ran in the park", "hello world"] * 20


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    from conftest import with_trained_tokenizer
    return with_trained_tokenizer(tiny_model_dirs["qwen2-untied"],
                                  tmp_path_factory.mktemp("surface_srv") / "tiny-qwen", CORPUS)


@pytest.fixture(scope="module")
def server(model_dir) -> Iterator[LiveServer]:
    with live_server([str(model_dir), "--allowed-origins", ORIGIN,
                      "--max-num-batched-tokens", "16"], api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def test_served_positionally_under_its_directory_name(client, model_dir):
    assert [m.id for m in client.models.list().data] == [str(model_dir)]
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["some/dir", "--port", "1"])
    resolve_model_tag(args)
    assert args.model == "some/dir"
    args = add_serve_args(argparse.ArgumentParser()).parse_args(["a", "--model", "b"])
    with pytest.raises(ValueError, match="given twice"):
        resolve_model_tag(args)


def test_prompt_logprobs_and_echo_equal_hf(client, hf, model_dir):
    want = _hf_logprobs(hf, PROMPT)  # chunked: 41 prompt tokens, 16 a step
    out = client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=3,
                                    temperature=0, extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for pos in range(1, len(PROMPT)):
        entry = got[pos][str(PROMPT[pos])]
        assert entry["logprob"] == pytest.approx(float(want[pos - 1, PROMPT[pos]]), abs=1e-4)
        assert entry["rank"] == int((want[pos - 1] >= want[pos - 1, PROMPT[pos]]).sum())
    echo = client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=3,
                                     temperature=0, echo=True, logprobs=2)
    lps = echo.choices[0].logprobs
    assert len(lps.token_logprobs) == len(PROMPT) + 3 and lps.token_logprobs[0] is None
    assert lps.top_logprobs[0] is None
    for pos in range(1, len(PROMPT)):
        assert lps.token_logprobs[pos] == pytest.approx(float(want[pos - 1, PROMPT[pos]]),
                                                        abs=1e-4)
        # the top-2 as text (byte tokens that decode alike share a key, as in OpenAI's shape)
        assert 1 <= len(lps.top_logprobs[pos]) <= 2
        assert max(lps.top_logprobs[pos].values()) == pytest.approx(
            float(want[pos - 1].max()), abs=1e-4)
    assert echo.choices[0].text.endswith(out.choices[0].text)
    chunks = list(client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=3,
                                            temperature=0, echo=True, logprobs=2, stream=True))
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs
                for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lps.token_logprobs
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echo.choices[0].text


def test_refusals_name_the_field(client, model_dir):
    cases = [
        ({"prompt": PROMPT, "stream": True, "extra_body": {"prompt_logprobs": 1}},
         "prompt_logprobs", client.completions),
        ({"prompt": PROMPT, "extra_body": {"prompt_logprobs": 99}}, "prompt_logprobs",
         client.completions),
        ({"prompt": PROMPT, "extra_body": {"bad_words": "cat"}}, "bad_words",
         client.completions),
        ({"prompt": PROMPT, "extra_body": {"truncate_prompt_tokens": 10_000}},
         "truncate_prompt_tokens", client.completions),
        ({"prompt": PROMPT, "extra_body": {"logits_processors": ["pkg.Proc"]}},
         "logits_processors", client.completions),
        ({"messages": [{"role": "user", "content": "hi"}],
          "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs", client.chat.completions),
    ]
    for kwargs, field, api in cases:
        with pytest.raises(openai.BadRequestError) as err:
            api.create(model=str(model_dir), max_tokens=2, **kwargs)
        assert err.value.body["param"] == field, err.value.body


def test_bad_words_and_truncation(client, model_dir):
    plain = client.completions.create(model=str(model_dir), prompt="the mat", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text.count("&") >= 2  # the random model's greedy text has "&"s
    banned = client.completions.create(model=str(model_dir), prompt="the mat",
                                       max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "bad_words": ["&"]})
    assert "&" not in banned.choices[0].text
    cut = client.completions.create(model=str(model_dir), prompt=PROMPT, max_tokens=2,
                                    temperature=0, extra_body={"truncate_prompt_tokens": 9})
    alone = client.completions.create(model=str(model_dir), prompt=PROMPT[-9:], max_tokens=2,
                                      temperature=0)
    assert cut.usage.prompt_tokens == 9 and cut.choices[0].text == alone.choices[0].text


def test_embeddings_equal_hf(client, hf, model_dir):
    inputs = [PROMPT, PROMPT[:6]]
    default = client.embeddings.create(model=str(model_dir), input=inputs)  # base64 on the wire
    floats = client.embeddings.create(model=str(model_dir), input=inputs,
                                      encoding_format="float")
    with torch.no_grad():
        for i, prompt in enumerate(inputs):
            h = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
            want = torch.nn.functional.normalize(h, dim=-1)
            for resp in (default, floats):
                assert resp.data[i].index == i
                assert torch.allclose(torch.tensor(resp.data[i].embedding), want, atol=1e-4)
    assert floats.usage.prompt_tokens == len(PROMPT) + 6 and floats.model == str(model_dir)
    text = client.embeddings.create(model=str(model_dir), input="hello world")
    assert len(text.data) == 1 and len(text.data[0].embedding) == hf.config.hidden_size
    for kwargs, field in [({"input": PROMPT, "dimensions": 8}, "dimensions"),
                          ({"input": []}, "input"), ({"input": [PROMPT] * 2 + [[]]}, "input"),
                          ({"input": [1] * 400}, "input"),
                          ({"input": PROMPT, "encoding_format": "bits"}, "encoding_format"),
                          ({"input": PROMPT, "user": "u" * 300}, "user")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=str(model_dir), **kwargs)
        assert err.value.body["param"] == field


def test_cors_preflight_for_the_allowed_origin_only(server):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(server.url("/v1/completions"), headers={"Origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    other = httpx.options(server.url("/v1/completions"),
                          headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    answer = httpx.get(server.url("/v1/models"), headers={"Origin": ORIGIN, **server.headers})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN


def test_cors_is_off_by_default():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from twinserve.entrypoints.openai.server_cors import CORSOptions, cors_options, install_cors
    app = FastAPI()

    @app.get("/x")
    def x() -> dict:
        return {}
    options = cors_options(add_serve_args(argparse.ArgumentParser()).parse_args([]))
    assert options == CORSOptions()
    install_cors(app, options)
    answer = TestClient(app).get("/x", headers={"Origin": ORIGIN})
    assert "access-control-allow-origin" not in answer.headers
    with pytest.raises(ValueError, match="allow-credentials"):
        CORSOptions(origins=("*",), allow_credentials=True)
    parsed = add_serve_args(argparse.ArgumentParser()).parse_args(
        ["--allowed-origins", '["https://a.example", "https://b.example"]',
         "--allowed-methods", "GET,POST"])
    assert cors_options(parsed).origins == ("https://a.example", "https://b.example")
    assert cors_options(parsed).methods == ("GET", "POST")


def test_vllm_metrics_have_vllms_names_and_types(client, server, model_dir):
    client.completions.create(model=str(model_dir), prompt=PROMPT[:5], max_tokens=4)
    text = httpx.get(server.url("/metrics"), headers=server.headers).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vllm:request_time_per_output_token_seconds",
                 "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:iteration_tokens_total"):
        family = families[name]
        assert family.type == "histogram", name
        count = next(s for s in family.samples if s.name.endswith("_count"))
        assert count.labels == {"model_name": str(model_dir)} and count.value >= 1, name
    steps = families["vllm:iteration_tokens_total"]
    bucket_16 = next(s for s in steps.samples if s.labels.get("le") == "16.0")
    total = next(s for s in steps.samples if s.name.endswith("_count"))
    assert bucket_16.value == total.value  # no step computed more than max_num_batched_tokens
    info = families["vllm:cache_config_info"]
    assert info.type == "gauge" and info.samples[0].value == 1.0
    labels = info.samples[0].labels
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert int(labels["num_gpu_blocks"]) > 0 and labels["engine"] == "0"


def test_bench_serve_api_key_reaches_a_keyed_server(server, model_dir, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    reqs = [TraceRequest(f"r{i}", 0.05 * i, 8, 4) for i in range(3)]
    def served(records) -> bool:  # answered (a random model's first tokens may be no text)
        return all("401" not in r.error and "nauthorized" not in r.error for r in records)
    records, summary = asyncio.run(benchmark(server.base_url, reqs, vocab_size=300,
                                             api_key=KEY))
    assert served(records) and summary["completed"] >= 2, [r.error for r in records]
    with pytest.raises(ServerUnavailableError, match="API key"):
        asyncio.run(benchmark(server.base_url, reqs, vocab_size=300))
    with pytest.raises(ServerUnavailableError, match="API key"):
        asyncio.run(benchmark(server.base_url, reqs, vocab_size=300, api_key="wrong"))
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    records, summary = asyncio.run(benchmark(server.base_url, reqs, vocab_size=300))
    assert served(records) and summary["completed"] >= 2


def test_bench_serve_api_key_flag_is_never_written_to_the_run_folder():
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    args = parser.parse_args(["--api-key", KEY, "--num-requests", "2"])
    assert args.api_key == KEY
    assert KEY not in str(run_config(args, "m", 2, {}))
