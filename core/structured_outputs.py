"""``StructuredOutputsParams``: vLLM's request for constrained decoding (plain data, no engine).

Exactly one of ``json`` (a JSON schema, dict or string), ``regex``, ``choice`` (a list of
strings), ``grammar`` (a Lark grammar) or ``json_object=True`` (any JSON object). The backend that
samples compiles it (``gpu/worker/structured_outputs.py``); here only the shape is checked.

``disable_additional_properties`` (vLLM's name, default True here: strict, as xgrammar and OpenAI's
strict mode): an object schema that names its properties gets no others, an array with
``prefixItems`` no further items, unless the schema says otherwise; False keeps JSON Schema's
lenient reading (anything not forbidden may be generated).
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_additional_properties",)


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_additional_properties: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises ``ValueError`` naming the field unless exactly one kind is given, well typed."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar or json_object; got {given or 'none'}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError("structured_outputs.json must be a JSON schema (a dict or a "
                             f"string), got {type(self.json).__name__}.")
        if isinstance(self.json, str):
            try:
                schema = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("structured_outputs.json must be a JSON schema object.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if isinstance(self.choice, tuple):
                self.choice = list(self.choice)
            if not isinstance(self.choice, list) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of "
                                 "non-empty strings.")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a boolean.")
        if not isinstance(self.disable_additional_properties, bool):
            raise ValueError("structured_outputs.disable_additional_properties must be a "
                             "boolean.")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The kind's value as one string (dict schemas and choice lists as canonical JSON)."""
        kind = self.kind
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, dict):
            return _json.dumps(value, sort_keys=True)
        if kind == "choice":
            return _json.dumps(value)
        if kind == "json_object":
            return ""
        return value

    @property
    def key(self) -> tuple[str, str]:
        """What a compiled grammar is cached by."""
        strict = "" if self.disable_additional_properties else "lenient:"
        return self.kind, strict + self.spec

    @classmethod
    def from_value(cls, value: Any) -> StructuredOutputsParams:
        """A ``StructuredOutputsParams`` as is, or one built from a dict of its fields."""
        if isinstance(value, cls):
            value.validate()
            return value
        if isinstance(value, dict):
            unknown = sorted(set(value) - set(KINDS) - set(OPTIONS))
            if unknown:
                raise ValueError(f"structured_outputs has unknown field(s) {unknown}; "
                                 f"twinserve knows {list(KINDS + OPTIONS)}.")
            return cls(**value)
        raise ValueError("structured_outputs must be a StructuredOutputsParams or a dict, got "
                         f"{type(value).__name__}.")
