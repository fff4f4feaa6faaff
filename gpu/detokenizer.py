"""Streaming detokenization with stop strings (vLLM's ``detokenize_incrementally`` scheme).

Two offsets walk over the token ids: text of ``ids[prefix:read]`` was already emitted, text of
``ids[prefix:]`` is decoded again with each new token and the difference is the new text. A
multi-byte character split over tokens decodes to U+FFFD until its last byte arrives, so new text
ending in U+FFFD is held back (the offsets do not move). A few prompt tokens seed the window so that
the first output token decodes with the right leading space.

Stop strings: the text is searched where a stop string could newly end; on a match the text is cut
before it (or after it with ``include_stop_str_in_output``). While streaming, the last
``len(longest stop) - 1`` characters are held back since they may begin a stop string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinserve.gpu.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    __slots__ = ("_tokenizer", "_ids", "_prefix", "_read", "_skip_special", "stop",
                 "_include_stop", "output_text", "stop_reason", "_emitted")

    def __init__(self, tokenizer: "Tokenizer", prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._skip_special = skip_special_tokens
        self.stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        self.output_text = ""
        self.stop_reason: str | None = None
        self._emitted = 0

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Decode new output tokens; returns the stop string if one now ends the text."""
        for token_id in token_ids:
            if self.stop_reason is not None:
                break
            self._ids.append(token_id)
            new_text = self._decode_new()
            if new_text:
                self.output_text += new_text
                self._check_stop(len(new_text))
        return self.stop_reason

    def _decode_new(self) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix:self._read], self._skip_special)
        full_text = decode(self._ids[self._prefix:], self._skip_special)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return full_text[len(prefix_text):]

    def _check_stop(self, new_len: int) -> None:
        for stop in self.stop:
            start = max(0, len(self.output_text) - new_len - len(stop) + 1)
            idx = self.output_text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if self._include_stop else idx
                self.output_text = self.output_text[:end]
                self.stop_reason = stop
                return

    def get_delta(self, finished: bool = False) -> str:
        """Text not yet returned that is safe to stream (everything once ``finished``)."""
        end = len(self.output_text)
        if not finished and self.stop_reason is None and self.stop:
            end -= max(len(s) for s in self.stop) - 1
        if end <= self._emitted:
            return ""
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        return delta
