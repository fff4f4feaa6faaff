"""The strict reading of JSON schemas and the finiteness check (no model needed)."""

from __future__ import annotations

import pytest

from twinserve.gpu.worker.schema_contract import (
    MAX_SCHEMA_DEPTH,
    check_depth,
    first_unsatisfiable,
    strict_schema,
)

POINT = {"type": "object", "properties": {"x": {"type": "integer"}}}


def test_strict_closes_named_objects_and_tuples_everywhere_without_changing_the_input() -> None:
    schema = {"type": "object", "properties": {
        "p": POINT, "list": {"type": "array", "items": POINT},
        "pair": {"type": "array", "prefixItems": [POINT, {"type": "string"}]},
        "either": {"anyOf": [{"$ref": "#/$defs/q"}, POINT]}},
        "$defs": {"q": {"type": "object", "properties": {"y": {"type": "string"}}}}}
    closed = strict_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False
    assert props["p"]["additionalProperties"] is False
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["pair"]["items"] is False
    assert props["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert props["either"]["anyOf"][1]["additionalProperties"] is False
    assert closed["$defs"]["q"]["additionalProperties"] is False
    assert "additionalProperties" not in schema and "additionalProperties" not in POINT


def test_strict_keeps_what_the_schema_says_and_leaves_free_forms_and_intersections_open() -> None:
    explicit = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}
    assert strict_schema(explicit) == explicit
    patterned = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {}}}
    assert strict_schema(patterned) == patterned
    assert strict_schema({"type": "object"}) == {"type": "object"}
    both = {"allOf": [POINT, {"type": "object", "properties": {"y": {}}}]}
    assert strict_schema(both) == both
    open_tuple = {"type": "array", "prefixItems": [{}], "items": {"type": "integer"}}
    assert strict_schema(open_tuple) == open_tuple


@pytest.mark.parametrize("schema, where", [
    ({"$ref": "#"}, "#"),
    (False, "#"),
    ({"enum": []}, "#"),
    ({"type": "object", "properties": {"a": {"enum": []}}, "required": ["a"]}, "#/properties/a"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#/properties/a"),
    ({"type": "array", "minItems": 2, "prefixItems": [{}, False]}, "#/prefixItems/1"),
    ({"type": "object", "required": ["z"], "additionalProperties": False},
     "#/additionalProperties"),
    ({"allOf": [{}, {"$ref": "#/$defs/loop"}], "$defs": {"loop": {"$ref": "#/$defs/loop"}}},
     "#/$defs/loop"),
])
def test_schemas_without_a_finite_instance_name_the_part_to_blame(schema, where) -> None:
    assert first_unsatisfiable(schema) == where


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}},            # optional recursion
    {"anyOf": [{"type": "null"}, {"type": "array", "minItems": 1, "items": {"$ref": "#"}}]},
    {"type": ["object", "null"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "array", "minItems": 3},
    {"$ref": "#/$defs/missing"},                                        # llguidance names it
])
def test_schemas_with_a_finite_instance_pass(schema) -> None:
    assert first_unsatisfiable(schema) is None


def test_a_schema_is_bounded_in_depth_before_anything_recurses_over_it() -> None:
    deepest: object = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH - 1):
        deepest = [deepest]
    check_depth(deepest)  # at the limit: accepted
    with pytest.raises(ValueError, match=f"nests deeper than {MAX_SCHEMA_DEPTH} levels"):
        check_depth([deepest])
    nested: dict = {"type": "string"}
    for _ in range(2000):  # far past Python's recursion limit: still measured, and refused
        nested = {"type": "object", "properties": {"a": nested}}
    with pytest.raises(ValueError, match="nests deeper"):
        check_depth(nested)
    allowed: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):  # the deepest object nesting the bound admits
        allowed = {"type": "object", "properties": {"a": allowed}, "required": ["a"]}
    check_depth(allowed)
    assert first_unsatisfiable(allowed) is None and "additionalProperties" in strict_schema(allowed)
