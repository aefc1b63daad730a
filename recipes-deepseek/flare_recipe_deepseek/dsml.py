"""DeepSeek V4's and V4.1's tool calls (DSML), streamed into OpenAI tool calls.

V4 writes its calls after its answer text as a DSML block (flare_recipe_deepseek.v4_encoder
renders them back the same way; V4.1 names the tags ` calls`, ` invoke`, ` parameter`, with a
leading space, and is otherwise the same: `V41_TAGS`):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

Each parameter becomes one member of the call's JSON arguments: a `string="true"` value is the
string as written (JSON-escaped here), any other value is JSON text already and passes through.
The arguments come out as DeepSeek's reference decoder writes them, `{"city": "Oslo", "days": 3}`,
streamed as the values arrive. The parser has the `feed`/`finish` -> `ParsedDelta` interface of
`flare_core.frontend.parsers`; whatever the split into deltas, the concatenated results are the
same (a tail that could still become a tag is withheld).

Text outside the block is content; the whitespace around the block is formatting and dropped.
Malformed output stays readable: a block that does not start with an invoke is content verbatim,
and text that breaks a call ends it with the arguments so far and is content. Output that ends
inside a call (e.g. at max_tokens) ends the call with its arguments closed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import astuple, dataclass

from flare_core.api import ToolCallStream, partial_match_length

DSML = "｜DSML｜"
HEADER_END = '">'


@dataclass(frozen=True)
class DsmlTags:
    """A DSML dialect's tags around the block of calls, a call (its name follows `invoke_begin`)
    and a parameter (likewise)."""

    block_begin: str
    block_end: str
    invoke_begin: str
    invoke_end: str
    parameter_begin: str
    parameter_end: str

    @classmethod
    def named(cls, block: str, invoke: str, parameter: str) -> DsmlTags:
        return cls(f"<{DSML}{block}>", f"</{DSML}{block}>", f'<{DSML}{invoke} name="', f"</{DSML}{invoke}>",
                   f'<{DSML}{parameter} name="', f"</{DSML}{parameter}>")

    @property
    def markers(self) -> tuple[str, ...]:
        return astuple(self)


V4_TAGS = DsmlTags.named("tool_calls", "invoke", "parameter")
V41_TAGS = DsmlTags.named(" calls", " invoke", " parameter")
_PARAMETER_HEADER = re.compile(r'(.+?)" string="(true|false)', re.DOTALL)
_WHITESPACE = " \t\r\n"


class DsmlToolParser(ToolCallStream):
    """Streams V4's DSML tool calls (see the module docstring)."""

    tags = V4_TAGS
    block_begin = V4_TAGS.block_begin
    whitespace = _WHITESPACE

    def __init__(self) -> None:
        super().__init__()  # states: content | block | invoke_header | invoke | parameter_header | value
        self._block_calls = 0  # calls announced in the current block
        self._parameters = 0  # parameters of the current call so far
        self._string_value = False

    def block_states(self) -> dict[str, Callable[[bool], bool]]:
        return {"block": self._advance_block, "invoke_header": self._advance_invoke_header,
                "invoke": self._advance_invoke, "parameter_header": self._advance_parameter_header,
                "value": self._advance_value}

    def open_block(self, whitespace_before: str) -> None:
        self.state, self._block_calls = "block", 0

    def end_block(self) -> None:
        if self.state == "value":
            self.send_arguments(self._value_text(self.pending) + ('"' if self._string_value else ""))
            self._end_call()
        elif self.state in ("invoke", "parameter_header"):
            self._end_call()
        elif self.state == "invoke_header":
            self.emit_content(self._block_prefix() + self.tags.invoke_begin + self.pending)
        elif self.state == "block" and self._block_calls == 0:
            self.emit_content(self.tags.block_begin)  # an opening tag with nothing after it

    def _end_call(self) -> None:
        self.end_call("}" if self._parameters else "{}")
        self.state = "block"

    def _block_prefix(self) -> str:
        """The block's opening tag, when malformed text is the first thing to leave the block."""
        return self.tags.block_begin if self._block_calls == 0 else ""

    def _value_text(self, text: str) -> str:
        return json.dumps(text, ensure_ascii=False)[1:-1] if self._string_value else text

    # ---- states ------------------------------------------------------------------------

    def _expect(self, rest: str, tags: tuple[str, ...], final: bool) -> str | None:
        """The tag among `tags` that `rest` starts with; "" while `rest` may still become one."""
        for tag in tags:
            if rest.startswith(tag):
                return tag
        if not final and (not rest or any(tag.startswith(rest) for tag in tags)):
            return ""
        return None

    def _advance_block(self, final: bool) -> bool:
        rest = self.pending.lstrip(_WHITESPACE)
        tag = self._expect(rest, (self.tags.invoke_begin, self.tags.block_end), final)
        if tag == "":
            return False
        if tag == self.tags.invoke_begin:
            self.pending, self.state = rest[len(tag):], "invoke_header"
        elif tag == self.tags.block_end:
            self.pending = rest[len(tag):]
            self.close_block()
        else:  # not a call: the block ends here, and its text is content (verbatim if it held no call)
            self.emit_content(self._block_prefix())
            self.pending = self.pending if self._block_calls == 0 else rest
            self.state = "content"
        return True

    def _advance_invoke_header(self, final: bool) -> bool:
        end = self.pending.find(HEADER_END)
        name = self.pending[:end] if end >= 0 else ""
        if end >= 0 and name and not any(char in _WHITESPACE + '"<>' for char in name):
            self.announce(name)
            self.pending = self.pending[end + len(HEADER_END):]
            self.state, self._parameters = "invoke", 0
            self._block_calls += 1
            return True
        broken_at = self.pending.find(self.tags.invoke_end)
        if end >= 0 or broken_at >= 0:  # no call header: the call's text up to its end is content
            stop = broken_at + len(self.tags.invoke_end) if broken_at >= 0 else len(self.pending)
            self.emit_content(self._block_prefix() + self.tags.invoke_begin + self.pending[:stop])
            self._block_calls += 1  # the block's opening tag went out with it
            self.pending, self.state = self.pending[stop:], "block" if broken_at >= 0 else "content"
            return True
        return False

    def _advance_invoke(self, final: bool) -> bool:
        rest = self.pending.lstrip(_WHITESPACE)
        tag = self._expect(rest, (self.tags.parameter_begin, self.tags.invoke_end), final)
        if tag == "":
            return False
        if tag == self.tags.parameter_begin:
            self.pending, self.state = rest[len(tag):], "parameter_header"
        elif tag == self.tags.invoke_end:
            self.pending = rest[len(tag):]
            self._end_call()
        else:  # text that is no parameter ends the call, and the block; it is content
            self._end_call()
            self.pending, self.state = rest, "content"
        return True

    def _advance_parameter_header(self, final: bool) -> bool:
        end = self.pending.find(HEADER_END)
        if end < 0:
            if any(marker in self.pending for marker in self.tags.markers):  # a tag before the header ended
                self._end_call()
                self.state = "content"
                return True
            return False
        header = _PARAMETER_HEADER.fullmatch(self.pending[:end])
        if header is None:
            self._end_call()
            self.pending, self.state = self.tags.parameter_begin + self.pending, "content"
            return True
        name, string = header.groups()
        self._string_value = string == "true"
        self.send_arguments(("{" if self._parameters == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": "
                            + ('"' if self._string_value else ""))
        self._parameters += 1
        self.pending, self.state = self.pending[end + len(HEADER_END):], "value"
        return True

    def _advance_value(self, final: bool) -> bool:
        end = self.pending.find(self.tags.parameter_end)
        if end >= 0:
            self.send_arguments(self._value_text(self.pending[:end]) + ('"' if self._string_value else ""))
            self.pending, self.state = self.pending[end + len(self.tags.parameter_end):], "invoke"
            return True
        held = 0 if final else partial_match_length(self.pending, (self.tags.parameter_end,))
        ready = self.pending[:len(self.pending) - held]
        self.send_arguments(self._value_text(ready))
        self.pending = self.pending[len(ready):]
        return False


class DsmlV41ToolParser(DsmlToolParser):
    """Streams V4.1's DSML tool calls (` calls`, ` invoke`, ` parameter`)."""

    tags = V41_TAGS
    block_begin = V41_TAGS.block_begin
