"""The served models, as vLLM's ``OpenAIServingModels``: the base model and its LoRA adapters
(``/v1/models``), the adapters given at start-up (``--lora-modules``) and, when
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true, ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``.

A client picks an adapter by sending its name as ``model``. Adapters get ids 1, 2, ... in load
order, never reused. The engine knows an adapter as ``name@id`` (its ``LoRARequest.lora_name``),
which is also its key in the prefix cache and in the device slots: an adapter loaded under a
name used before gets a new key, so it can never hit the KV blocks or the slot of the one it
replaced.

An adapter is checked when it is loaded: read on the engine thread, as a request would (vLLM
does the same), so a bad one is refused with the reason before a request needs it. Unloading an
adapter that has requests in flight is refused (400); vLLM lets it go, which here would cut
their work short.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import PlainTextResponse, Response

from twinserve.core.errors import EngineOverloaded
from twinserve.core.lora import LoRARequest
from twinserve.entrypoints.openai.http_errors import APIError
from twinserve.entrypoints.openai.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)

if TYPE_CHECKING:
    from twinserve.entrypoints.openai.async_engine import AsyncEngine
    from twinserve.entrypoints.openai.server_state import ServerState
    from twinserve.gpu.engine.llm_engine import LLMEngine

logger = logging.getLogger("twinserve.server")

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096
MAX_SERVED_LORAS = 1024
STARTUP_LOAD_TIMEOUT_S = 600.0


def runtime_lora_updating() -> bool:
    """vLLM's switch for the load/unload endpoints: ``1`` or ``true``."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


# ==== --lora-modules =============================================================================
@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        for key in ("name", "path"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"the adapter's {key} must be a non-empty string, got {value!r}.")
        if self.base_model_name is not None and not isinstance(self.base_model_name, str):
            raise ValueError(f"base_model_name must be a string, got {self.base_model_name!r}.")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> LoRAModulePath:
        unknown = sorted(set(data) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                             "name, path and base_model_name.")
        if "name" not in data or "path" not in data:
            raise ValueError("both 'name' and 'path' must be given.")
        return cls(data["name"], data["path"], data.get("base_model_name"))


def parse_lora_module(text: str) -> LoRAModulePath:
    """argparse ``type`` of ``--lora-modules``: ``name=path`` or a JSON object."""
    try:
        return lora_module(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def lora_module(item: str | Mapping[str, Any] | LoRAModulePath) -> LoRAModulePath:
    """An entry as parsed from the command line, or as a ``--config`` YAML file gives it (a
    string or a mapping)."""
    if isinstance(item, LoRAModulePath):
        return item
    if isinstance(item, Mapping):
        return LoRAModulePath.from_mapping(item)
    if not isinstance(item, str):
        raise ValueError(f"expected name=path or a JSON object, got {item!r}.")
    if item.lstrip().startswith("{"):
        try:
            data = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc}).") from None
        if not isinstance(data, dict):
            raise ValueError("the JSON form must be an object.")
        return LoRAModulePath.from_mapping(data)
    name, sep, path = item.partition("=")
    if not sep:
        raise ValueError("expected name=path or a JSON object.")
    return LoRAModulePath(name.strip(), path.strip())


def static_lora_modules(args: argparse.Namespace, base_model: str) -> list[LoRAModulePath]:
    """``--lora-modules`` parsed (a ``--config`` file gives strings or mappings); a
    ``base_model_name`` must be the served model."""
    items = getattr(args, "lora_modules", None) or []
    if not isinstance(items, list):
        items = [items]
    try:
        modules = [lora_module(item) for item in items]
    except ValueError as exc:
        raise ValueError(f"--lora-modules: {exc}") from None
    for module in modules:
        if module.base_model_name not in (None, base_model):
            raise ValueError(f"--lora-modules {module.name}: base_model_name "
                             f"{module.base_model_name!r} is not the served model "
                             f"{base_model!r}.")
    return modules


# ==== the registry ===============================================================================
def engine_key(name: str, lora_id: int) -> str:
    """The adapter's name in the engine (prefix-cache blocks, device slots, host memory)."""
    return f"{name}@{lora_id}"


def public_name(key: str) -> str:
    return key.rpartition("@")[0] or key


def public_message(message: str, request: LoRARequest) -> str:
    """An engine message with the adapter's engine key replaced by its served name."""
    return message.replace(repr(request.lora_name), repr(public_name(request.lora_name)))


@dataclass(slots=True)
class ServedLoRA:
    """An adapter clients may name as ``model``; ``in_flight`` counts the engine sequences
    (prompts x n) of the API calls using it, from their start until their end."""

    name: str
    request: LoRARequest
    parent: str
    in_flight: int = 0

    @property
    def key(self) -> str:
        return self.request.lora_name

    def public(self, message: str) -> str:
        return public_message(message, self.request)


@dataclass(slots=True)
class LoRARegistry:
    """The served adapters by name, plus the names being loaded (a second load of one of them
    is refused as already loaded)."""

    base_model: str
    served: dict[str, ServedLoRA] = field(default_factory=dict)
    loading: set[str] = field(default_factory=set)
    next_id: int = 1

    def get(self, name: str) -> ServedLoRA | None:
        return self.served.get(name)

    def reserve(self, name: str, path: str) -> LoRARequest:
        """The engine's request for a new adapter ``name``; raises APIError 400 for a name
        that is taken or too long, a bad path, or too many adapters."""
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "lora_name" if not name else "lora_path")
        if len(name) > MAX_LORA_NAME_CHARS:
            raise APIError(400, f"lora_name may be at most {MAX_LORA_NAME_CHARS} characters, got "
                                f"{len(name)}.", "lora_name")
        if len(path) > MAX_LORA_PATH_CHARS:
            raise APIError(400, f"lora_path may be at most {MAX_LORA_PATH_CHARS} characters.",
                           "lora_path")
        if name == self.base_model:
            raise APIError(400, f"The lora adapter name '{name}' is the base model's.",
                           "lora_name")
        if name in self.served or name in self.loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           "lora_name")
        if len(self.served) + len(self.loading) >= MAX_SERVED_LORAS:
            raise APIError(400, f"At most {MAX_SERVED_LORAS} LoRA adapters can be served; "
                                "unload one first.", "lora_name")
        lora_id, self.next_id = self.next_id, self.next_id + 1
        self.loading.add(name)
        return LoRARequest(engine_key(name, lora_id), lora_id, path)

    def commit(self, name: str, request: LoRARequest) -> ServedLoRA:
        self.loading.discard(name)
        served = self.served[name] = ServedLoRA(name, request, self.base_model)
        return served

    def abandon(self, name: str) -> None:
        self.loading.discard(name)

    def find(self, name: str | None, lora_id: int | None) -> ServedLoRA:
        """The adapter named ``name`` (or with id ``lora_id``); 404 if none."""
        if name is None and lora_id is None:
            raise APIError(400, "Either 'lora_name' or 'lora_int_id' must be provided.",
                           "lora_name")
        for served in self.served.values():
            if name in (None, served.name) and lora_id in (None, served.request.lora_int_id):
                return served
        raise APIError(404, f"The lora adapter '{name if name is not None else lora_id}' "
                            "cannot be found.", "lora_name")

    def hold(self, served: ServedLoRA, num_seqs: int) -> None:
        if self.served.get(served.name) is not served:  # unloaded since the request named it
            raise APIError(404, f"The model `{served.name}` does not exist.", "model")
        served.in_flight += num_seqs

    def release(self, served: ServedLoRA, num_seqs: int) -> None:
        served.in_flight = max(served.in_flight - num_seqs, 0)

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=s.name, root=s.request.lora_path, parent=s.parent,
                          max_model_len=max_model_len) for s in self.served.values()]

    def waiting(self, running: Mapping[str, int]) -> list[str]:
        """Adapters with more sequences in flight than running (``running``: engine key ->
        running sequences, the scheduler's ``loras.users``). A sequence counts as in flight
        until the server has handed back its end, so an adapter may show as waiting for the
        moment between its last token and the response's end."""
        return sorted(s.name for s in self.served.values() if s.in_flight > running.get(s.key, 0))


# ==== on the engine thread =======================================================================
def load_into_engine(engine: LLMEngine, request: LoRARequest) -> None:
    """Reads and checks the adapter as a request would, leaving it in host memory (unpinned)
    for the requests to come. Raises ValueError saying what does not fit."""
    manager = getattr(engine.runner, "lora", None)
    if manager is None:
        raise ValueError("LoRA is not enabled: start the server with --enable-lora.")
    try:
        manager.acquire(request)
    except EngineOverloaded:  # host memory holds only adapters in use: check, keep nothing
        from twinserve.gpu.lora.lora_weights import load_peft_adapter
        load_peft_adapter(request, manager.config, manager.lora_config.max_lora_rank)
        return
    manager.release(request.lora_name)


def unload_from_engine(engine: LLMEngine, key: str) -> None:
    manager = getattr(engine.runner, "lora", None)
    if manager is not None:
        manager.drop(key)


def max_loras_of(engine: Any) -> int | None:
    """The engine's ``max_loras`` (None: LoRA is not enabled)."""
    manager = getattr(getattr(engine, "runner", None), "lora", None)
    return None if manager is None else int(manager.lora_config.max_loras)


def register_static_loras(async_engine: AsyncEngine, registry: LoRARegistry,
                          modules: list[LoRAModulePath]) -> None:
    """Loads each ``--lora-modules`` entry before the server listens; raises ValueError with
    the reason for the first one that cannot be served."""
    if modules and max_loras_of(async_engine.engine) is None:
        raise ValueError("--lora-modules needs --enable-lora (LoRA is not enabled in the "
                         "engine).")
    for module in modules:
        where = f"--lora-modules {module.name}={module.path}"
        try:
            request = registry.reserve(module.name, module.path)
        except APIError as exc:
            raise ValueError(f"{where}: {exc.message}") from None
        try:
            async_engine.call_blocking(lambda e, r=request: load_into_engine(e, r),
                                       STARTUP_LOAD_TIMEOUT_S)
        except (ValueError, EngineOverloaded) as exc:
            registry.abandon(module.name)
            raise ValueError(f"{where}: {public_message(str(exc), request)}") from None
        registry.commit(module.name, request)
        logger.info("LoRA adapter %r loaded from %s", module.name, module.path)


# ==== the routes' handlers =======================================================================
def model_list(state: ServerState) -> ModelList:
    base = ModelCard(id=state.model_name, root=state.model_root,
                     max_model_len=state.max_model_len)
    return ModelList(data=[base, *state.loras.cards(state.max_model_len)])


def resolve_model(state: ServerState, model: str | None) -> ServedLoRA | None:
    """The adapter a request's ``model`` names (None: the base model); 404 for any other."""
    if model is None or model == state.model_name:
        return None
    served = state.loras.get(model)
    if served is None:
        raise APIError(404, f"The model `{model}` does not exist.", "model")
    return served


async def load_lora_adapter(state: ServerState, body: LoadLoRAAdapterRequest) -> Response:
    registry = state.loras
    request = registry.reserve(body.lora_name, body.lora_path)
    try:
        await state.async_engine.call(lambda e: load_into_engine(e, request))
    except ValueError as exc:
        registry.abandon(body.lora_name)
        raise APIError(400, public_message(str(exc), request), "lora_path") from None
    except BaseException:
        registry.abandon(body.lora_name)
        raise
    registry.commit(body.lora_name, request)
    logger.info("Loaded new LoRA adapter: name %r, path %r", body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def unload_lora_adapter(state: ServerState, body: UnloadLoRAAdapterRequest) -> Response:
    registry = state.loras
    served = registry.find(body.lora_name, body.lora_int_id)
    if served.in_flight:
        raise APIError(400, f"The lora adapter '{served.name}' has {served.in_flight} "
                            "request(s) in flight; unload it once they have finished.",
                       "lora_name")
    # Out of the registry first (the name stays taken until the engine dropped it): no new
    # request can name it meanwhile, and every one that did has ended or has its abort queued
    # ahead of this call.
    del registry.served[served.name]
    registry.loading.add(served.name)
    try:
        await state.async_engine.call(lambda e: unload_from_engine(e, served.key))
    except ValueError as exc:  # pinned after all: serve it again rather than lose track
        registry.served[served.name] = served
        raise APIError(400, served.public(str(exc)), "lora_name") from None
    finally:
        registry.loading.discard(served.name)
    logger.info("Removed LoRA adapter: name %r", served.name)
    return PlainTextResponse(f"Success: LoRA adapter '{served.name}' removed successfully.")
