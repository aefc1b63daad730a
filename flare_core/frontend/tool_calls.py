"""Tool calls framed by marker tokens, streamed: the machinery the tool-call parsers of marked
formats share (DeepSeek V3 / V3.1, Kimi K2; a format declares its `ToolCallMarkers` and how to
read a call's header).

The parsers have the `feed`/`finish` -> `ParsedDelta` interface of flare_core.frontend.parsers,
which the server turns into OpenAI tool_calls and Anthropic tool_use blocks. They read the
markers as text, so the detokenizer must keep them: a tokenizer flags some added tokens
"special", and `skip_special_tokens=True` drops exactly those, so a request whose output goes
through a tool parser is decoded with `skip_special_tokens=False` unless the core's tokenizer
leaves every marker of `ToolCallMarkers.tokens` unflagged (`Tokenizer.special_tokens` tells).
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from flare_core.frontend.parsers import ParsedDelta, ToolCallDelta
from flare_core.frontend.stops import partial_match_length

_WHITESPACE = " \t\r\n"
_FENCE = "```"


@dataclass(frozen=True)
class ToolCallMarkers:
    """The strings that frame a model's tool calls.

    A section (section_begin ... section_end) holds calls (call_begin HEADER header_end ARGUMENTS
    call_end) separated by optional whitespace. `header_separator` is a marker inside the header
    (V3: between the call type and the function name). With `fenced_arguments`, the arguments sit
    in a Markdown code fence (```json ... ```), which is not part of them.
    """

    section_begin: str
    section_end: str
    call_begin: str
    call_end: str
    header_end: str
    header_separator: str = ""
    fenced_arguments: bool = False

    @property
    def tokens(self) -> tuple[str, ...]:
        """The marker tokens the parser must see in the decoded text."""
        markers = (self.section_begin, self.section_end, self.call_begin, self.call_end, self.header_end,
                   self.header_separator)
        return tuple(marker for marker in markers if marker.strip())


class MarkedToolCallParser(ABC):
    """Tool calls framed by marker tokens, streamed.

    Text outside a section is content; whitespace next to a section is formatting and dropped.
    A call is announced (index, id, name) once its header is complete; its arguments text
    then streams as it arrives, less the whitespace (and code fence) around it; the call is done
    at its end marker. Empty arguments become "{}". Arguments are passed on as the model wrote
    them, not validated: the markers, not the JSON, delimit them.

    Malformed output stays readable as content: a section that does not start with a call is
    emitted verbatim (its opening marker included), as is a call whose header does not parse
    (up to its end marker), and text inside a section after its calls ends the section and is
    content. When the output ends inside a call's arguments (e.g. at max_tokens), the call ends
    with the arguments streamed so far.

    Whatever the split into deltas, the concatenated results are the same: any tail that could
    still turn into a marker, trailing whitespace or a closing fence is withheld until decided.
    """

    markers: ClassVar[ToolCallMarkers]

    def __init__(self) -> None:
        self._state = "content"  # content | section | header | arguments | broken
        self._pending = ""
        self._after_section = False  # whitespace that follows a section is dropped
        self._calls_done = 0
        self._section_calls = 0  # calls announced in the current section
        self._section_shown = False  # the current section's opening marker went out as content
        self._broken_text = ""  # raw text of a malformed call, emitted as content at its end marker
        self._arguments_started = False
        self._sent_arguments = False
        self._output = ParsedDelta()

    @abstractmethod
    def parse_header(self, header: str) -> tuple[str, str] | None:
        """(call id, function name) from the text between a call's begin marker and `header_end`,
        or None when it is not a call header."""

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        self._advance(final=False)
        return self._take_output()

    def finish(self) -> ParsedDelta:
        self._advance(final=True)
        if self._state == "section" and self._section_calls == 0 and not self._section_shown:
            self._emit_content(self.markers.section_begin)  # an opening marker with nothing after it
        elif self._state == "header":
            self._emit_content(self._section_prefix() + self.markers.call_begin + self._pending)
        elif self._state == "broken":
            self._emit_content(self._broken_text + self._pending)
        elif self._state == "arguments":
            self._end_arguments(self._pending)
        self._pending = ""
        self._state = "content"
        return self._take_output()

    def _take_output(self) -> ParsedDelta:
        output, self._output = self._output, ParsedDelta()
        return output

    def _emit_content(self, text: str) -> None:
        if text:
            self._output = self._output + ParsedDelta(content=text)

    def _emit_call(self, delta: ToolCallDelta) -> None:
        self._output = self._output + ParsedDelta(tool_calls=(delta,))

    def _advance(self, final: bool) -> None:
        steps = {"content": self._advance_content, "section": self._advance_section,
                 "header": self._advance_header, "arguments": self._advance_arguments,
                 "broken": self._advance_broken}
        while self._pending and steps[self._state](final):
            pass

    def _advance_content(self, final: bool) -> bool:
        if self._after_section:
            self._pending = self._pending.lstrip()
            if not self._pending:
                return False
            self._after_section = False
        begin = self.markers.section_begin
        start = self._pending.find(begin)
        if start >= 0:
            self._emit_content(self._pending[:start].rstrip())
            self._pending = self._pending[start + len(begin):]
            self._state = "section"
            self._section_calls = 0
            self._section_shown = False
            return True
        if final:
            self._emit_content(self._pending)
            self._pending = ""
            return False
        held = partial_match_length(self._pending, (begin,))
        # Trailing whitespace may turn out to precede a section (and be dropped): hold it too.
        ready = self._pending[:len(self._pending) - held].rstrip()
        self._emit_content(ready)
        self._pending = self._pending[len(ready):]
        return False

    def _advance_section(self, final: bool) -> bool:
        markers = self.markers
        rest = self._pending.lstrip()
        if rest.startswith(markers.call_begin):
            self._pending = rest[len(markers.call_begin):]
            self._state = "header"
            return True
        if rest.startswith(markers.section_end):
            self._pending = rest[len(markers.section_end):]
            self._state = "content"
            self._after_section = True
            return True
        if not final and (not rest or markers.call_begin.startswith(rest) or markers.section_end.startswith(rest)):
            return False
        # Not a call: the section ends here and the text is content, verbatim if the section had no call.
        if self._section_calls == 0 and not self._section_shown:
            self._emit_content(markers.section_begin)
        else:
            self._pending = rest
        self._state = "content"
        return True

    def _advance_header(self, final: bool) -> bool:
        markers = self.markers
        header_end = self._pending.find(markers.header_end)
        call_end = self._pending.find(markers.call_end)
        if header_end >= 0 and (call_end < 0 or header_end < call_end):
            after_header = header_end + len(markers.header_end)
            parsed = self.parse_header(self._pending[:header_end])
            if parsed is None:
                self._broken_text = self._section_prefix() + markers.call_begin + self._pending[:after_header]
                self._state = "broken"
            else:
                call_id, name = parsed
                self._emit_call(ToolCallDelta(self._calls_done, call_id, name))
                self._section_calls += 1
                self._arguments_started = False
                self._sent_arguments = False
                self._state = "arguments"
            self._pending = self._pending[after_header:]
            return True
        if call_end >= 0:
            after_call = call_end + len(markers.call_end)
            self._emit_content(self._section_prefix() + markers.call_begin + self._pending[:after_call])
            self._pending = self._pending[after_call:]
            self._state = "section"
            return True
        return False

    def _advance_broken(self, final: bool) -> bool:
        call_end = self._pending.find(self.markers.call_end)
        if call_end < 0:
            return False
        after_call = call_end + len(self.markers.call_end)
        self._emit_content(self._broken_text + self._pending[:after_call])
        self._pending = self._pending[after_call:]
        self._state = "section"
        return True

    def _section_prefix(self) -> str:
        """The section's opening marker, when malformed text is the first thing to leave the section."""
        if self._section_calls == 0 and not self._section_shown:
            self._section_shown = True
            return self.markers.section_begin
        return ""

    def _advance_arguments(self, final: bool) -> bool:
        call_end = self._pending.find(self.markers.call_end)
        if call_end >= 0:
            arguments = self._pending[:call_end]
            self._pending = self._pending[call_end + len(self.markers.call_end):]
            self._end_arguments(arguments)
            self._state = "section"
            return True
        if not self._arguments_started and not self._open_arguments():
            return False
        held = 0 if final else partial_match_length(self._pending, (self.markers.call_end,))
        trailing = _WHITESPACE + ("`" if self.markers.fenced_arguments else "")
        # Trailing whitespace (and backticks) may be the formatting before the end marker: hold them.
        ready = self._pending[:len(self._pending) - held].rstrip(trailing)
        self._send_arguments(ready)
        self._pending = self._pending[len(ready):]
        return False

    def _open_arguments(self) -> bool:
        """Drop what precedes the arguments once it is decided; False while it is not."""
        rest = self._without_opening(self._pending, final=False)
        if rest is None:
            return False
        self._pending = rest
        self._arguments_started = True
        return True

    def _without_opening(self, text: str, final: bool) -> str | None:
        """`text` less the whitespace and opening fence line before the arguments, or None while more
        text could still belong to them."""
        fenced = self.markers.fenced_arguments
        rest = text.lstrip()
        if fenced and rest.startswith(_FENCE):
            newline = rest.find("\n")
            if newline < 0:
                return "" if final else None
            rest = rest[newline + 1:].lstrip()
        if fenced and _FENCE.startswith(rest):  # nothing yet, or a fence still arriving
            return "" if final else None
        if not rest and not final:
            return None
        return rest

    def _end_arguments(self, text: str) -> None:
        """Send the rest of a call's arguments (their whole text when none went out yet) and end it."""
        if not self._arguments_started:
            text = self._without_opening(text, final=True)
        text = text.rstrip()
        if self.markers.fenced_arguments and text.endswith(_FENCE):
            text = text[:-len(_FENCE)].rstrip()
        self._send_arguments(text)
        self._emit_call(ToolCallDelta(self._calls_done, arguments="" if self._sent_arguments else "{}", done=True))
        self._calls_done += 1

    def _send_arguments(self, text: str) -> None:
        if text:
            self._emit_call(ToolCallDelta(self._calls_done, arguments=text))
            self._sent_arguments = True


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return "call_" + secrets.token_hex(12)


def function_name(text: str) -> str | None:
    """`text` stripped, when it is one word (a function name); None otherwise."""
    name = text.strip()
    return name if name and not any(char in _WHITESPACE for char in name) else None
