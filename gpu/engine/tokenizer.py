"""``tokenizers.Tokenizer`` plus the model's chat template (applied with jinja2 the way HF does:
a sandboxed environment with HF's ``tojson``, ``raise_exception`` and ``strftime_now``)."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer

from twinserve.gpu.engine.detokenizer import IncrementalDetokenizer

TEMPLATE_CACHE_SIZE = 16  # compiled templates kept per tokenizer (the model's, and requests')
MAX_TEMPLATE_CHARS = 1 << 18


# OpenAI's roles: every chat template is given these (a template that cannot render one fails
# on its own terms, as HF's do).
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
# A string literal compared with a role in a template: `message['role'] == 'ipython'`,
# `'ipython' == message.role`, `role in ['a', 'b']`.
_ROLE_COMPARE = re.compile(
    r"""role['"]?\]?\s*(?:==|!=)\s*['"]([A-Za-z_][\w-]*)['"]"""
    r"""|['"]([A-Za-z_][\w-]*)['"]\s*(?:==|!=)\s*[\w.\[\]'"]*role"""
    r"""|role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")
_QUOTED = re.compile(r"""['"]([A-Za-z_][\w-]*)['"]""")


def template_roles(source: str) -> frozenset[str]:
    """The roles a template knows: OpenAI's standard ones and every literal it compares a
    role with (Llama 3.1's ``ipython``, for instance)."""
    named: set[str] = set()
    for match in _ROLE_COMPARE.finditer(source):
        one, other, listed = match.groups()
        if listed is not None:
            named.update(_QUOTED.findall(listed))
        else:
            named.add(one or other)
    return STANDARD_ROLES | named


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A compiled chat template; ``uses_tools``: its source reads the ``tools`` variable;
    ``roles``: the message roles it knows (``template_roles``)."""

    template: jinja2.Template
    uses_tools: bool
    roles: frozenset[str] = STANDARD_ROLES

    def render(self, **variables: Any) -> str:
        return self.template.render(**variables)


class Tokenizer:
    """Encode, decode, chat-template and stream-decode for one model."""

    __slots__ = ("_tok", "chat_template", "bos_token", "eos_token", "eos_token_id",
                 "special_ids", "special_texts", "_text_tok", "_env", "_templates")

    def __init__(self, tokenizer: HFTokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self.special_texts = tuple(sorted(
            {t.content for t in tokenizer.get_added_tokens_decoder().values()
             if t.special and t.content}))
        self._text_tok: HFTokenizer | None = None  # made on first use (split specials)
        self._env = _template_env()
        self._templates: OrderedDict[str, ChatTemplate] = OrderedDict()
        if chat_template:
            self.template(chat_template)  # a broken model template fails at load

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """``tokenizer.json`` and, if present, ``tokenizer_config.json`` (template, bos/eos)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json in the model directory.")
        config: dict[str, Any] = {}
        config_path = model_dir / "tokenizer_config.json"
        if config_path.is_file():
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        return cls(HFTokenizer.from_file(str(path)),
                   chat_template=config.get("chat_template"),
                   bos_token=_token_text(config.get("bos_token")),
                   eos_token=_token_text(config.get("eos_token")))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def has_special_text(self, text: str) -> bool:
        """True when ``text`` holds a special token's text (``<|im_end|>``)."""
        return any(t in text for t in self.special_texts)

    def encode_pieces(self, pieces: list[tuple[str, bool]],
                      add_special_tokens: bool = False) -> list[int]:
        """``pieces`` of ``(text, is_content)`` encoded one after another: a template piece as
        ``encode`` does, a content piece with special-token text kept as text (HF's
        ``split_special_tokens``)."""
        if self._text_tok is None:
            self._text_tok = HFTokenizer.from_str(self._tok.to_str())
            self._text_tok.encode_special_tokens = True
        encodings = [(self._text_tok if is_content else self._tok).encode(
            text, add_special_tokens=False) for text, is_content in pieces]
        merged = Encoding.merge(encodings, growing_offsets=True) if encodings else \
            self._tok.encode("", add_special_tokens=False)
        if add_special_tokens:
            merged = self._tok.post_process(merged, add_special_tokens=True)
        return merged.ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def template(self, source: str | None = None) -> ChatTemplate:
        """The compiled template ``source`` (None: the model's); ValueError naming
        ``chat_template`` when there is none or it does not compile."""
        source = source if source is not None else self.chat_template
        if not source:
            raise ValueError("chat_template: this model has no chat template in "
                             "tokenizer_config.json; give one (--chat-template, or "
                             "chat_template in the request).")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"chat_template: a template may be at most {MAX_TEMPLATE_CHARS} "
                             f"characters, got {len(source)}.")
        cached = self._templates.get(source)
        if cached is not None:
            self._templates.move_to_end(source)
            return cached
        try:
            ast = self._env.parse(source)
            compiled = ChatTemplate(self._env.from_string(ast),
                                    "tools" in jinja2.meta.find_undeclared_variables(ast),
                                    template_roles(source))
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat_template does not compile: {exc}") from None
        self._templates[source] = compiled
        if len(self._templates) > TEMPLATE_CACHE_SIZE:
            self._templates.popitem(last=False)
        return compiled

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the model's template, or ``chat_template`` (text, or token
        ids if ``tokenize``); ``kwargs`` (``tools=`` included) go to the template as HF's do.
        A template that fails is a ValueError naming ``chat_template``."""
        template = self.template(chat_template)
        try:
            text = template.render(messages=messages,
                                   add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "",
                                   eos_token=self.eos_token or "", **kwargs)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat_template could not be applied: {exc}") from None
        return self.encode(text) if tokenize else text

    def detokenizer(self, prompt_token_ids: list[int], *, skip_special_tokens: bool = True,
                    stop: list[str] | None = None,
                    include_stop_str_in_output: bool = False) -> IncrementalDetokenizer:
        """A streaming decoder for one request's output."""
        return IncrementalDetokenizer(self, prompt_token_ids,
                                      skip_special_tokens=skip_special_tokens, stop=stop or [],
                                      include_stop_str_in_output=include_stop_str_in_output)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """HF's ``tojson``: no HTML escaping (jinja's own escapes ``<``, ``>``, ``&``, ``'``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _template_env() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
