"""Tool calling and chat templates: the parsers (hermes, llama3_json, the forced formats) on
hand-written outputs, streamed deltas against the final parse, the tools' checks, the template
rendering (tools, the fallback for templates without a tools section, continue_final_message,
chat_template_kwargs, the sandbox), ``LLM.chat(tools=, chat_template=)``, and the server with
the official ``openai`` client.

The server runs a tiny random-weight Llama (tests/conftest.py) with a small trained tokenizer:
its free outputs are noise, so the valid calls of ``tool_choice="required"`` or a named
function are the grammar's doing alone."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from conftest import with_trained_tokenizer

from twinserve.entrypoints.chat_template import ChatTemplateOptions, render_chat
from twinserve.entrypoints.chat_tools import parse_tools, required_schema, tool_request
from twinserve.entrypoints.openai.chat_server_options import ChatServerOptions, load_chat_template
from twinserve.entrypoints.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser
from twinserve.entrypoints.tool_parsers.forced import NamedToolParser, RequiredToolParser
from twinserve.entrypoints.tool_parsers.streaming import ToolCallStreamer

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 6},
                          "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object",
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
# A template that reads tools (as Hermes' and Qwen's do), short enough for the tiny model.
TOOLS_TEMPLATE = ("{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                  "{{ '\\n' }}{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                  "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
CORPUS = ['{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
          '[{"name": "add", "parameters": {"a": 1, "b": 22}}] <tool_call> </tool_call>',
          "The quick brown fox jumps over the lazy dog. 0123456789 yes no", "user: assistant:"
          ] * 20


# ---- the parsers on hand-written outputs ---------------------------------------------------
def _streamed(parser: ToolParser, text: str, step: int) -> tuple[str, list[tuple[str, str]],
                                                                  list[str]]:
    """Content, [(name, arguments)] and ids reassembled from ``text`` fed ``step`` characters
    at a time."""
    ids = iter(f"id{i}" for i in range(100))
    streamer = ToolCallStreamer(parser, lambda: next(ids))
    content, calls = "", {}
    pieces = [text[i:i + step] for i in range(0, len(text), step)] or [""]
    outs = [streamer.feed(p) for p in pieces[:-1]] + [streamer.finish(pieces[-1])[0]]
    seen_ids = []
    for out in outs:
        content += out.content
        for d in out.tool_calls:
            if d.id is not None:
                assert d.index == len(calls) and d.function.name and d.type == "function"
                calls[d.index] = [d.function.name, ""]
                seen_ids.append(d.id)
            calls[d.index][1] += d.function.arguments or ""
    return content, [tuple(c) for c in calls.values()], seen_ids


def _check_stream_matches_final(parser: ToolParser, text: str) -> None:
    final = parser.parse_final(text)
    expected_content = final.content if final.calls else text
    for step in (1, 2, 3, 5, 8, len(text) or 1):
        content, calls, _ = _streamed(parser, text, step)
        if final.calls:
            assert content == expected_content, (step, content)
            assert calls == [(c.name, c.arguments) for c in final.calls], (step, calls)
        else:
            assert content == text


HERMES_CASES = [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
     '</tool_call>', "", [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ('Let me check. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
     '<tool_call>{"arguments": {"city": "Oslo", "unit": "f"}, "name": "get_weather"}'
     '</tool_call>', "Let me check. ",
     [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Oslo", "unit": "f"}')]),
    ('<tool_call>{"name": "f", "parameters": {"s": "a \\"}\\" b", "n": [1, {"x": null}]}}',
     "", [("f", '{"s": "a \\"}\\" b", "n": [1, {"x": null}]}')]),  # unclosed last block
]
HERMES_MALFORMED = [
    "no tools here <tool_",
    '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>',        # object not closed
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',   # arguments a string
    '<tool_call>{"arguments": {}}</tool_call>',                           # no name
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}, "name": "g"}</tool_call>',  # a key twice
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>nope</tool_call>',
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes_parses_single_and_parallel_calls(text: str, content: str, calls: list) -> None:
    parsed = get_tool_parser("hermes")().parse_final(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for c in parsed.calls:
        assert isinstance(json.loads(c.arguments), dict)
    _check_stream_matches_final(get_tool_parser("hermes")(), text)


@pytest.mark.parametrize("text", HERMES_MALFORMED)
def test_hermes_malformed_output_is_plain_content(text: str) -> None:
    parsed = get_tool_parser("hermes")().parse_final(text)
    assert parsed.calls == [] and parsed.content == text
    _check_stream_matches_final(get_tool_parser("hermes")(), text)


def test_hermes_holds_back_only_what_may_start_a_call() -> None:
    parser = get_tool_parser("hermes")()
    assert parser.parse_partial("Hello <tool").content == "Hello "
    assert parser.parse_partial("Hello <tab>").content == "Hello <tab>"
    streamer = ToolCallStreamer(parser, lambda: "id")
    assert streamer.feed("a <").content == "a "
    assert streamer.feed("b").content == "<b"


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
     [("get_weather", '{"city": "Rome", "unit": "c"}')]),
    ('<|python_tag|>{"name": "add", "arguments": {"a": 3, "b": 4}}; '
     '{"name": "get_weather", "parameters": {"city": "x", "unit": "f"}}',
     [("add", '{"a": 3, "b": 4}'), ("get_weather", '{"city": "x", "unit": "f"}')]),
]


@pytest.mark.parametrize("text, calls", LLAMA_CASES)
def test_llama3_json_parses_calls(text: str, calls: list) -> None:
    parsed = get_tool_parser("llama3_json")().parse_final(text)
    assert parsed.content == "" and [(c.name, c.arguments) for c in parsed.calls] == calls
    _check_stream_matches_final(get_tool_parser("llama3_json")(), text)


@pytest.mark.parametrize("text", [
    "The weather is fine.", '{"name": "f"}', '{"name": "f", "parameters": {}} and more',
    '{"name": "f", "parameters": {"a": }}', '<|python_tag|>print(1)'])
def test_llama3_json_malformed_or_plain_output_is_content(text: str) -> None:
    parsed = get_tool_parser("llama3_json")().parse_final(text)
    assert parsed.calls == [] and parsed.content == text
    _check_stream_matches_final(get_tool_parser("llama3_json")(), text)


def test_forced_formats_and_the_registry() -> None:
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "f", "parameters": {}}]'
    parsed = RequiredToolParser().parse_final(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", '{"a": 1, "b": 2}'),
                                                              ("f", "{}")]
    _check_stream_matches_final(RequiredToolParser(), text)
    cut = RequiredToolParser().parse_final(text[:-1])   # cut by max_tokens: plain content
    assert cut.calls == [] and cut.content == text[:-1]
    named = NamedToolParser("add").parse_final('{"a": 1')
    assert [(c.name, c.arguments) for c in named.calls] == [("add", '{"a": 1')]
    _check_stream_matches_final(NamedToolParser("add"), '{"a": 1, "b": 2}')
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral'.*hermes, llama3_json"):
        get_tool_parser("mistral")


def test_fast_string_scan_equals_the_plain_one() -> None:
    import random

    from twinserve.entrypoints.tool_parsers.json_scan import scan_string, scan_string_plain
    rng = random.Random(0)
    for _ in range(3000):
        text = '"' + "".join(rng.choice('ab"\\\\ {}') for _ in range(rng.randrange(12)))
        assert scan_string(text, 0) == scan_string_plain(text, 0), text
    long = '{"s": "' + "x\\\"" * 5000 + '"}'   # 20k characters, found without a char loop
    assert get_tool_parser("hermes")().parse_final(f"<tool_call>{{\"name\": \"f\", "
                                                   f"\"arguments\": {long}}}</tool_call>"
                                                   ).calls[0].arguments == long


# ---- the request's tools and tool_choice ---------------------------------------------------
def _tool(name: str = "f", parameters: Any = None, **extra: Any) -> dict[str, Any]:
    function = {"name": name, **({} if parameters is None else {"parameters": parameters})}
    return {"type": "function", "function": {**function, **extra}}


@pytest.mark.parametrize("tools, match", [
    ([_tool("f"), _tool("f")], r"tools\[1\]\.function\.name 'f' is given twice"),
    ([_tool("f", ["not", "a", "schema"])], r"tools\[0\]\.function\.parameters must be a JSON "
                                           "schema object"),
    ([_tool("f", {"type": "string"})], r"tools\[0\]\.function\.parameters must describe an "
                                       "object"),
    ([_tool("f", {"type": "object", "properties": {"a": {"type": "no-such"}}})],
     r"tools\[0\]\.function\.parameters is not a JSON schema twinserve can enforce"),
    ([_tool("bad name!")], r"tools\[0\]\.function\.name must be 1 to 64"),
    ([{"type": "custom", "custom": {"name": "x"}}], r'tools\[0\]\.type must be "function"'),
    ([_tool("f", None, strict=True, extra_field=1)], r"tools\[0\]\.function has unknown"),
    ([_tool(f"f{i}") for i in range(129)], "at most 128 tools"),
])
def test_bad_tools_are_errors_naming_the_field(tools: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_tools(tools)


def test_tool_choice_modes_and_refusals() -> None:
    tools = [_tool("get_weather", WEATHER), _tool("add", ADD)]
    assert tool_request(tools, None, None, True).mode == "auto"
    assert tool_request(None, None, None, False).mode == "none"
    assert tool_request(tools, "none", None, False).parser(None) is None
    no_args = tool_request([_tool("ping")], {"type": "function", "function": {"name": "ping"}},
                           None, False).structured_outputs().json
    jsonschema.validate({}, no_args)
    with pytest.raises(jsonschema.ValidationError):   # a function without parameters takes none
        jsonschema.validate({"x": 1}, no_args)
    named = tool_request(tools, {"type": "function", "function": {"name": "add"}}, None, False)
    assert named.mode == "named" and named.structured_outputs().json == ADD
    required = tool_request(tools, "required", False, False)
    schema = required.structured_outputs().json
    assert schema == required_schema(parse_tools(tools), False) and schema["maxItems"] == 1
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"city": "x", "unit": "c"}}],
                            schema)
    for args, match in [((tools, None, None, False), "requires --enable-auto-tool-choice"),
                        ((tools, {"type": "function", "function": {"name": "nope"}}, None,
                          True), "tool_choice names the function 'nope', which is not in"),
                        ((None, "required", None, True), "tool_choice 'required' needs tools"),
                        ((tools, "sometimes", None, True), "tool_choice must be"),
                        ((tools, {"type": "function"}, None, True), "tool_choice must name")]:
        with pytest.raises(ValueError, match=match):
            tool_request(*args)
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ChatServerOptions(enable_auto_tool_choice=True)


# ---- chat templates ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    return with_trained_tokenizer(tiny_model_dirs["llama-tied"],
                                  tmp_path_factory.mktemp("tools") / "llama-tok", CORPUS, TOOLS_TEMPLATE)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from twinserve.gpu.engine.tokenizer import Tokenizer
    return Tokenizer.from_dir(tiny_dir)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_template_without_tools_gets_the_hermes_system_prompt(tokenizer) -> None:
    tools = [t.definition for t in parse_tools(TOOLS)]
    text = render_chat(tokenizer, HISTORY, ChatTemplateOptions(chat_template=CHATML,
                                                               tools=tools))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and "<tools>\n" in system
    assert json.dumps(tools[0], ensure_ascii=False) in system
    assert "<tool_call>\n{\"name\": <function-name>" in system
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    llama = render_chat(tokenizer, HISTORY[:1], ChatTemplateOptions(chat_template=CHATML,
                                                                    tools=tools),
                        get_tool_parser("llama3_json")())
    assert 'Respond in the format {"name": function name, "parameters"' in llama
    with_system = render_chat(tokenizer, [{"role": "system", "content": "Be brief."},
                                          *HISTORY[:1]],
                              ChatTemplateOptions(chat_template=CHATML, tools=tools))
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_template_with_tools_gets_them_and_argument_objects(tokenizer) -> None:
    tools = [t.definition for t in parse_tools(TOOLS)]
    text = render_chat(tokenizer, HISTORY[:1], ChatTemplateOptions(tools=tools))
    assert text == "tools: get_weather add\nuser: Weather in Paris?\nassistant: "
    seen = render_chat(tokenizer, HISTORY, ChatTemplateOptions(chat_template=(
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}"
        "{% endfor %}{% endfor %}{{ tools | length }}"), tools=tools))
    assert seen == "Paris2"


def test_template_options(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    cont = render_chat(tokenizer, messages, ChatTemplateOptions(
        add_generation_prompt=False, continue_final_message=True))
    assert cont == "user: Hi\nassistant: Hel"
    kwargs = render_chat(tokenizer, messages[:1], ChatTemplateOptions(
        chat_template="{{ greeting }} {{ messages[0].content | tojson }}",
        chat_template_kwargs={"greeting": "<hey>"}))
    assert kwargs == '<hey> "Hi"'
    for options, match in [
            (ChatTemplateOptions(continue_final_message=True), "continue_final_message"),
            (ChatTemplateOptions(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
            (ChatTemplateOptions(chat_template="{% for %}"), "chat_template does not compile"),
            (ChatTemplateOptions(chat_template="{{ raise_exception('no system') }}"),
             "chat_template could not be applied: no system"),
            (ChatTemplateOptions(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"),
             "chat_template could not be applied"),   # the sandbox
    ]:
        with pytest.raises(ValueError, match=match):
            render_chat(tokenizer, messages, options)


def test_chat_template_flag_takes_a_file_or_a_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(CHATML)
    assert load_chat_template(str(path)) == CHATML
    assert load_chat_template(CHATML) == CHATML
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))


# ---- LLM.chat ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    from twinserve.entrypoints.llm import LLM
    return LLM(str(tiny_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
               kv_cache_memory_bytes=8 * 2**20)


def test_llm_chat_takes_tools_and_a_chat_template(tiny_llm) -> None:
    from twinserve.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=4)
    out = tiny_llm.chat([{"role": "user", "content": "yes"}], params, tools=TOOLS,
                        use_tqdm=False)[0]
    assert out.prompt == "tools: get_weather add\nuser: yes\nassistant: "
    out = tiny_llm.chat([{"role": "user", "content": "yes"}], params, use_tqdm=False,
                        chat_template="Q: {{ messages[-1].content }} A:")[0]
    assert out.prompt == "Q: yes A:"
    with pytest.raises(ValueError, match="given twice"):
        tiny_llm.chat([{"role": "user", "content": "yes"}], params, tools=TOOLS * 2)


def test_chat_cli_takes_a_chat_template(tiny_dir, capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    assert main(["chat", "yes", "--model", str(tiny_dir), "--max-tokens", "2", "--dtype",
                 "float32", "--kv-cache-memory-bytes", str(8 << 20), "--chat-template",
                 "Q: {{ messages[0].content }} A:"]) == 0
    assert "### 'yes' [length]" in capsys.readouterr().out
    assert main(["chat", "yes", "--model", str(tiny_dir), "--chat-template", "missing.jinja"]) \
        == 2


# ---- the server ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(tiny_dir) -> Iterator[str]:
    from stub_server import serve

    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineArgs(model=str(tiny_dir), dtype="float32", device="cpu",
                                  kv_cache_memory_bytes=1 << 23), usage_context="server")
    with serve(engine, served_model_name="tiny", enable_auto_tool_choice=True,
               tool_call_parser="hermes", trust_request_chat_template=True) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", timeout=120,
                         max_retries=0)


USER = [{"role": "user", "content": "yes no"}]


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(**{"model": "tiny", "messages": USER,
                                             "max_tokens": 120, "temperature": 0, **kwargs})


def _stream(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list, str | None]:
    """Content, [(id, name, arguments)] and finish reason reassembled from a stream."""
    content, calls, finish = None, {}, None
    for chunk in _create(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.id is not None:
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, list(calls.values()), finish


def _check_calls(message: Any) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


@pytest.mark.parametrize("choice, parallel", [
    ("required", True), ("required", False),
    ({"type": "function", "function": {"name": "add"}}, True)])
def test_forced_tool_calls_validate_and_stream_the_same(client, choice, parallel) -> None:
    out = _create(client, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    message = out.choices[0].message
    # OpenAI and vLLM end a named choice with "stop", the others with "tool_calls"
    assert out.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
    assert message.content is None and message.tool_calls, message
    calls = _check_calls(message)
    if isinstance(choice, dict):
        assert [name for name, _ in calls] == ["add"]
    if not parallel:
        assert len(calls) == 1
    content, streamed, finish = _stream(client, tools=TOOLS, tool_choice=choice,
                                        parallel_tool_calls=parallel)
    assert finish == out.choices[0].finish_reason and content is None
    assert [(name, args) for _, name, args in streamed] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert all(i.startswith("chatcmpl-tool-") for i, _, _ in streamed)


HERMES_OUTPUT = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                 '"unit": "c"}}\n</tool_call>')


def test_auto_tool_choice_parses_the_output_streaming_or_not(client) -> None:
    force = {"structured_outputs": {"choice": [HERMES_OUTPUT]}}   # the model says exactly this
    out = _create(client, tools=TOOLS, extra_body=force)
    message = out.choices[0].message
    assert out.choices[0].finish_reason == "tool_calls" and message.content == "Sure. "
    assert _check_calls(message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    content, streamed, finish = _stream(client, tools=TOOLS, extra_body=force)
    assert (content, finish) == ("Sure. ", "tool_calls")
    assert [(n, a) for _, n, a in streamed] == [("get_weather", message.tool_calls[0]
                                                 .function.arguments)]
    plain = _create(client, tools=TOOLS, tool_choice="none", extra_body=force)
    assert plain.choices[0].message.content == HERMES_OUTPUT
    assert not plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "stop"
    noise = _create(client, tools=TOOLS, max_tokens=8)   # free text: no calls in it
    assert noise.choices[0].finish_reason != "tool_calls"
    assert noise.choices[0].message.content is not None


def test_auto_with_parallel_tool_calls_false_keeps_the_first_call(client) -> None:
    two = HERMES_OUTPUT + '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    force = {"structured_outputs": {"choice": [two]}}
    both = _create(client, tools=TOOLS, extra_body=force)
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "add"]
    first = _create(client, tools=TOOLS, parallel_tool_calls=False, extra_body=force)
    assert [c.function.name for c in first.choices[0].message.tool_calls] == ["get_weather"]
    _, streamed, finish = _stream(client, tools=TOOLS, parallel_tool_calls=False,
                                  extra_body=force)
    assert [n for _, n, _ in streamed] == ["get_weather"] and finish == "tool_calls"


def test_history_with_tool_calls_and_a_request_template(client, base_url) -> None:
    import httpx
    out = client.chat.completions.create(
        model="tiny", messages=copy.deepcopy(HISTORY), max_tokens=2,
        extra_body={"chat_template": CHATML})   # (with tools the prompt outgrows the model)
    assert out.choices[0].finish_reason == "length"
    r = httpx.post(base_url + "/tokenize", json={"messages": HISTORY, "tools": TOOLS,
                                                  "chat_template": CHATML}, timeout=60)
    assert r.status_code == 200, r.text
    r2 = httpx.post(base_url + "/tokenize", json={"messages": HISTORY, "chat_template": CHATML},
                    timeout=60)
    assert r.json()["count"] > r2.json()["count"]   # the tools' system prompt


@pytest.mark.parametrize("kwargs, param", [
    (dict(tools=TOOLS * 2), "tools"),
    (dict(tools=[_tool("f", {"type": "array"})]), "tools"),
    (dict(tools=[_tool(f"f{i}") for i in range(129)]), "tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
    (dict(extra_body={"chat_template": "{% if %}"}), "chat_template"),
    (dict(extra_body={"chat_template_kwargs": {"tools": []}}), "chat_template_kwargs"),
    (dict(extra_body={"continue_final_message": True}), "continue_final_message"),
    (dict(messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "x"}]}]),
     "messages"),
    (dict(messages=[{"role": "tool", "content": "sunny"}]), "messages"),
])
def test_bad_requests_are_400s_naming_the_field(client, kwargs, param) -> None:
    kwargs = {"model": "tiny", "messages": USER, "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kwargs)
    assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body


def test_request_templates_need_the_trust_flag(tiny_dir) -> None:
    import httpx
    from stub_server import StubEngine, serve
    with serve(StubEngine(), served_model_name="stub") as url:
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": USER, "max_tokens": 1, "chat_template": CHATML})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
        r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
            "messages": USER, "max_tokens": 1, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
