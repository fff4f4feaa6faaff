"""Request and response bodies of the OpenAI-compatible server, in OpenAI's (and vLLM's) shape.

Request bodies are strictly typed (pydantic's strict mode: ``"yes"`` is not a boolean, ``"3"`` not
a number) and their numbers finite (``1e400`` is infinity in JSON: refused); ``temperature`` is at
most 2, as OpenAI's.

Requests accept vLLM's extra sampling fields at the top level (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``, ``skip_special_tokens``,
``include_stop_str_in_output``, ``priority``, ``add_special_tokens``, ``bad_words``; on completions
``prompt_logprobs`` and ``truncate_prompt_tokens``). Value ranges are checked
by ``SamplingParams`` (its ``ValueError`` names the field); pydantic checks only types and
presence.

Fields of OpenAI's and vLLM's request schemas that twinserve does not implement are listed in one
table, ``UNIMPLEMENTED``: such a field is refused (HTTP 400 naming it) unless its value means "not
used" (``"tools": []``, ``"tool_choice": "none"``, ``"logit_bias": null``...). Fields neither
schema knows are ignored with a warning in the log, as vLLM does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from pydantic_core import PydanticCustomError
from pydantic_core.core_schema import ValidatorFunctionWrapHandler

from twinserve.core.sampling_params import SamplingParams
from twinserve.core.structured_outputs import StructuredOutputsParams

Prompt = str | list[int] | list[str] | list[list[int]]
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Request bodies and their parts: strict types, finite numbers.
STRICT_REQUEST = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
MAX_TEMPERATURE = 2.0  # OpenAI's bound


def find_lone_surrogate(data: Any) -> str | None:
    """The JSON path (``messages[0].content``) of the first string, or object key, holding a
    lone UTF-16 surrogate (``"\\ud800"`` in JSON decodes to one; it cannot be encoded, so no
    tokenizer or response can take it), else None. Iterative: nesting depth costs no stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii() and _has_surrogate(value):
                return path or "body"
        elif isinstance(value, dict):
            items = []
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not key.isascii() and _has_surrogate(key):
                    return where
                items.append((where, item))
            stack.extend(reversed(items))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


MAX_TOKEN_FILTER = 4096  # entries of logit_bias / allowed_token_ids a request may carry


class RequestModel(OpenAIBaseModel):
    """A request body that keeps the JSON object it was parsed from (``raw``), so the fields it
    does not declare can be checked against ``UNIMPLEMENTED`` and the unknown ones logged.
    Text holding a lone surrogate is refused first, naming its field."""

    model_config = STRICT_REQUEST
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        bad = find_lone_surrogate(data)
        if bad is not None:
            where = bad.encode("utf-8", "backslashreplace").decode("utf-8")
            param = where.split(".", 1)[0].split("[", 1)[0]
            raise PydanticCustomError(
                "lone_surrogate", "{message}",
                {"message": f"{where} is not valid Unicode text: it holds a lone UTF-16 "
                            "surrogate (such as \\ud800) that no encoding can represent.",
                 "param": param})
        model = handler(data)
        if isinstance(data, dict) and isinstance(model, RequestModel):
            model._raw = data
        return model

    @property
    def raw(self) -> dict[str, Any]:
        return self._raw


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


# ---- errors ----------------------------------------------------------------------------------
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---- shared request parts --------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    model_config = STRICT_REQUEST
    include_usage: bool | None = False


class SamplingFields(RequestModel):
    """The sampling fields completions and chat share (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = Field(default=None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    # Constrained decoding: OpenAI's response_format, vLLM's structured_outputs (one of them)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's logit_bias ({"token id": bias}) and vLLM's allowed_token_ids
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_TOKEN_FILTER)
    allowed_token_ids: list[int] | None = Field(default=None, max_length=MAX_TOKEN_FILTER)
    bad_words: list[str] | None = None  # vLLM's
    # vLLM's disaggregated prefill/decode (core.kv_connector): needs --kv-transfer-config
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field for out-of-range values."""
        return SamplingParams(
            structured_outputs=self.structured_outputs_params(),
            n=self.n, temperature=_or(self.temperature, 1.0), top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0), min_p=_or(self.min_p, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0), seed=self.seed,
            stop=_stop_list(self.stop), stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """``response_format`` or ``structured_outputs`` as the engine's parameters, compiled
        once here so that a bad schema, regex or grammar is a ValueError whose first word is
        the body's field (``response_format: json_schema.schema is invalid: ...``)."""
        fmt, so = self.response_format, self.structured_outputs
        if fmt is not None and fmt.get("type", "text") == "text":
            fmt = None
        if fmt is not None and so is not None:
            raise ValueError("response_format and structured_outputs may not both be given.")
        if fmt is None and so is None:
            return None
        top = "structured_outputs" if so is not None else "response_format"
        try:
            params = (StructuredOutputsParams.from_value(so) if so is not None
                      else _response_format(fmt))
            from twinserve.gpu.worker.structured_outputs import compile_grammar
            compile_grammar(params)
        except ValueError as exc:
            message = str(exc)
            if fmt is not None:
                message = message.replace("structured_outputs.json_object", "response_format")
                message = message.replace("structured_outputs.json",
                                          "response_format.json_schema.schema")
            if message.startswith(top + "."):
                message = f"{top}: {message[len(top) + 1:]}"
            elif not message.startswith(top + " "):
                message = f"{top}: {message}"
            raise ValueError(message) from None
        return params


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams:
    kind = fmt.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema object "
                             "(response_format: {\"type\": \"json_schema\", \"json_schema\": "
                             "{\"name\": ..., \"schema\": {...}}}).")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type must be \"text\", \"json_object\" or "
                     f"\"json_schema\", got {_json(kind)}.")


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


# ---- /v1/completions -------------------------------------------------------------------------
class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: BOS etc. added to text prompts
    # vLLM's: the prompt tokens' logprobs (also implied by echo with logprobs), and keeping
    # only the prompt's last k tokens (-1: as many as max_model_len leaves room for)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """vLLM's: ``prompt_logprobs``, or with ``echo`` the ``logprobs`` count."""
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs are not available when stream=true (as in vLLM; "
                             "echo with logprobs streams them in the first chunk).")
        params = super().sampling_params(max_tokens, logprobs)
        params.prompt_logprobs = self.num_prompt_logprobs
        params.validate()
        return params


# ---- /v1/chat/completions --------------------------------------------------------------------
class ContentPart(OpenAIBaseModel):
    model_config = STRICT_REQUEST
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    model_config = STRICT_REQUEST
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls (chat_tools checks)
    tool_call_id: str | None = None  # a "tool" message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        """The message as the chat template expects it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise ValueError("messages: only text content parts are supported.")
            content = "".join(p.text or "" for p in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


MAX_TOOLS = 128  # OpenAI's limit on functions per request


class ChatTemplateFields(RequestModel):
    """What the chat template renders besides the messages (chat and /tokenize)."""

    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # HF's name: special-token text inside message contents stays text (false: trusted callers
    # whose contents hold control tokens on purpose)
    split_special_tokens: bool = True


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # vLLM's: the template already holds them

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The engine's ``logprobs`` (top-k count) for this request, or None."""
        if not self.logprobs:
            if self.top_logprobs:
                raise ValueError("top_logprobs needs logprobs=true.")
            return None
        return self.top_logprobs or 0


# ---- responses -------------------------------------------------------------------------------
class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: with prompt_logprobs, {token id: {logprob, rank, decoded_token}} per prompt token
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a producer's, for a consumer


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatChoiceLogProbs(OpenAIBaseModel):
    content: list[ChatLogProbsContent] | None = None


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIBaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIBaseModel):
    """A streamed call: ``id``, ``type`` and ``function.name`` in its first delta only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class AssistantMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's: a producer's, for a consumer


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- /v1/models, /tokenize, /detokenize ------------------------------------------------------
class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "twinserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):
    """``POST /v1/load_lora_adapter`` (vLLM's)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's): the adapter's name or its id."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ---- what is not implemented -----------------------------------------------------------------
COMPLETION, CHAT, TOKENIZE = "completion", "chat", "tokenize"
_GENERATE = frozenset({COMPLETION, CHAT})
_CHAT = frozenset({CHAT})
_CHAT_TEMPLATE = frozenset({CHAT, TOKENIZE})


@dataclass(frozen=True, slots=True)
class Unimplemented:
    """A request field twinserve does not implement. It is refused unless its value is one of
    ``absent`` (the values that mean "not used"), or equals the request's ``same_as`` field."""

    what: str
    absent: tuple[Any, ...] = (None,)
    endpoints: frozenset[str] = _GENERATE
    same_as: str | None = None

    def accepts(self, value: Any, body: dict[str, Any]) -> bool:
        if any(_same_json(value, a) for a in self.absent):
            return True
        return self.same_as is not None and _same_json(value, body.get(self.same_as, 1))

    def message(self, name: str, value: Any) -> str:
        accepted = " or ".join(_json(a) for a in self.absent)
        if self.same_as is not None:
            accepted += f" or the value of {self.same_as}"
        return (f"{name} is not supported by twinserve yet ({self.what}); got {_json(value)}. "
                f"Omit it or send {accepted}.")


_U = Unimplemented
# Every field of OpenAI's /v1/completions and /v1/chat/completions schemas and of vLLM's extra
# request fields that twinserve does not implement. A dotted name is a field inside an object.
UNIMPLEMENTED: dict[str, Unimplemented] = {
    # OpenAI: the deprecated function calling (tools, tool_choice are implemented)
    "functions": _U("function calling", (None, []), _CHAT),
    "function_call": _U("function calling", (None, "none", "auto"), _CHAT),
    # OpenAI: output formats, modalities, hosted features
    "audio": _U("audio output", (None,), _CHAT),
    "modalities": _U("output modalities other than text", (None, ["text"]), _CHAT),
    "prediction": _U("predicted outputs", (None,), _CHAT),
    "reasoning_effort": _U("reasoning effort", (None,), _CHAT),
    "verbosity": _U("verbosity", (None, "medium"), _CHAT),
    "web_search_options": _U("web search", (None,), _CHAT),
    "service_tier": _U("service tiers", (None, "auto", "default"), _CHAT),
    "store": _U("stored completions", (None, False), _CHAT),
    "suffix": _U("suffixes (fill-in-the-middle)", (None, ""), frozenset({COMPLETION})),
    "best_of": _U("best-of-n sampling", (None, 1), frozenset({COMPLETION}), same_as="n"),
    "stream_options.continuous_usage_stats": _U("usage in every stream chunk", (None, False)),
    # vLLM: sampling extras
    "use_beam_search": _U("beam search", (None, False)),
    "length_penalty": _U("beam search's length penalty", (None, 1.0)),
    # (prompt_logprobs and truncate_prompt_tokens are implemented on /v1/completions)
    "prompt_logprobs": _U("prompt logprobs on chat (use /v1/completions)", (None,), _CHAT),
    "logprob_token_ids": _U("logprobs of chosen token ids", (None,)),
    "logits_processors": _U("logits processors by name (a Python API feature: "
                            "SamplingParams(logits_processors=[...]) in LLM.generate)",
                            (None, [])),
    "spaces_between_special_tokens": _U("spaces_between_special_tokens=false", (None, True)),
    "truncate_prompt_tokens": _U("prompt truncation on chat (use /v1/completions)", (None,),
                                 _CHAT),
    "truncation_side": _U("truncating the prompt's right side (it keeps the last tokens)",
                          (None, "left")),
    "thinking_token_budget": _U("thinking token budgets", (None, -1)),
    "include_reasoning": _U("reasoning parsers", (None, True), _CHAT),
    "repetition_detection": _U("repetition detection", (None,)),
    "stream_interval": _U("stream intervals", (None, 1)),
    # vLLM: the guided_* names of structured outputs in earlier versions (structured_outputs
    # and response_format are implemented)
    "guided_json": _U("structured outputs: JSON schemas", (None,)),
    "guided_regex": _U("structured outputs: regular expressions", (None,)),
    "guided_choice": _U("structured outputs: choices", (None,)),
    "guided_grammar": _U("structured outputs: grammars", (None,)),
    "guided_decoding_backend": _U("structured outputs", (None,)),
    "guided_whitespace_pattern": _U("structured outputs", (None,)),
    # vLLM: chat templates and multimodal inputs
    "documents": _U("documents for the chat template (RAG)", (None, []), _CHAT),
    "echo": _U("echoing the last message into the reply", (None, False), _CHAT),
    "mm_processor_kwargs": _U("multimodal inputs", (None, {}), _CHAT_TEMPLATE),
    "media_io_kwargs": _U("multimodal inputs", (None, {}), _CHAT_TEMPLATE),
    "prompt_embeds": _U("prompt embeddings", (None,), frozenset({COMPLETION})),
    # vLLM: outputs, routing, disaggregation, extensions
    "return_tokens_as_token_ids": _U("tokens as token ids", (None, False)),
    "return_token_ids": _U("token ids in the response", (None, False)),
    "return_token_strs": _U("token strings", (None, False), frozenset({TOKENIZE})),
    "request_id": _U("client-chosen request ids", (None,)),
    "cache_salt": _U("prefix-cache salts", (None,)),
    # vLLM takes no LoRARequest in the body either: the adapter is the request's `model`
    "lora_request": _U("a LoRA adapter is chosen by its name as `model`, see /v1/models",
                       (None,)),
    "ec_transfer_params": _U("encoder-cache transfer", (None, {})),
    "vllm_xargs": _U("extra arguments for custom extensions", (None, {})),
}

# Fields of those schemas that change nothing the server returns (labels for the caller's own
# bookkeeping), so accepting them and doing nothing is what they ask for.
NO_EFFECT_FIELDS = frozenset({"metadata", "prompt_cache_key", "safety_identifier"})

# Inside each chat message: what the template rendering here does not carry.
UNIMPLEMENTED_MESSAGE_FIELDS: dict[str, Unimplemented] = {
    "function_call": _U("function calling", (None,)),
    "audio": _U("audio", (None,)),
    "refusal": _U("assistant refusals", (None,)),
    "reasoning": _U("reasoning content", (None, "")),
    "reasoning_content": _U("reasoning content", (None, "")),
}
UNIMPLEMENTED_ROLES = {"function": "function calling (use tools)"}
KNOWN_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


@dataclass(frozen=True, slots=True)
class Refusal:
    param: str
    message: str


def find_unimplemented(body: RequestModel, endpoint: str) -> tuple[Refusal | None, list[str]]:
    """The first field of ``body`` that twinserve does not implement, in the table's order (None
    if there is none), and the fields this endpoint's schemas (OpenAI's and vLLM's) do not know,
    to be logged and ignored as vLLM does."""
    raw = body.raw
    declared = type(body).model_fields
    unknown = [name for name in raw if name not in declared and name not in NO_EFFECT_FIELDS
               and endpoint not in getattr(UNIMPLEMENTED.get(name), "endpoints", ())]
    for name, rule in UNIMPLEMENTED.items():  # in the table's order, whatever the body's
        if endpoint not in rule.endpoints:
            continue
        outer, _, inner = name.partition(".")
        holder = raw.get(outer) if inner else raw
        key = inner or name
        if isinstance(holder, dict) and key in holder and not rule.accepts(holder[key], raw):
            return Refusal(name, rule.message(name, holder[key])), unknown
    messages = raw.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict):
                refusal = _message_refusal(i, message, unknown)
                if refusal is not None:
                    return refusal, unknown
    return None, unknown


def _message_refusal(i: int, message: dict[str, Any], unknown: list[str]) -> Refusal | None:
    where = f"messages[{i}]"
    role = message.get("role")
    if role in UNIMPLEMENTED_ROLES:
        return Refusal(f"{where}.role", f"{where}.role {role!r} is not supported by twinserve "
                                        f"yet ({UNIMPLEMENTED_ROLES[role]}).")
    for name, value in message.items():
        rule = UNIMPLEMENTED_MESSAGE_FIELDS.get(name)
        if rule is not None and not rule.accepts(value, message):
            return Refusal(f"{where}.{name}", rule.message(f"{where}.{name}", value))
        if rule is None and name not in KNOWN_MESSAGE_FIELDS:
            unknown.append(f"{where}.{name}")
    content = message.get("content")
    for j, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            param = f"{where}.content[{j}].type"
            return Refusal(param, f"{param} {kind!r} is not supported by twinserve yet (only "
                                  "text content parts: no images, audio, video or files).")
    return None


def _same_json(value: Any, absent: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(value, bool) or isinstance(absent, bool):
        return value is absent
    return type(value) is type(absent) and value == absent or \
        (isinstance(value, (int, float)) and isinstance(absent, (int, float)) and value == absent)


def _json(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
