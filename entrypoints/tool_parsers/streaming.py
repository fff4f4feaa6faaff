"""``ToolCallStreamer``: one choice's text deltas in, OpenAI's ``tool_calls`` deltas out.

Each delta re-reads the whole output so far with the parser's ``parse_partial`` and sends what
is new: content beyond what was sent, for each call (in order, once its name is known) first
``index``, ``id``, ``type`` and ``function.name``, then ``function.arguments`` fragments.
``finish`` reads the output with ``parse_final``; if the tool-call part turned out malformed,
the text not yet sent as content is sent as content then (the call deltas already sent stay
sent: a client that cannot use them sees ``finish_reason`` other than ``tool_calls``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from twinserve.entrypoints.openai.protocol import DeltaFunctionCall, DeltaToolCall
from twinserve.entrypoints.tool_parsers.base import ParsedOutput, ToolParser


@dataclass(slots=True)
class StreamDelta:
    content: str
    tool_calls: list[DeltaToolCall]


@dataclass(slots=True)
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments sent


@dataclass(slots=True)
class ToolCallStreamer:
    parser: ToolParser
    new_id: Callable[[], str]
    text: str = ""
    content_sent: int = 0
    sent: list[_Sent] = field(default_factory=list)

    def feed(self, delta: str) -> StreamDelta:
        self.text += delta
        return self._diff(self.parser.parse_partial(self.text), final=False)

    def finish(self, delta: str = "") -> tuple[StreamDelta, ParsedOutput]:
        """The last delta and the final parse (whose calls are the ones sent)."""
        self.text += delta
        parsed = self.parser.parse_final(self.text)
        return self._diff(parsed, final=True), parsed

    @property
    def ids(self) -> list[str]:
        return [s.id for s in self.sent]

    def _diff(self, parsed: ParsedOutput, final: bool) -> StreamDelta:
        source = self.text if final and not parsed.calls else parsed.content
        content = source[self.content_sent:]
        self.content_sent += len(content)
        deltas = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # later calls wait for this one's name: deltas go out in order
            if index == len(self.sent):
                self.sent.append(_Sent(self.new_id()))
                head = self.sent[index]
                fragment = call.arguments
                deltas.append(DeltaToolCall(index=index, id=head.id, type="function",
                                            function=DeltaFunctionCall(name=call.name,
                                                                       arguments=fragment)))
            else:
                head = self.sent[index]
                fragment = call.arguments[head.arguments:]
                if fragment:
                    deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                        arguments=fragment)))
            head.arguments += len(fragment)
        return StreamDelta(content, deltas)
