"""``tokenizers.Tokenizer`` plus the model's chat template (applied with jinja2 the way HF does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from twinserve.gpu.detokenizer import IncrementalDetokenizer


class Tokenizer:
    """Encode, decode, chat-template and stream-decode for one model."""

    __slots__ = ("_tok", "chat_template", "bos_token", "eos_token", "eos_token_id",
                 "special_ids", "_template")

    def __init__(self, tokenizer: HFTokenizer, *, chat_template: str | None = None,
                 bos_token: str | None = None, eos_token: str | None = None) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.eos_token_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self.special_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._template = None
        if chat_template:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True,
                                                              lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            self._template = env.from_string(chat_template)

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

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs: Any) -> str | list[int]:
        """Render ``messages`` with the model's template (text, or token ids if ``tokenize``)."""
        if self._template is None:
            raise ValueError("this model has no chat_template in tokenizer_config.json.")
        text = self._template.render(messages=messages,
                                     add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "",
                                     eos_token=self.eos_token or "", **kwargs)
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
