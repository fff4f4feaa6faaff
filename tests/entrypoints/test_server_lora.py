"""LoRA adapters behind the OpenAI-compatible server, as vLLM serves them: ``--lora-modules``,
``/v1/models`` with ``parent``, an adapter chosen by ``model``, runtime load/unload behind
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, the refusals, and ``vllm:lora_requests_info``.

A real engine over a tiny random Llama (with a small trained BPE tokenizer and a chat template)
is served in-process by uvicorn on loopback and driven with the official ``openai`` client; its
adapters' completions are compared with ``LLM.generate(..., lora_request=...)``. The HTTP-only
cases (requests in flight, the waiting adapters, overload) use a stub engine.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from conftest import with_trained_tokenizer
from lora_helpers import ADAPTERS, AdapterSpec, make_adapter
from stub_server import StubEngine, serve

from twinserve.core.errors import EngineOverloaded
from twinserve.core.lora import LoRARequest
from twinserve.core.sampling_params import SamplingParams

API_KEY = "lora-key"
BASE = "tiny"
MAX_TOKENS = 10
PROMPT = "The quick brown fox"
LONG_PROMPT = "abc-123 def-456 red green blue. The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "user", "content": "yes no maybe"}]
CORPUS = ["The quick brown fox jumps over the lazy dog. 0123456789 yes no maybe",
          "abc-123 def-456 red green blue", '{"name": "Ada", "tags": ["x", "y"]}'] * 20
ENGINE_ARGS = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22,
                   enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
EXTRA = {"ignore_eos": True}


# ---- fixtures: a tiny model with a tokenizer, its adapters, the Python API's outputs ---------
@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    return with_trained_tokenizer(tiny_model_dirs["llama-tied"],
                                  tmp_path_factory.mktemp("lora_server") / "llama-tok", CORPUS)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_server_adapters")
    specs = {**ADAPTERS, "rank32": AdapterSpec(32, 32.0, ("q_proj",))}
    return {name: str(make_adapter(model_dir, root / name, spec, seed))
            for seed, (name, spec) in enumerate(specs.items())}


@pytest.fixture(scope="module")
def expected(model_dir, adapters) -> dict[str | None, dict[str, str]]:
    """adapter (None: the base model) -> {"prompt"|"long"|"chat": greedy text}."""
    from twinserve.entrypoints.llm import LLM
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    out: dict[str | None, dict[str, str]] = {}
    for k, name in enumerate((None, *ADAPTERS)):
        lora = None if name is None else LoRARequest(name, k, adapters[name])
        texts = [o.outputs[0].text for o in llm.generate([PROMPT, LONG_PROMPT], GREEDY,
                                                         lora_request=lora, use_tqdm=False)]
        chat = llm.chat(CHAT, GREEDY, lora_request=lora, use_tqdm=False)[0].outputs[0].text
        out[name] = {"prompt": texts[0], "long": texts[1], "chat": chat}
    assert len({o["prompt"] for o in out.values()}) == len(out)  # each adapter changes the text
    return out


@pytest.fixture(scope="module")
def server(model_dir, adapters) -> Iterator[str]:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model=str(model_dir), **ENGINE_ARGS), usage_context="server")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        with serve(engine, served_model_name=BASE, api_key=API_KEY,
                   lora_modules=[f"qv4={adapters['qv4']}"]) as base_url:
            yield base_url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


def _post(base_url: str, path: str, body: dict[str, Any], key: str | None = API_KEY
          ) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(base_url + path, json=body, headers=headers, timeout=60)


def _complete(client: openai.OpenAI, model: str, prompt: str = PROMPT) -> Any:
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0, extra_body=EXTRA)


# ---- the real engine -----------------------------------------------------------------------
def test_adapter_completions_equal_the_python_api(client, expected) -> None:
    for model, name in ((BASE, None), ("qv4", "qv4")):
        out = _complete(client, model)
        assert out.model == model
        assert out.choices[0].text == expected[name]["prompt"]
        assert out.usage.completion_tokens == MAX_TOKENS
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body=EXTRA)
        chunks = list(stream)
        assert {c.model for c in chunks} == {model}
        assert "".join(c.choices[0].text for c in chunks if c.choices) == \
            expected[name]["prompt"]
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body=EXTRA)
        assert chat.model == model and chat.choices[0].message.content == expected[name]["chat"]


def test_models_list_the_adapters_with_their_parent(server, client, adapters) -> None:
    assert [m.id for m in client.models.list().data][:2] == [BASE, "qv4"]
    cards = {c["id"]: c for c in httpx.get(server + "/v1/models", headers={
        "Authorization": f"Bearer {API_KEY}"}).json()["data"]}
    assert cards["qv4"]["parent"] == BASE and cards["qv4"]["root"] == adapters["qv4"]
    assert cards[BASE]["parent"] is None


def test_unknown_model_is_404_and_a_raw_lora_request_is_refused(client) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        _complete(client, "no-such-adapter")
    assert err.value.body["message"] == "The model `no-such-adapter` does not exist."
    assert err.value.body["type"] == "NotFoundError" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-adapter", messages=CHAT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=BASE, prompt=PROMPT, max_tokens=2, extra_body={
            "lora_request": {"lora_name": "qv4", "lora_int_id": 1, "lora_path": "/x"}})
    assert bad.value.body["param"] == "lora_request" and "`model`" in bad.value.body["message"]


def test_load_and_unload_at_runtime(server, client, adapters, expected) -> None:
    body = {"lora_name": "mlp16", "lora_path": adapters["mlp16"]}
    assert _post(server, "/v1/load_lora_adapter", body, key=None).status_code == 401
    r = _post(server, "/v1/load_lora_adapter", body)
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'mlp16' added successfully."
    assert "mlp16" in [m.id for m in client.models.list().data]
    assert _complete(client, "mlp16").choices[0].text == expected["mlp16"]["prompt"]
    again = _post(server, "/v1/load_lora_adapter", body)
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    r = _post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp16"})
    assert r.status_code == 200 and "removed successfully" in r.text
    assert "mlp16" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "mlp16")
    gone = _post(server, "/v1/unload_lora_adapter", {"lora_name": "mlp16"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert _complete(client, "qv4").choices[0].text == expected["qv4"]["prompt"]


@pytest.mark.parametrize("name, path, match", [
    ("nowhere", "/no/such/adapter", r"LoRA adapter 'nowhere' \(/no/such/adapter\): no such "),
    ("big", "rank32", "rank 32 is above max_lora_rank 16"),
    (BASE, "qv4", "is the base model's"),
    ("", "qv4", "must be provided")])
def test_bad_loads_are_400_with_the_reason(server, client, adapters, name, path,
                                           match) -> None:
    r = _post(server, "/v1/load_lora_adapter",
              {"lora_name": name, "lora_path": adapters.get(path, path)})
    assert r.status_code == 400, r.text
    assert re.search(match, r.json()["error"]["message"]), r.text
    assert name not in [m.id for m in client.models.list().data][1:]


def test_a_name_loaded_again_with_another_adapter_gets_no_stale_blocks(server, client, adapters,
                                                                      expected) -> None:
    def long(model: str) -> Any:
        return _complete(client, model, LONG_PROMPT)

    assert _post(server, "/v1/load_lora_adapter",
                 {"lora_name": "swap", "lora_path": adapters["all8"]}).status_code == 200
    first, second = long("swap"), long("swap")
    assert first.choices[0].text == second.choices[0].text == expected["all8"]["long"]
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache is on
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200
    assert _post(server, "/v1/load_lora_adapter",
                 {"lora_name": "swap", "lora_path": adapters["mlp16"]}).status_code == 200
    third = long("swap")
    assert third.choices[0].text == expected["mlp16"]["long"]
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200


def test_an_adapter_that_fails_to_load_fails_only_its_requests(server, client, adapters,
                                                               expected, tmp_path) -> None:
    fragile = tmp_path / "fragile"
    shutil.copytree(adapters["all8"], fragile)
    assert _post(server, "/v1/load_lora_adapter",
                 {"lora_name": "fragile", "lora_path": str(fragile)}).status_code == 200
    shutil.rmtree(fragile)
    for name in ("mlp16", "all8"):  # max_cpu_loras 2: these push it out of host memory
        assert _post(server, "/v1/load_lora_adapter",
                     {"lora_name": name, "lora_path": adapters[name]}).status_code == 200
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="fragile", prompt=PROMPT, max_tokens=2,
                                      stream=stream)
        assert "LoRA adapter 'fragile'" in err.value.body["message"]
        assert "no such directory" in err.value.body["message"]
    assert _complete(client, "all8").choices[0].text == expected["all8"]["prompt"]
    assert _complete(client, BASE).choices[0].text == expected[None]["prompt"]
    for name in ("fragile", "mlp16", "all8"):
        assert _post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_lora_info_metric(server) -> None:
    text = httpx.get(server + "/metrics", timeout=60).text
    match = re.search(r'^vllm:lora_requests_info\{(.*)\} (\S+)$', text, re.MULTILINE)
    assert match is not None, text
    assert 'max_lora="2"' in match.group(1)
    assert 'running_lora_adapters=""' in match.group(1)
    assert 'waiting_lora_adapters=""' in match.group(1)
    assert abs(float(match.group(2)) - time.time()) < 60


# ---- start-up: --lora-modules ----------------------------------------------------------------
def test_bad_lora_modules_stop_the_server_before_it_listens(model_dir, adapters, capsys,
                                                            monkeypatch) -> None:
    import uvicorn

    from twinserve.entrypoints.cli.main import main

    def listening(*_: Any, **__: Any) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn.Server, "run", listening)
    base = ["serve", "--model", str(model_dir), "--dtype", "float32",
            "--kv-cache-memory-bytes", str(1 << 22)]
    cases = [
        (["--lora-modules", f"qv4={adapters['qv4']}"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", f"qv4={adapters['qv4']}", "bad=/no/such/dir"],
         "--lora-modules bad=/no/such/dir: LoRA adapter 'bad' (/no/such/dir): no such directory"),
        (["--enable-lora", "--lora-modules", f"big={adapters['rank32']}"],
         "rank 32 is above max_lora_rank 16"),
        (["--enable-lora", "--lora-modules", f"a={adapters['qv4']}", f"a={adapters['all8']}"],
         "'a' has already been loaded"),
        (["--enable-lora", "--lora-modules",
          json.dumps({"name": "x", "path": adapters["qv4"], "base_model_name": "other"})],
         "base_model_name 'other' is not the served model")]
    for flags, message in cases:
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--enable-lora", "--lora-modules", "no-equals-sign"])
    assert "expected name=path or a JSON object" in capsys.readouterr().err


def test_lora_modules_from_the_command_line_and_a_config_file(tmp_path) -> None:
    from twinserve.entrypoints.engine_args import apply_config_file
    from twinserve.entrypoints.openai.server import add_serve_args
    from twinserve.entrypoints.openai.serving_models import LoRAModulePath, static_lora_modules
    parser = add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args(["--lora-modules", "a=/p/a",
                              '{"name": "b", "path": "/p/b", "base_model_name": "m"}'])
    assert static_lora_modules(args, "m") == [LoRAModulePath("a", "/p/a"),
                                              LoRAModulePath("b", "/p/b", "m")]
    config = tmp_path / "serve.yaml"
    config.write_text("enable-lora: true\nlora_modules:\n  - c=/p/c\n"
                      "  - {name: d, path: /p/d}\n")
    args = apply_config_file(parser, ["--config", str(config)])
    assert args.enable_lora is True
    assert static_lora_modules(args, "m") == [LoRAModulePath("c", "/p/c"),
                                              LoRAModulePath("d", "/p/d")]
    config.write_text("lora_modules:\n  - {name: e}\n")
    with pytest.raises(ValueError, match="both 'name' and 'path'"):
        static_lora_modules(apply_config_file(parser, ["--config", str(config)]), "m")


# ---- the HTTP layer over a stub engine -------------------------------------------------------
class _StubLoRAManager:
    """What the server asks of ``LoRAManager``: the checks pass, nothing is read."""

    def __init__(self) -> None:
        self.lora_config = SimpleNamespace(max_loras=2)
        self.dropped: list[str] = []

    def acquire(self, request: LoRARequest) -> str:
        return request.lora_name

    def release(self, name: str) -> None:
        pass

    def drop(self, name: str) -> None:
        self.dropped.append(name)


class _LoRAStubEngine(StubEngine):
    """Requests stay queued for a minute (until ``start_after_s`` changes); adapter ``full``
    is refused as an overload."""

    def __init__(self) -> None:
        super().__init__(start_after_s=60.0, retry_after_s=1.0)
        self.runner.lora = _StubLoRAManager()
        self.scheduler.loras = SimpleNamespace(users={})

    def add_request(self, prompt: list[int], params: Any, *, request_id: str,
                    **kwargs: Any) -> str:
        lora = kwargs.get("lora_request")
        if lora is not None and lora.lora_name.startswith("full@"):
            raise EngineOverloaded(f"LoRA adapter {lora.lora_name!r} cannot be loaded now: all "
                                   "max_cpu_loras (1) adapters in host memory have requests in "
                                   "flight; retry later.", "max_cpu_loras", 1.0)
        return super().add_request(prompt, params, request_id=request_id, **kwargs)


def _lora_info(base_url: str) -> str:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return re.search(r"^vllm:lora_requests_info\{(.*)\}", text, re.MULTILINE).group(1)


def test_unload_with_requests_in_flight_is_refused_and_waiting_adapters_are_listed(
        monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    engine = _LoRAStubEngine()
    with serve(engine, served_model_name=BASE, lora_modules=["a=/a", "full=/full", "b=/b"],
               sse_keepalive_s=0.2) as url:
        body = {"model": "a", "prompt": [1, 2], "max_tokens": 2, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as queued:
            assert queued.status_code == 200  # accepted: the headers are out, it waits
            assert engine.added[-1]["lora_request"] == LoRARequest("a@1", 1, "/a")
            engine.scheduler.loras.users = {"b@3": 1}  # as if b were running
            info = _lora_info(url)
            assert 'running_lora_adapters="b"' in info and 'waiting_lora_adapters="a"' in info
            r = _post(url, "/v1/unload_lora_adapter", {"lora_name": "a"}, key=None)
            assert r.status_code == 400 and "1 request(s) in flight" in r.text
            assert "a" in [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]]
        deadline = time.monotonic() + 10  # the stream is closed: its request ends
        while (r := _post(url, "/v1/unload_lora_adapter", {"lora_name": "a"}, key=None)
               ).status_code == 400 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        assert engine.runner.lora.dropped == ["a@1"]
        engine.start_after_s = 0.0  # from now on requests run at once
        r = _post(url, "/v1/completions", {"model": "full", "prompt": [1], "max_tokens": 1},
                  key=None)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "LoRA adapter 'full' cannot be loaded now" in r.json()["error"]["message"]
        r = _post(url, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/a2"}, key=None)
        assert r.status_code == 200
        r = _post(url, "/v1/completions", {"model": "a", "prompt": [1], "max_tokens": 1},
                  key=None)
        assert r.status_code == 200 and r.json()["model"] == "a"
        assert engine.added[-1]["lora_request"] == LoRARequest("a@4", 4, "/a2")  # a new key


def test_runtime_routes_exist_only_with_the_environment_variable(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with serve(_LoRAStubEngine(), served_model_name=BASE, lora_modules=["a=/a"]) as url:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            assert _post(url, path, {"lora_name": "x", "lora_path": "/x"}, key=None
                         ).status_code == 404
        assert [c["id"] for c in httpx.get(url + "/v1/models").json()["data"]] == [BASE, "a"]
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"), \
            serve(StubEngine(), lora_modules=["a=/a"]):
        pass
