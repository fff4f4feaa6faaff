"""Constrained decoding (llguidance): JSON-schema, regex and choice outputs, mixed batches.

A tiny random-weight Llama (tests/conftest.py) with a small byte-level BPE tokenizer trained here:
its unconstrained outputs are noise, so a valid output is the mask's doing alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import with_trained_tokenizer

from twinserve.core.sampling_params import SamplingParams
from twinserve.core.structured_outputs import StructuredOutputsParams
from twinserve.entrypoints.llm import LLM

CORPUS = ['{"name": "Ada", "age": 36, "tags": ["x", "y"], "address": {"city": "Paris"}}',
          '{"ok": true, "items": [1, 2, 3], "kind": "circle", "nested": {"a": null}}',
          "The quick brown fox jumps over the lazy dog. 0123456789 yes no maybe",
          "abc-123 def-456 red green blue"] * 20

SCHEMAS = [
    {"type": "object",
     "properties": {"name": {"type": "string", "maxLength": 8},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "kind": {"enum": ["circle", "square", "line"]}},
     "required": ["name", "age", "kind"], "additionalProperties": False},
    {"type": "object",
     "properties": {"items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
                    "address": {"type": "object",
                                "properties": {"city": {"type": "string", "maxLength": 6},
                                               "zip": {"type": "integer", "minimum": 0,
                                                       "maximum": 999}},
                                "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["items", "address"], "additionalProperties": False},
    {"type": "array", "minItems": 1, "maxItems": 3,
     "items": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
               "required": ["color"], "additionalProperties": False}},
]


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dirs, tmp_path_factory):
    return with_trained_tokenizer(tiny_model_dirs["llama-tied"],
                                  tmp_path_factory.mktemp("so") / "llama-tok", CORPUS)


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
               kv_cache_memory_bytes=8 * 2**20)


def _so(**kind) -> SamplingParams:
    params = dict(temperature=0.0, max_tokens=160)
    params.update(kind.pop("params", {}))
    return SamplingParams(structured_outputs=StructuredOutputsParams(**kind), **params)


PROMPTS = ["The quick", "abc", '{"name"', "red green"]


def test_json_schema_outputs_parse_and_validate(tiny_llm):
    params = [_so(json=s) for s in SCHEMAS] + [_so(json=json.dumps(SCHEMAS[0]))]
    params += [_so(json=s, params=dict(temperature=1.0, seed=7)) for s in SCHEMAS]
    outs = tiny_llm.generate([PROMPTS[i % 4] for i in range(len(params))], params,
                             use_tqdm=False)
    schemas = SCHEMAS + [SCHEMAS[0]] + SCHEMAS
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_and_choice(tiny_llm):
    regex = r"[a-c]{2,4}-\d{3}( (yes|no))?"
    choices = ["circle", "square", "a long answer"]
    params = [_so(regex=regex), _so(regex=regex, params=dict(temperature=1.0, seed=3)),
              _so(choice=choices), _so(choice=choices, params=dict(temperature=1.0, seed=1)),
              _so(json_object=True, params=dict(max_tokens=400))]
    outs = tiny_llm.generate(PROMPTS + ["x"], params, use_tqdm=False)
    for out in outs[:2]:
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
    for out in outs[2:4]:
        assert out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text in choices
    text = outs[4].outputs[0].text
    assert text.startswith("{")
    if outs[4].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_grammar_and_n_samples(tiny_llm):
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
    outs = tiny_llm.generate(["abc"], _so(grammar=lark, params=dict(
        n=3, temperature=1.0, seed=11, max_tokens=60)), use_tqdm=False)
    assert len(outs[0].outputs) == 3
    for c in outs[0].outputs:
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", c.text), c.text
        else:
            assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\+?\d{0,2}", c.text), c.text


def test_mixed_batch_leaves_unconstrained_requests_untouched(tiny_llm):
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in
             tiny_llm.generate(PROMPTS, [plain] * 4, use_tqdm=False)]
    mixed = tiny_llm.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[2]],
        [plain, _so(json=SCHEMAS[0]), plain, plain, plain, _so(choice=["red", "blue"])],
        use_tqdm=False)
    got = [mixed[i].outputs[0].token_ids for i in (0, 2, 3, 4)]
    assert got == [alone[0], alone[0], alone[2], alone[3]]
    assert mixed[5].outputs[0].text in ("red", "blue")
    tiny_llm.generate(PROMPTS[:1], plain, use_tqdm=False)   # its steps free the finished ones
    assert len(tiny_llm.engine.runner._structured) == 0


def test_recompute_preemption_keeps_constrained_outputs(tiny_llm, tiny_dir):
    params = [_so(json=s, params=dict(max_tokens=100)) for s in SCHEMAS] * 3
    prompts = [PROMPTS[i % 4] for i in range(len(params))]
    cramped = LLM(str(tiny_dir), dtype="float32", max_num_seqs=8, max_num_batched_tokens=256,
                  kv_cache_memory_bytes=1 << 16, block_size=16)   # 8 blocks: preempts
    outs = cramped.generate(prompts, params, use_tqdm=False)
    assert cramped.engine.scheduler.num_preemptions > 0
    roomy = tiny_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    for out, schema in zip(outs, SCHEMAS * 3):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_matcher_follows_the_output_after_recompute_and_is_freed(tiny_llm):
    from twinserve.core.request import Request
    runner = tiny_llm.engine.runner
    tok = tiny_llm.engine.tokenizer
    structured = runner._structured_outputs([Request(
        "probe", [1], _so(choice=["red"]), 0.0, eos_token_id=2)])
    params = _so(regex=r"ab(c|d)+")
    req = Request("r", [1, 5], params, 0.0, eos_token_id=2)
    char = {ch: tok.encode(ch)[0] for ch in "abcd"}   # one token per character
    req.output_token_ids.extend(char[ch] for ch in "abcd")
    rows, allowed = structured.bitmask([req])   # re-fed the output so far
    assert rows == [0] and allowed[0, char["c"]] and allowed[0, 2] and not allowed[0, char["a"]]
    del req.output_token_ids[1:]               # shorter than consumed: rebuilt from scratch
    _, allowed = structured.bitmask([req])
    assert allowed[0, char["b"]] and not allowed[0, 2] and not allowed[0, char["c"]]
    structured.free(["r", "probe"])
    assert "r" not in structured._states


def test_bad_specs_are_value_errors_naming_the_field(tiny_llm):
    with pytest.raises(ValueError, match="structured_outputs.json"):
        tiny_llm.generate("abc", _so(json={"type": "no-such-type"}), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.regex"):
        tiny_llm.generate("abc", _so(regex="a(b"), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.grammar"):
        tiny_llm.generate("abc", _so(grammar="start: undefined_rule"), use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_bundled_model_json_schema(default_model_dir):
    llm = LLM(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=64 * 2**20)
    schema = SCHEMAS[0]
    outs = llm.generate(["Describe a person as JSON:", "Capital of France?"],
                        [_so(json=schema), _so(choice=["Paris", "London"])], use_tqdm=False)
    jsonschema.validate(json.loads(outs[0].outputs[0].text), schema)
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].text in ("Paris", "London")


# ---- the server: response_format and vLLM's structured_outputs ------------------------------
@pytest.fixture(scope="module")
def client(tiny_dir):
    import openai
    from server_fixture import live_server
    with live_server(["--model", str(tiny_dir)]) as server:
        yield openai.OpenAI(base_url=server.url("/v1"), api_key="unused", timeout=120,
                            max_retries=0)


def test_server_json_schema_json_object_and_structured_outputs(client):
    import openai
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "abc"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMAS[1]}}
    out = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                         max_tokens=160, temperature=0)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMAS[1])
    stream = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                            max_tokens=160, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == out.choices[0].message.content
    obj = client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    comp = client.completions.create(model=model, prompt="abc", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    assert comp.choices[0].text in ("red", "blue") and comp.choices[0].finish_reason == "stop"
    comp = client.completions.create(model=model, prompt="abc", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r"[0-9]{3}"}})
    assert re.fullmatch(r"[0-9]{3}", comp.choices[0].text)
    for kwargs, param in [
            (dict(response_format={"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "no-such-type"}}}), "response_format"),
            (dict(response_format={"type": "xml"}), "response_format"),
            (dict(extra_body={"structured_outputs": {"regex": "a(b"}}), "structured_outputs"),
            (dict(extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}}),
             "structured_outputs")]:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                           **kwargs)
        assert err.value.status_code == 400 and err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:  # the guided_* names stay refused
        client.chat.completions.create(model=model, messages=messages, max_tokens=4,
                                       extra_body={"guided_regex": "a+"})
    assert err.value.body["param"] == "guided_regex"


def test_prefetched_grammar_gives_the_same_masks_and_stays_bounded(tiny_dir):
    from twinserve.core.request import Request
    from twinserve.gpu.worker.structured_outputs import MATCHER_CACHE_SIZE, StructuredOutputs
    cold = StructuredOutputs(tiny_dir / "tokenizer.json", 320, 2)
    warm = StructuredOutputs(tiny_dir / "tokenizer.json", 320, 2)
    params = _so(json=SCHEMAS[1])
    warm.prefetch(params.structured_outputs)
    assert len(warm._pending) == 1
    request = Request("r", [1, 5], params, 0.0, eos_token_id=2)
    _, first = warm.bitmask([request])
    assert not warm._pending and len(warm._compiled) == 1   # taken from the background job
    _, reference = cold.bitmask([Request("r", [1, 5], params, 0.0, eos_token_id=2)])
    assert (first == reference).all()
    bad = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/x"}}})
    warm.prefetch(bad)   # a failing compile surfaces on the request's own mask, not here
    with pytest.raises(ValueError, match="structured_outputs.json"):
        warm.bitmask([Request("b", [1], SamplingParams(structured_outputs=bad), 0.0,
                              eos_token_id=2)])
    for i in range(MATCHER_CACHE_SIZE + 20):   # abandoned prefetches do not pile up
        warm.prefetch(StructuredOutputsParams(regex=f"a{{{i + 1}}}"))
    assert len(warm._pending) <= MATCHER_CACHE_SIZE
    warm.close()


# ---- strict by default: nothing the schema does not name ---------------------------------------
OPEN_SCHEMAS = [  # no additionalProperties anywhere: JSON Schema's lenient reading allows more
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name"]},
    {"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"ok": {"type": "boolean"}}}},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}]}},
     "required": ["items", "pair"]},
]


def _closed(schema):
    """``schema`` with every object closed and every tuple ended, as strict mode reads it."""
    if not isinstance(schema, dict):
        return schema
    out = {k: ({n: _closed(s) for n, s in v.items()} if k == "properties" else
               [_closed(s) for s in v] if k == "prefixItems" else
               _closed(v) if k == "items" else v) for k, v in schema.items()}
    if "properties" in out:
        out.setdefault("additionalProperties", False)
    if "prefixItems" in out:
        out.setdefault("items", False)
    return out


def _sampled(tiny_llm, schema, lenient: bool, n: int = 12):
    so = StructuredOutputsParams(json=schema, disable_additional_properties=not lenient)
    params = [SamplingParams(structured_outputs=so, temperature=1.0, seed=s, max_tokens=120)
              for s in range(n)]
    return [o.outputs[0] for o in tiny_llm.generate([PROMPTS[s % 4] for s in range(n)], params,
                                                    use_tqdm=False)]


@pytest.mark.parametrize("schema", OPEN_SCHEMAS)
def test_strict_outputs_never_hold_what_the_schema_does_not_name(tiny_llm, schema):
    for c in _sampled(tiny_llm, schema, lenient=False):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), _closed(schema))


def test_disable_additional_properties_false_keeps_the_lenient_reading(tiny_llm):
    """The noise model invents properties as soon as the mask lets it (so the strict test
    above would fail without strict mode); the outputs still validate against the schema."""
    outs = _sampled(tiny_llm, OPEN_SCHEMAS[0], lenient=True)
    extra = 0
    for c in outs:
        if c.finish_reason == "stop":
            value = json.loads(c.text)
            jsonschema.validate(value, OPEN_SCHEMAS[0])
            extra += bool(set(value) - {"name", "age"})
        else:
            extra += 1  # ran on inventing properties until max_tokens
    assert extra > 0


@pytest.mark.parametrize("spec, where", [
    ({"json": {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}},
                                "required": ["c"]}}, "$ref": "#/$defs/n"}},
     "#/$defs/n/properties/c"),
    ({"json": {"$ref": "#"}}, "the schema at # "),
    ({"json": {"type": "array", "minItems": 1, "items": False}}, "#/items"),
    ({"grammar": 'start: start "a"'}, "structured_outputs.grammar is unsatisfiable"),
    ({"grammar": 'start: "a" b\nb: "c" b'}, "structured_outputs.grammar is unsatisfiable"),
    ({"regex": "a[^\\s\\S]"}, "structured_outputs.regex is unsatisfiable"),
])
def test_specs_no_finite_output_satisfies_are_value_errors(tiny_llm, spec, where):
    with pytest.raises(ValueError, match="unsatisfiable") as err:
        tiny_llm.generate("abc", SamplingParams(structured_outputs=spec, max_tokens=8),
                          use_tqdm=False)
    assert where in str(err.value)
    assert not tiny_llm.engine.has_unfinished_requests()


def test_satisfiable_recursion_and_long_records_are_accepted():
    from twinserve.gpu.worker.structured_outputs import compile_grammar
    tree = {"$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}},
            "$ref": "#/$defs/n"}  # c is optional: {} ends it
    either = {"$defs": {"n": {"anyOf": [{"type": "integer"}, {
        "type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}]}},
        "$ref": "#/$defs/n"}
    long = {"type": "object", "properties": {"t": {"type": "string", "minLength": 4000}},
            "required": ["t"]}
    for spec in ({"json": tree}, {"json": either}, {"json": long},
                 {"grammar": 'start: "a" start | "b"'}, {"grammar": 'start: /[a-z]{300}/'}):
        assert compile_grammar(StructuredOutputsParams(**spec))


def test_a_dead_end_finishes_with_error_not_stop(tiny_llm, monkeypatch):
    """A dead end the checks cannot see (here: the search switched off) ends the request with
    "error" (vLLM's FinishReason.ERROR), never "stop" with text the grammar does not match."""
    import twinserve.gpu.worker.structured_outputs as so_module
    monkeypatch.setattr(so_module, "_no_finite_output", lambda grammar: False)
    params = SamplingParams(structured_outputs={"grammar": 'start: "a" b\nb: "c" b'},
                            temperature=0.0, max_tokens=20)
    outs = tiny_llm.generate(["abc", "red green"], [params, _so(regex="[0-9]{3}")],
                             use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error", outs[0].outputs[0]
    assert outs[1].outputs[0].finish_reason == "stop"  # its batch neighbour is untouched
    assert re.fullmatch("[0-9]{3}", outs[1].outputs[0].text)
    assert not tiny_llm.engine.has_unfinished_requests()
