"""Streaming output parsers: reasoning text (`think`) and tool calls (`hermes`).

A parser is fed the detokenized output in deltas (`feed(text)`) and returns what became
certain with each (`ParsedDelta`); `finish()` releases the rest at the end. Whatever the split
into deltas, the concatenated results are the same: parsers withhold any tail that could be
the beginning of a tag and decide everything else character by character.

The server chains them with `OutputParser`: the reasoning parser sees the whole output, the
tool parser sees only the content the reasoning parser lets through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from flare_core.contract.protocols import ParsedDelta, ToolCallDelta  # noqa: F401 - the parsers' output types, re-exported
from flare_core.frontend.tool_calls import ToolCallStream
from flare_core.frontend.stops import partial_match_length


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass
class ParsedOutput:
    """The accumulation of a whole stream of deltas (what a non-streaming response returns)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, delta: ParsedDelta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        for piece in delta.tool_calls:
            if piece.index == len(self.tool_calls):
                self.tool_calls.append(ToolCall(piece.id or "", piece.name or "", ""))
            self.tool_calls[piece.index].arguments += piece.arguments


class ThinkParser:
    """Separates `<think>…</think>` reasoning from content (Qwen3, DeepSeek-R1 style).

    The output is reasoning when it starts with `<think>` (after optional whitespace) or when
    `starts_in_reasoning` says the prompt already opened it; reasoning runs until `</think>`
    or, when that never comes, to the end. Newlines next to the tags are formatting: the
    reasoning loses its leading and trailing newlines and the content its leading ones (the
    rule Qwen3's chat template applies when it renders a past assistant turn back).
    Anything after `</think>`, including another `<think>`, is content.
    """

    START_TAG = "<think>"
    END_TAG = "</think>"

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._state = "start"  # start -> reasoning -> after_reasoning -> content
        self._buffer = ""
        self._reasoning_started = False

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        return self._advance(final=False)

    def finish(self) -> ParsedDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParsedDelta:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state == "start":
                head = self._buffer.lstrip()
                if head.startswith(self.START_TAG):
                    self._buffer = head[len(self.START_TAG):]
                    self._state = "reasoning"
                elif self.START_TAG.startswith(head) and not final:
                    break
                else:
                    self._state = "reasoning" if self._starts_in_reasoning else "content"
            elif self._state == "reasoning":
                end = self._buffer.find(self.END_TAG)
                if end >= 0:
                    reasoning.append(self._reasoning_piece(self._buffer[:end].rstrip("\n")))
                    self._buffer = self._buffer[end + len(self.END_TAG):]
                    self._state = "after_reasoning"
                    continue
                held = 0 if final else partial_match_length(self._buffer, (self.END_TAG,))
                # Trailing newlines may turn out to precede `</think>`: hold them too.
                ready = self._buffer[:len(self._buffer) - held].rstrip("\n")
                self._buffer = "" if final else self._buffer[len(ready):]
                reasoning.append(self._reasoning_piece(ready))
                break
            elif self._state == "after_reasoning":
                self._buffer = self._buffer.lstrip("\n")
                if not self._buffer:
                    break
                self._state = "content"
            else:
                content.append(self._buffer)
                self._buffer = ""
                break
        return ParsedDelta(content="".join(content), reasoning="".join(reasoning))

    def _reasoning_piece(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip("\n")
            self._reasoning_started = bool(text)
        return text


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves a `<think>` block open (its template put `<think>` at the
    end of the generation prompt), so the output starts inside reasoning."""
    return prompt_text.rfind(ThinkParser.START_TAG) > prompt_text.rfind(ThinkParser.END_TAG)


_NUMBER = re.compile(r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_WHITESPACE = " \t\n\r"
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _JsonObjectScanner:
    """Validates one JSON object character by character and records where the values of its
    top-level keys lie in the consumed text (the first occurrence of each key)."""

    def __init__(self) -> None:
        self.text = ""
        self.spans: dict[str, tuple[int, int | None]] = {}  # key -> (start, end or None while open)
        self.completed_key: str | None = None  # top-level key whose value the last char completed
        self.done = False
        self.error = False
        self._stack: list[str] = []
        self._mode = "top"
        self._key: str | None = None
        self._value_start = 0
        self._string_start = 0
        self._string_is_key = False
        self._escape = False
        self._hex_left = 0
        self._literal_left = ""
        self._number_start = 0

    def feed_char(self, char: str) -> None:
        self.completed_key = None
        self.text += char
        position = len(self.text) - 1
        if not self._step(char, position):
            self.error = True

    def _step(self, char: str, position: int) -> bool:
        mode = self._mode
        if mode == "string":
            return self._string_char(char, position)
        if mode == "number":
            if char in _NUMBER_CHARS:
                return True
            if not _NUMBER.fullmatch(self.text, self._number_start, position):
                return False
            self._value_done(position)
            return self._step(char, position)
        if mode == "literal":
            if char != self._literal_left[0]:
                return False
            self._literal_left = self._literal_left[1:]
            if not self._literal_left:
                self._value_done(position + 1)
            return True
        if char in _WHITESPACE:
            return True
        if mode == "top":
            if char != "{":
                return False
            self._stack.append("{")
            self._mode = "key_or_close"
            return True
        if mode in ("key_or_close", "key"):
            if char == "}" and mode == "key_or_close":
                return self._close("{", position)
            if char != '"':
                return False
            self._begin_string(position, is_key=True)
            return True
        if mode == "colon":
            if char != ":":
                return False
            self._mode = "value"
            return True
        if mode == "after_value":
            if char == ",":
                self._mode = "key" if self._stack[-1] == "{" else "value"
                return True
            if char in "}]":
                return self._close("{" if char == "}" else "[", position)
            return False
        if mode == "value_or_close" and char == "]":
            return self._close("[", position)
        return self._begin_value(char, position)

    def _begin_value(self, char: str, position: int) -> bool:
        if not (char in '{["' or char == "-" or (char.isdigit() and char.isascii()) or char in _LITERALS):
            return False
        if len(self._stack) == 1:
            self._value_start = position
            if self._key is not None and self._key not in self.spans:
                self.spans[self._key] = (position, None)
        if char in "{[":
            self._stack.append(char)
            self._mode = "key_or_close" if char == "{" else "value_or_close"
        elif char == '"':
            self._begin_string(position, is_key=False)
        elif char == "-" or char.isdigit():
            self._mode = "number"
            self._number_start = position
        else:
            self._mode = "literal"
            self._literal_left = _LITERALS[char][1:]
        return True

    def _begin_string(self, position: int, is_key: bool) -> None:
        self._mode = "string"
        self._string_start = position
        self._string_is_key = is_key

    def _string_char(self, char: str, position: int) -> bool:
        if self._hex_left:
            self._hex_left -= 1
            return char in "0123456789abcdefABCDEF"
        if self._escape:
            self._escape = False
            if char == "u":
                self._hex_left = 4
                return True
            return char in '"\\/bfnrt'
        if char == "\\":
            self._escape = True
            return True
        if char < " ":
            return False  # JSON forbids raw control characters inside strings
        if char != '"':
            return True
        if self._string_is_key:
            if len(self._stack) == 1:
                self._key = json.loads(self.text[self._string_start:position + 1])
            self._mode = "colon"
        else:
            self._value_done(position + 1)
        return True

    def _close(self, opener: str, position: int) -> bool:
        if self._stack[-1] != opener:
            return False
        self._stack.pop()
        if not self._stack:
            self.done = True
            self._mode = "done"
        else:
            self._value_done(position + 1)
        return True

    def _value_done(self, end: int) -> None:
        self._mode = "after_value"
        if len(self._stack) == 1 and self._key is not None:
            start, known_end = self.spans.get(self._key, (None, None))
            if start == self._value_start and known_end is None:
                self.spans[self._key] = (start, end)
                self.completed_key = self._key


class HermesToolParser(ToolCallStream):
    """Tool calls in the Hermes / Qwen format, streamed:

        <tool_call>
        {"name": "get_weather", "arguments": {"city": "Paris"}}
        </tool_call>

    Text outside blocks is content; whitespace next to a tool call is formatting and dropped.
    A call is announced (index, generated id, name) as soon as its name is known; the raw text
    of its arguments object then streams as it is validated; the call is done when its JSON
    object closes. Missing arguments become "{}"; arguments given as a string holding a JSON
    object are unwrapped. A block whose JSON fails before the name is known, or that has no
    string name, is emitted verbatim as content. If the JSON fails after the announcement, the
    call ends with the arguments streamed so far and the block's text from the offending
    character up to `</tool_call>` becomes content.
    """

    START_TAG = "<tool_call>"
    END_TAG = "</tool_call>"
    block_begin = START_TAG

    def __init__(self) -> None:
        super().__init__()  # states: content | json | after_json | broken (announced call, invalid JSON)
        self._new_block("")

    def block_states(self) -> dict[str, Callable[[bool], bool]]:
        return {"json": self._advance_json, "after_json": self._advance_after_json, "broken": self._advance_broken}

    def open_block(self, whitespace_before: str) -> None:
        self.state = "json"
        self._new_block(whitespace_before)

    def _new_block(self, whitespace_before: str) -> None:
        self._scanner = _JsonObjectScanner()
        self._whitespace_before = whitespace_before
        self._announced = False
        self._arguments_sent = 0  # scanner text offset up to which arguments were sent
        self._sent_any_arguments = False

    def end_block(self) -> None:
        if self.state == "json":
            if self._announced:
                self._complete_call()  # output ended inside the call (e.g. max_tokens)
            else:
                self.emit_content(self._whitespace_before + self.START_TAG + self._scanner.text)
        elif self.state == "broken":
            self.emit_content(self.pending.strip())
            self._complete_call()

    def _advance_json(self, final: bool) -> bool:
        scanner = self._scanner
        for consumed, char in enumerate(self.pending, 1):
            scanner.feed_char(char)
            if scanner.error or (scanner.completed_key == "name" and not self._announce()):
                self._leave_json(consumed, len(scanner.text) - 1)
                return True
            if scanner.done:
                self._leave_json(consumed, len(scanner.text))
                return True
        self.pending = ""
        self._send_arguments()
        return False

    def _leave_json(self, consumed: int, valid_end: int) -> None:
        """The block's JSON ended (valid_end = its length) or failed (valid_end = the offending
        character); text from valid_end on is handed back to the next state."""
        scanner = self._scanner
        self.pending = scanner.text[valid_end:] + self.pending[consumed:]
        scanner.text = scanner.text[:valid_end]
        if not self._announced:
            self.emit_content(self._whitespace_before + self.START_TAG + scanner.text)
            self.state = "content"
            return
        self._send_arguments()
        if scanner.done:
            self._complete_call()
            self.state = "after_json"
        else:
            self.state = "broken"

    def _advance_after_json(self, final: bool) -> bool:
        rest = self.pending.lstrip()
        if rest.startswith(self.END_TAG):
            self.pending = rest[len(self.END_TAG):]
        elif self.END_TAG.startswith(rest) and not final:
            return False
        else:
            self.pending = rest  # the model left the block without its closing tag
        self.close_block()
        return True

    def _advance_broken(self, final: bool) -> bool:
        end = self.pending.find(self.END_TAG)
        if end < 0:
            return False
        self.emit_content(self.pending[:end].strip())
        self._complete_call()
        self.pending = self.pending[end + len(self.END_TAG):]
        self.close_block()
        return True

    def _announce(self) -> bool:
        start, end = self._scanner.spans["name"]
        name = json.loads(self._scanner.text[start:end])
        if not isinstance(name, str) or not name:
            return False
        self.announce(name)
        self._announced = True
        self._send_arguments()
        return True

    def _send_arguments(self) -> None:
        """Send the newly validated part of an arguments object (once the call is announced)."""
        span = self._scanner.spans.get("arguments")
        if not self._announced or span is None or self._scanner.text[span[0]] != "{":
            return
        end = len(self._scanner.text) if span[1] is None else span[1]
        start = max(self._arguments_sent, span[0])
        if end > start:
            self.send_arguments(self._scanner.text[start:end])
            self._arguments_sent = end
            self._sent_any_arguments = True

    def _complete_call(self) -> None:
        self.end_call("" if self._sent_any_arguments else self._whole_arguments())

    def _whole_arguments(self) -> str:
        """Arguments text for a call whose arguments were not an object streamed in place."""
        span = self._scanner.spans.get("arguments")
        if span is None or span[1] is None:
            return "{}"
        raw = self._scanner.text[span[0]:span[1]]
        value = json.loads(raw)
        if isinstance(value, str):
            try:
                if isinstance(json.loads(value), dict):
                    return value
            except ValueError:
                pass
        return raw


class OutputParser:
    """The server's chain: the reasoning parser splits off reasoning, the tool parser reads
    the content that remains. Either may be None."""

    def __init__(self, reasoning: ThinkParser | None = None, tool: HermesToolParser | None = None) -> None:
        self._reasoning = reasoning
        self._tool = tool

    @property
    def active(self) -> bool:
        """Whether any parser reads the output (its markers may be special tokens)."""
        return self._reasoning is not None or self._tool is not None

    def feed(self, text: str) -> ParsedDelta:
        first = self._reasoning.feed(text) if self._reasoning is not None else ParsedDelta(content=text)
        return self._through_tool(first, final=False)

    def finish(self) -> ParsedDelta:
        first = self._reasoning.finish() if self._reasoning is not None else ParsedDelta()
        return self._through_tool(first, final=True)

    def _through_tool(self, first: ParsedDelta, final: bool) -> ParsedDelta:
        if self._tool is None:
            return first
        second = self._tool.feed(first.content)
        if final:
            second = second + self._tool.finish()
        return ParsedDelta(content=second.content, reasoning=first.reasoning, tool_calls=second.tool_calls)
