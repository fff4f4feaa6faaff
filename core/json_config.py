"""What vLLM's JSON-valued engine arguments (``--speculative-config``, ``--kv-transfer-config``)
share: the object, a mapping or JSON text, turned into one validated config dataclass."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, ClassVar, Self, cast


class JsonConfig:
    """``from_json`` and ``of`` for a slotted config dataclass whose ``from_dict`` validates;
    ``CONFIG_NAME`` names the argument in errors."""

    __slots__ = ()
    CONFIG_NAME: ClassVar[str]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        raise NotImplementedError

    @classmethod
    def checked_keys(cls, data: object) -> dict[str, Any]:
        """``data`` as a dict of the dataclass's own fields; ValueError naming a non-mapping or
        each unknown key."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{cls.CONFIG_NAME} must be a mapping, got {type(data).__name__}.")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ValueError(f"{cls.CONFIG_NAME}: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))}).")
        return dict(data)

    @classmethod
    def from_json(cls, text: str) -> Self:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cls.CONFIG_NAME} is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def of(cls, value: Self | Mapping[str, Any] | str | None) -> Self | None:
        """A config from what a user may pass (the object, a mapping, JSON text or None)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.from_json(value)
        return cls.from_dict(cast(Mapping[str, Any], value))  # from_dict checks it is one
