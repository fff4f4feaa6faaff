"""Streaming detokenization with stop strings (vLLM's ``detokenize_incrementally`` scheme).

Two offsets walk over the token ids: text of ``ids[prefix:read]`` was already emitted, text of
``ids[prefix:]`` is decoded again with each new token and the difference is the new text. A
multi-byte character split over tokens decodes to U+FFFD until its last byte arrives, so new text
ending in U+FFFD is held back (the offsets do not move). A few prompt tokens seed the window so that
the first output token decodes with the right leading space.

Stop strings: one Aho-Corasick automaton per request (``StopAutomaton``, built once and shared
by its samples) reads each new character once, so matching costs O(new text) whatever the number
of stop strings. The first stop string to end in the text wins (the longest, if several end at
the same character); the text is cut before it (or after it with
``include_stop_str_in_output``). While streaming, the last ``len(longest stop) - 1`` characters
are held back since they may begin a stop string.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinserve.gpu.engine.tokenizer import Tokenizer

_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class StopAutomaton:
    """Aho-Corasick over a request's stop strings (immutable once built; O(total length)).

    State 0 is the root. ``_goto[s]`` maps a character to the next trie state, ``_fail[s]`` is
    the state of the longest proper suffix of ``s``'s string that is in the trie, ``_match[s]``
    the index of the longest stop string that is a suffix of ``s``'s string (-1: none)."""

    __slots__ = ("_fail", "_goto", "_match", "holdback", "stops")

    def __init__(self, stops: list[str]) -> None:
        self.stops = list(dict.fromkeys(stops))  # duplicates add nothing
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        goto: list[dict[str, int]] = [{}]
        match = [-1]
        for index, stop in enumerate(self.stops):
            state = 0
            for ch in stop:
                nxt = goto[state].get(ch)
                if nxt is None:
                    nxt = goto[state][ch] = len(goto)
                    goto.append({})
                    match.append(-1)
                state = nxt
            match[state] = index  # the state's own string is its longest suffix
        fail = [0] * len(goto)
        order = deque(goto[0].values())
        while order:  # breadth first: fail links point to shallower states, already linked
            state = order.popleft()  # never the root: the root's children fail to the root
            for ch, nxt in goto[state].items():
                f = fail[state]
                while f and ch not in goto[f]:
                    f = fail[f]
                fail[nxt] = goto[f].get(ch, 0)
                if match[nxt] == -1:
                    match[nxt] = match[fail[nxt]]
                order.append(nxt)
        self._goto = goto
        self._fail = fail
        self._match = match

    def feed(self, state: int, text: str) -> tuple[int, int, int]:
        """Reads ``text`` from ``state``; returns ``(state, end, stop index)`` at the first
        character that ends a stop string (``end``: the offset after it in ``text``), else
        ``(state, len(text), -1)``."""
        goto, fail, match = self._goto, self._fail, self._match
        for i, ch in enumerate(text):
            while True:
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if match[state] != -1:
                return state, i + 1, match[state]
        return state, len(text), -1

    def count_steps(self, text: str) -> int:
        """The transitions ``feed`` makes over ``text`` from the root, without stopping at
        matches (the work measure the tests compare; amortised at most 2 per character)."""
        goto, fail = self._goto, self._fail
        state, steps = 0, 0
        for ch in text:
            while True:
                steps += 1
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
        return steps


class IncrementalDetokenizer:
    __slots__ = (
        "_emitted",
        "_ids",
        "_include_stop",
        "_prefix",
        "_read",
        "_skip_special",
        "_stop_state",
        "_stops",
        "_tokenizer",
        "output_text",
        "stop",
        "stop_reason",
    )

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], *,
                 skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False,
                 stop_automaton: StopAutomaton | None = None) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._skip_special = skip_special_tokens
        if stop_automaton is None and stop:
            stop_automaton = StopAutomaton(stop)
        self._stops = stop_automaton
        self._stop_state = 0
        self.stop = list(stop_automaton.stops) if stop_automaton is not None else []
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
        automaton = self._stops
        if automaton is None:
            return
        text = self.output_text
        start = len(text) - new_len
        self._stop_state, end, index = automaton.feed(self._stop_state, text[start:])
        if index != -1:
            stop = automaton.stops[index]
            end += start
            self.output_text = text[:end if self._include_stop else end - len(stop)]
            self.stop_reason = stop

    def get_delta(self, finished: bool = False) -> str:
        """Text not yet returned that is safe to stream (everything once ``finished``)."""
        end = len(self.output_text)
        if not finished and self.stop_reason is None and self._stops is not None:
            end -= self._stops.holdback
        if end <= self._emitted:
            return ""
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        return delta
