"""What a JSON schema promises before llguidance compiles it: strict closing and finiteness.

``strict_schema`` is xgrammar's strict mode (and OpenAI's strict structured outputs): an object
schema that names its ``properties`` and says nothing about others gets
``"additionalProperties": false``, an array with ``prefixItems`` and no ``items`` gets
``"items": false``. Decisions: an object schema that names no properties (``{"type": "object"}``)
stays a free-form object, since that is what it asks for; members of an ``allOf`` and schemas
holding one are left open, because closing each part of an intersection would forbid the
properties its other parts name. llguidance's JSON options (separators, whitespace, ``lenient``:
ignore unsupported keywords) set no default for ``additionalProperties``, so the schema itself is
rewritten, as vLLM's guidance backend does for its ``disable_additional_properties``.

``first_unsatisfiable`` finds a schema that no finite JSON value satisfies (a required property
whose schema refers back to itself, ``{"$ref": "#"}``, ``false``, ``{"enum": []}``): the least
fixed point of "this schema has a finite instance" over the schemas it refers to.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

Schema = dict[str, Any] | bool
MAX_SCHEMA_DEPTH = 64  # nested objects and arrays in a schema; the checks below recurse over it

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "additionalItems", "contains", "not", "if", "then",
               "else", "propertyNames", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def check_depth(schema: Any, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """ValueError when ``schema`` nests objects and arrays deeper than ``limit``: a client's
    schema is bounded before anything recurses over it. Iterative, so any depth is measured."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > limit:
            raise ValueError(f"the schema nests deeper than {limit} levels of objects and "
                             "arrays; flatten it (or use $defs and $ref).")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` closed as described in the module doc (the input is not changed)."""
    return _close(schema, in_all_of=False)


def _close(node: Any, in_all_of: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _close(v, False) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_close(v, key == "allOf") for v in value]
        elif (key in _SCHEMA_ONE or key == "items") and isinstance(value, dict):
            out[key] = _close(value, False)
        elif key == "items" and isinstance(value, list):  # draft 4-7 tuple form
            out[key] = [_close(v, False) for v in value]
        else:
            out[key] = value
    open_ok = in_all_of or "allOf" in out
    if "properties" in out and not open_ok and not any(
            k in out for k in ("additionalProperties", "unevaluatedProperties",
                               "patternProperties")):
        out["additionalProperties"] = False
    if "prefixItems" in out and not open_ok and not any(
            k in out for k in ("items", "unevaluatedItems")):
        out["items"] = False
    return out


def first_unsatisfiable(root: Any) -> str | None:
    """None if ``root`` has a finite instance, else the JSON pointer (``#/$defs/n``) of the
    schema whose every instance would be infinite or impossible."""
    known: set[str] = set()  # pointers proven to have a finite instance
    while True:
        before = len(known)
        last = _Pass(root, known)
        last.finite("#", root, frozenset())
        if "#" in known:
            return None
        if len(known) == before:
            return last.culprit()


class _Pass:
    """One bottom-up pass: a schema met again while it is being evaluated counts as having no
    finite instance, unless an earlier pass proved it has one (``known`` grows monotonically,
    so the passes reach the least fixed point)."""

    __slots__ = ("root", "known", "seen", "blame")

    def __init__(self, root: Any, known: set[str]) -> None:
        self.root = root
        self.known = known
        self.seen: dict[str, bool] = {}
        self.blame: dict[str, str] = {}  # a schema without finite instance -> a part to blame

    def culprit(self) -> str:
        """The innermost schema on the blame chain from the root: where it loops back, or the
        part that has no instance at all (``false``, an empty enum)."""
        where, visited = "#", {"#"}
        while where in self.blame and self.blame[where] not in visited:
            where = self.blame[where]
            visited.add(where)
        return where

    def _fails(self, where: str, part: str, node: Any, stack: frozenset[str]) -> bool:
        if self.finite(part, node, stack):
            return False
        self.blame.setdefault(where, part)
        return True

    def finite(self, where: str, node: Any, stack: frozenset[str]) -> bool:
        if where in self.known:
            return True
        if where in stack:
            return False
        if where in self.seen:
            return self.seen[where]
        ok = self._node(where, node, stack | {where})
        self.seen[where] = ok
        if ok:
            self.known.add(where)
        return ok

    def _node(self, where: str, node: Any, stack: frozenset[str]) -> bool:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            return True  # not a schema: llguidance's own check names it
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target = _resolve(self.root, ref)
            if target is not _MISSING and self._fails(where, _pointer(ref), target, stack):
                return False
        if "enum" in node and isinstance(node["enum"], list) and not node["enum"]:
            return False
        if "const" in node:
            return True
        for key, need_all in (("allOf", True), ("anyOf", False), ("oneOf", False)):
            parts = node.get(key)
            if isinstance(parts, list) and parts:
                fails = (self._fails(where, f"{where}/{key}/{i}", p, stack)
                         for i, p in enumerate(parts))
                if any(fails) if need_all else all(fails):
                    return False
        return self._typed(where, node, stack)

    def _typed(self, where: str, node: dict[str, Any], stack: frozenset[str]) -> bool:
        types = node.get("type")
        types = [types] if isinstance(types, str) else types
        if isinstance(types, list) and any(t not in ("object", "array") for t in types):
            return True  # a scalar is always finite
        if types is None and not any(k in node for k in ("properties", "required", "items",
                                                          "prefixItems", "minItems")):
            return True
        kinds = set(types) if isinstance(types, list) else {"object", "array"}
        return ("object" in kinds and self._object(where, node, stack)) or \
            ("array" in kinds and self._array(where, node, stack))

    def _object(self, where: str, node: dict[str, Any], stack: frozenset[str]) -> bool:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        for name in node.get("required") or ():
            part = f"{where}/properties/{name}" if name in properties \
                else f"{where}/additionalProperties"
            if self._fails(where, part, properties.get(name, extra), stack):
                return False
        return True

    def _array(self, where: str, node: dict[str, Any], stack: frozenset[str]) -> bool:
        need = node.get("minItems", 0)
        need = need if isinstance(need, int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        for i, item in enumerate(prefix[:need]):
            if self._fails(where, f"{where}/prefixItems/{i}", item, stack):
                return False
        items = node.get("items", True)
        if need > len(prefix) and isinstance(items, (dict, bool)):
            return not self._fails(where, f"{where}/items", items, stack)
        return True


_MISSING = object()


def _pointer(ref: str) -> str:
    return "#" + ref[1:] if ref != "#" else "#"


def _resolve(root: Any, ref: str) -> Any:
    node = root
    for part in _parts(ref):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _parts(ref: str) -> Iterator[str]:
    for part in ref[1:].split("/"):
        if part:
            yield part.replace("~1", "/").replace("~0", "~")
