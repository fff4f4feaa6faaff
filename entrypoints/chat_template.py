"""Rendering a conversation into a prompt: the template, its arguments and the tools.

``render_chat`` is what ``/v1/chat/completions``, ``/tokenize`` and ``LLM.chat`` call. It applies
the model's chat template (or the server's ``--chat-template``, or the request's own) with HF's
arguments: ``messages``, ``tools``, ``add_generation_prompt`` and the ``chat_template_kwargs``.

Tools reach the model through its template when the template reads ``tools`` (Hermes, Qwen2.5,
Llama 3.1 ...); an assistant's ``tool_calls`` then carry their arguments as objects, as those
templates (and vLLM) expect. A template with no tools section, such as the bundled SmolLM2's
ChatML, would drop them silently; for such a template the tools are described in the system
message in the tool-call parser's own format (Hermes': a ``<tools>`` block and the
``<tool_call>`` instruction, as Qwen2.5's template writes it), an assistant's calls are written
out as the parser reads them, and ``tool`` messages become ``<tool_response>`` user turns.

Roles are checked against those the template knows (``ChatTemplate.roles``), and
``encode_chat`` encodes the messages' contents as text (HF's ``split_special_tokens``), so text
relayed from a third party cannot open a turn of its own.

``continue_final_message`` renders without a generation prompt and cuts the text after the last
message's content, as HF does, so the model continues that message.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from twinserve.entrypoints.tool_parsers.base import ToolParser
from twinserve.entrypoints.tool_parsers.hermes import HermesToolParser

# Variables the renderer sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "bos_token", "eos_token", "chat_template", "raise_exception", "strftime_now"})


@dataclass(frozen=True, slots=True)
class ChatTemplateOptions:
    """One conversation's rendering choices (vLLM's request fields)."""

    chat_template: str | None = None
    chat_template_kwargs: Mapping[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Sequence[Mapping[str, Any]] | None = None

    def check(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message: cannot continue the final message and "
                             "add a generation prompt; set add_generation_prompt to false.")
        kwargs = self.chat_template_kwargs
        if kwargs is None:
            return
        if not isinstance(kwargs, Mapping):
            raise ValueError("chat_template_kwargs must be an object of template variables.")
        for key in kwargs:
            if not isinstance(key, str) or not key.isidentifier():
                raise ValueError(f"chat_template_kwargs: {key!r} is not a template variable "
                                 "name.")
            if key in RESERVED_TEMPLATE_VARIABLES:
                raise ValueError(f"chat_template_kwargs: {key!r} is set by the server (use "
                                 "the request field of that name, if it has one).")


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                options: ChatTemplateOptions, tool_format: ToolParser | None = None) -> str:
    """The prompt text; ValueError naming the field (``chat_template``, ``messages``,
    ``chat_template_kwargs``, ``continue_final_message``) when it cannot be rendered.
    ``tool_format``: the parser whose format a template without tools is told to use."""
    rendered, variables = _prepare(tokenizer, messages, options, tool_format)
    text = tokenizer.apply_chat_template(
        rendered, add_generation_prompt=options.add_generation_prompt,
        chat_template=options.chat_template, **variables)
    if options.continue_final_message:
        text = _cut_after_final_message(text, rendered)
    return text


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                options: ChatTemplateOptions, tool_format: ToolParser | None = None, *,
                split_special_tokens: bool = True,
                add_special_tokens: bool = False) -> ChatPrompt:
    """The conversation rendered and encoded. With ``split_special_tokens`` (the default, HF's
    name) the messages' contents are encoded as text: special-token strings written in them
    (``<|im_end|>``) stay text and never become the template's control tokens. False lets
    them through, for trusted callers that write control tokens on purpose."""
    rendered, variables = _prepare(tokenizer, messages, options, tool_format)
    contents = [m.get("content") if isinstance(m.get("content"), str) else None
                for m in rendered]
    if split_special_tokens:
        _check_no_special_text_outside_contents(tokenizer, rendered, variables.get("tools"))
    if not split_special_tokens or not any(
            c is not None and tokenizer.has_special_text(c) for c in contents):
        text = render_chat(tokenizer, messages, options, tool_format)
        return ChatPrompt(text, tokenizer.encode(text, add_special_tokens=add_special_tokens))
    pieces = _rendered_pieces(tokenizer, rendered, contents, options, variables)
    if options.continue_final_message:
        cut = len(_cut_after_final_message("".join(p for p, _ in pieces), rendered))
        pieces = _truncated(pieces, cut)
    return ChatPrompt("".join(p for p, _ in pieces),
                      tokenizer.encode_pieces(pieces, add_special_tokens=add_special_tokens))


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str
    token_ids: list[int]


def _prepare(tokenizer: Any, messages: Sequence[Mapping[str, Any]], options: ChatTemplateOptions,
             tool_format: ToolParser | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages as the template receives them and the template's variables."""
    options.check()
    template = tokenizer.template(options.chat_template)
    check_roles(messages, template.roles)
    messages = [_with_text_content(i, m) for i, m in enumerate(messages)]
    tools = [dict(t) for t in options.tools] if options.tools else None
    if not template.uses_tools and (tools or any(_is_tool_turn(m) for m in messages)):
        rendered = _without_tools_section(messages, tools or [], tool_format)
    else:
        rendered = [_with_argument_objects(m) for m in messages]
    variables = dict(options.chat_template_kwargs or {})
    if tools:
        variables["tools"] = tools
    return rendered, variables


def check_roles(messages: Sequence[Mapping[str, Any]], roles: frozenset[str]) -> None:
    """Every message's role is one the template knows (``ChatTemplate.roles``)."""
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or role not in roles:
            raise ValueError(f"messages[{i}].role {role!r} is not a role this model's chat "
                             f"template knows; use one of {sorted(roles)}.")


def _check_no_special_text_outside_contents(tokenizer: Any, messages: list[dict[str, Any]],
                                            tools: list[dict[str, Any]] | None) -> None:
    """Text the template renders outside the contents (names, tool-call arguments, tool
    definitions) cannot be told apart from the template's own, so special-token text there is
    refused, naming where it is (``split_special_tokens=false`` lets trusted callers send it)."""
    roots: list[tuple[str, Any]] = [
        (f"messages[{i}].{key}", value) for i, m in enumerate(messages)
        for key, value in m.items() if key not in ("content", "role")]
    roots += [(f"tools[{i}]", t) for i, t in enumerate(tools or [])]
    stack = list(reversed(roots))
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and tokenizer.has_special_text(value):
            raise ValueError(f"{where.split('.', 1)[0].split('[', 1)[0]}: {where} holds a "
                             "special token's text, which would become a control token there; "
                             "remove it (or send split_special_tokens=false if it is meant as "
                             "one).")
        if isinstance(value, Mapping):
            stack.extend((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}[{j}]", v) for j, v in enumerate(value))


def _with_text_content(i: int, message: Mapping[str, Any]) -> Mapping[str, Any]:
    """OpenAI's content parts (``[{"type": "text", "text": ...}]``) joined into one text."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text" or \
                not isinstance(part.get("text"), str):
            raise ValueError(f"messages[{i}].content[{j}] must be a text part "
                             "{\"type\": \"text\", \"text\": ...}.")
        texts.append(part["text"])
    return {**message, "content": "".join(texts)}


def _rendered_pieces(tokenizer: Any, rendered: list[dict[str, Any]],
                     contents: list[str | None], options: ChatTemplateOptions,
                     variables: dict[str, Any]) -> list[tuple[str, bool]]:
    """The rendered text as ``(piece, is_content)``: each content is rendered as a marker
    (private-use characters around a random nonce), so the template's own text and the
    messages' contents are told apart exactly, whatever the template does around them."""
    nonce = uuid.uuid4().hex
    marked = [{**m, "content": f"\ue000{nonce}:{i}\ue001"} if c is not None else m
              for i, (m, c) in enumerate(zip(rendered, contents))]
    text = tokenizer.apply_chat_template(
        marked, add_generation_prompt=options.add_generation_prompt,
        chat_template=options.chat_template, **variables)
    pieces: list[tuple[str, bool]] = []
    parts = re.split(f"\ue000{nonce}:(\\d+)\ue001", text)
    for k, part in enumerate(parts):
        if k % 2 == 0:
            pieces.append((part, False))
        else:
            pieces.append((contents[int(part)] or "", True))
    return [p for p in pieces if p[0]]


def _truncated(pieces: list[tuple[str, bool]], length: int) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for piece, is_content in pieces:
        if length <= 0:
            break
        out.append((piece[:length], is_content))
        length -= len(piece)
    return out


def _is_tool_turn(message: Mapping[str, Any]) -> bool:
    return message.get("role") == "tool" or bool(message.get("tool_calls"))


def _with_argument_objects(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message with each tool call's ``arguments`` as an object (text that is not JSON
    stays text)."""
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        out["tool_calls"] = [_call_with_object(c) for c in calls]
    return out


def _call_with_object(call: Mapping[str, Any]) -> dict[str, Any]:
    call = dict(call)
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass
    call["function"] = function
    return call


def _without_tools_section(messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]],
                           tool_format: ToolParser | None) -> list[dict[str, Any]]:
    """The conversation rewritten for a template that knows no tools (see the module doc)."""
    fmt = tool_format if tool_format is not None else HermesToolParser()
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            out.append({"role": "user", "content": "<tool_response>\n"
                        f"{message.get('content') or ''}\n</tool_response>"})
        elif role == "assistant" and message.get("tool_calls"):
            functions = [_call_with_object(c)["function"] for c in message["tool_calls"]]
            calls = "\n".join(fmt.format_call(f.get("name"), f.get("arguments"))
                              for f in functions)
            content = message.get("content") or ""
            out.append({"role": "assistant",
                        "content": f"{content}\n{calls}" if content else calls})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls",
                                                                      "tool_call_id")})
    if not tools:
        return out
    instructions = fmt.format_instructions([json.dumps(t, ensure_ascii=False) for t in tools])
    if out and out[0].get("role") == "system":
        system = out[0].get("content") or ""
        out[0] = {**out[0], "content": f"{system}\n\n{instructions}" if system else instructions}
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def _cut_after_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """HF's continue_final_message: the text up to the end of the final message's content."""
    if not messages:
        raise ValueError("continue_final_message: there is no final message to continue.")
    final = messages[-1].get("content")
    final = final.strip() if isinstance(final, str) else ""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise ValueError("continue_final_message: the final message's content does not "
                         "appear in the rendered template, so it cannot be continued.")
    return text[:at + len(final)]
