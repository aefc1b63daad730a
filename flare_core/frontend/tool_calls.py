"""Tool calls streamed out of a model's text: the machinery every tool-call format's parser shares
(`ToolCallStream`), and the formats framed by marker tokens (`MarkedToolCallParser`: DeepSeek V3
/ V3.1, Kimi K2; a format declares its `ToolCallMarkers` and how to read a call's header).

A parser has the `feed`/`finish` -> `ParsedDelta` interface (flare_core.contract.StreamingParser),
which the server turns into OpenAI tool_calls and Anthropic tool_use blocks. Parsers report a
call's index, name and arguments, and an id only where the model wrote one: the protocol adapter
mints the others in its own form (flare_core.server.generation). They read the markers as text,
so the detokenizer must keep them: a tokenizer flags some added tokens "special", and
`skip_special_tokens=True` drops exactly those, so a request whose output goes through a tool
parser is decoded with `skip_special_tokens=False` unless the core's tokenizer leaves every
marker of `ToolCallMarkers.tokens` unflagged (`Tokenizer.special_tokens` tells).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from flare_core.contract.protocols import ParsedDelta, ToolCallDelta, merge_tool_deltas
from flare_core.frontend.stops import partial_match_length

_WHITESPACE = " \t\r\n"
_FENCE = "```"


class ToolCallStream(ABC):
    """A streaming tool-call parser's shared part: the text not decided yet (`pending`), the
    content outside blocks of calls, the calls' indices and the output of each `feed`/`finish`.

    Text outside blocks is content; whitespace next to a block is formatting and dropped (the
    characters `whitespace` names; None: any whitespace). A tail of content that could still be
    the start of `block_begin`, and trailing whitespace that may precede a block, are held back
    until decided, so that whatever the split into pieces the concatenated output is the same.
    A format reads a block in states of its own (`block_states`, each a step that returns whether
    it made progress), opens them in `open_block`, and says in `end_block` what an unfinished
    state leaves when the output ends."""

    block_begin: ClassVar[str]
    whitespace: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.state = "content"
        self.pending = ""
        self.calls = 0  # calls ended so far: the index of the current or next one
        self._after_block = False  # whitespace that follows a block is dropped
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._steps: dict[str, Callable[[bool], bool]] = {"content": self._advance_content, **self.block_states()}

    @abstractmethod
    def block_states(self) -> dict[str, Callable[[bool], bool]]:
        """The steps of the states a block is read in, by name."""

    @abstractmethod
    def open_block(self, whitespace_before: str) -> None:
        """A block begins (its marker consumed; `whitespace_before` the formatting dropped before
        it): set `state` to the first state of a block."""

    @abstractmethod
    def end_block(self) -> None:
        """The output ended in `state` (not "content"): emit what it leaves."""

    def feed(self, text: str) -> ParsedDelta:
        self.pending += text
        self._advance(final=False)
        return self._take_output()

    def finish(self) -> ParsedDelta:
        self._advance(final=True)
        if self.state != "content":
            self.end_block()
        self.pending = ""
        self.state = "content"
        return self._take_output()

    # ---- what a format emits ------------------------------------------------------------

    def emit_content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def announce(self, name: str, call_id: str | None = None) -> None:
        """The current call's name is known (and its id, where the model wrote one)."""
        self._deltas.append(ToolCallDelta(self.calls, call_id, name))

    def send_arguments(self, text: str) -> None:
        """More of the current call's arguments text."""
        if text:
            self._deltas.append(ToolCallDelta(self.calls, arguments=text))

    def end_call(self, arguments: str = "") -> None:
        """The current call is done (with the last of its arguments text)."""
        self._deltas.append(ToolCallDelta(self.calls, arguments=arguments, done=True))
        self.calls += 1

    def close_block(self) -> None:
        """The block ended at its closing marker: content follows, less the whitespace before it."""
        self.state = "content"
        self._after_block = True

    # ---- the shared states --------------------------------------------------------------

    def _take_output(self) -> ParsedDelta:
        delta = ParsedDelta(content="".join(self._content), tool_calls=merge_tool_deltas(tuple(self._deltas)))
        self._content, self._deltas = [], []
        return delta

    def _advance(self, final: bool) -> None:
        while self.pending and self._steps[self.state](final):
            pass

    def _advance_content(self, final: bool) -> bool:
        if self._after_block:
            self.pending = self.pending.lstrip(self.whitespace)
            if not self.pending:
                return False
            self._after_block = False
        start = self.pending.find(self.block_begin)
        if start >= 0:
            before = self.pending[:start]
            kept = before.rstrip(self.whitespace)
            self.emit_content(kept)
            self.pending = self.pending[start + len(self.block_begin):]
            self.open_block(before[len(kept):])
            return True
        if final:
            self.emit_content(self.pending)
            self.pending = ""
            return False
        held = partial_match_length(self.pending, (self.block_begin,))
        # Trailing whitespace may turn out to precede a block (and be dropped): hold it too.
        ready = self.pending[:len(self.pending) - held].rstrip(self.whitespace)
        self.emit_content(ready)
        self.pending = self.pending[len(ready):]
        return False


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


class MarkedToolCallParser(ToolCallStream):
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
        super().__init__()
        self._section_calls = 0  # calls announced in the current section
        self._section_shown = False  # the current section's opening marker went out as content
        self._broken_text = ""  # raw text of a malformed call, emitted as content at its end marker
        self._arguments_started = False
        self._sent_arguments = False

    @property
    def block_begin(self) -> str:  # type: ignore[override] - a format's markers name it
        return self.markers.section_begin

    @abstractmethod
    def parse_header(self, header: str) -> tuple[str | None, str] | None:
        """(the id the model wrote or None, function name) from the text between a call's begin
        marker and `header_end`, or None when it is not a call header."""

    def block_states(self) -> dict[str, Callable[[bool], bool]]:
        return {"section": self._advance_section, "header": self._advance_header,
                "arguments": self._advance_arguments, "broken": self._advance_broken}

    def open_block(self, whitespace_before: str) -> None:
        self.state = "section"
        self._section_calls = 0
        self._section_shown = False

    def end_block(self) -> None:
        if self.state == "section" and self._section_calls == 0 and not self._section_shown:
            self.emit_content(self.markers.section_begin)  # an opening marker with nothing after it
        elif self.state == "header":
            self.emit_content(self._section_prefix() + self.markers.call_begin + self.pending)
        elif self.state == "broken":
            self.emit_content(self._broken_text + self.pending)
        elif self.state == "arguments":
            self._end_arguments(self.pending)

    def _advance_section(self, final: bool) -> bool:
        markers = self.markers
        rest = self.pending.lstrip()
        if rest.startswith(markers.call_begin):
            self.pending = rest[len(markers.call_begin):]
            self.state = "header"
            return True
        if rest.startswith(markers.section_end):
            self.pending = rest[len(markers.section_end):]
            self.close_block()
            return True
        if not final and (not rest or markers.call_begin.startswith(rest) or markers.section_end.startswith(rest)):
            return False
        # Not a call: the section ends here and the text is content, verbatim if the section had no call.
        if self._section_calls == 0 and not self._section_shown:
            self.emit_content(markers.section_begin)
        else:
            self.pending = rest
        self.state = "content"
        return True

    def _advance_header(self, final: bool) -> bool:
        markers = self.markers
        header_end = self.pending.find(markers.header_end)
        call_end = self.pending.find(markers.call_end)
        if header_end >= 0 and (call_end < 0 or header_end < call_end):
            after_header = header_end + len(markers.header_end)
            parsed = self.parse_header(self.pending[:header_end])
            if parsed is None:
                self._broken_text = self._section_prefix() + markers.call_begin + self.pending[:after_header]
                self.state = "broken"
            else:
                call_id, name = parsed
                self.announce(name, call_id)
                self._section_calls += 1
                self._arguments_started = False
                self._sent_arguments = False
                self.state = "arguments"
            self.pending = self.pending[after_header:]
            return True
        if call_end >= 0:
            after_call = call_end + len(markers.call_end)
            self.emit_content(self._section_prefix() + markers.call_begin + self.pending[:after_call])
            self.pending = self.pending[after_call:]
            self.state = "section"
            return True
        return False

    def _advance_broken(self, final: bool) -> bool:
        call_end = self.pending.find(self.markers.call_end)
        if call_end < 0:
            return False
        after_call = call_end + len(self.markers.call_end)
        self.emit_content(self._broken_text + self.pending[:after_call])
        self.pending = self.pending[after_call:]
        self.state = "section"
        return True

    def _section_prefix(self) -> str:
        """The section's opening marker, when malformed text is the first thing to leave the section."""
        if self._section_calls == 0 and not self._section_shown:
            self._section_shown = True
            return self.markers.section_begin
        return ""

    def _advance_arguments(self, final: bool) -> bool:
        call_end = self.pending.find(self.markers.call_end)
        if call_end >= 0:
            arguments = self.pending[:call_end]
            self.pending = self.pending[call_end + len(self.markers.call_end):]
            self._end_arguments(arguments)
            self.state = "section"
            return True
        if not self._arguments_started and not self._open_arguments():
            return False
        held = 0 if final else partial_match_length(self.pending, (self.markers.call_end,))
        trailing = _WHITESPACE + ("`" if self.markers.fenced_arguments else "")
        # Trailing whitespace (and backticks) may be the formatting before the end marker: hold them.
        ready = self.pending[:len(self.pending) - held].rstrip(trailing)
        self._send_arguments(ready)
        self.pending = self.pending[len(ready):]
        return False

    def _open_arguments(self) -> bool:
        """Drop what precedes the arguments once it is decided; False while it is not."""
        rest = self._without_opening(self.pending, final=False)
        if rest is None:
            return False
        self.pending = rest
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
        self.end_call("" if self._sent_arguments else "{}")

    def _send_arguments(self, text: str) -> None:
        if text:
            self.send_arguments(text)
            self._sent_arguments = True


def function_name(text: str) -> str | None:
    """`text` stripped, when it is one word (a function name); None otherwise."""
    name = text.strip()
    return name if name and not any(char in _WHITESPACE for char in name) else None
