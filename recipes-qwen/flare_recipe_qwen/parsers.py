"""Tool calls in Qwen's XML format (Qwen3-Coder, Qwen3.5), streamed into OpenAI tool calls.

These models write calls after their answer text, one block per call, as their chat templates
render them back:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags, less the newline after the opening tag and the
one before the closing tag. The templates write a string argument as it is and any other value as
JSON (`tojson`), so the text alone does not say which a value is: "3" may be the string or the
number. The request's tools do: a value becomes a JSON member by the type its tool's JSON schema
gives the parameter (string: the text; integer / number / boolean / null / object / array: the
text read as JSON, or for boolean / null as the Python spelling the templates' `string` filter
writes, True / False / None; the text as a string when it does not read as that type). A
parameter the schema does not declare is read as JSON when the text is JSON, else as a string.

The call is announced (index, generated id, name) when its function tag closes; its arguments
stream one member per closed parameter, and the object closes with the function. Text outside
blocks is content; the whitespace around a block is formatting and dropped. Malformed output stays
readable: a block that does not open a function is content verbatim; text inside a function that
is neither a parameter nor its end ends the call with the arguments so far, and the rest of the
block is content. Output that ends inside a call (e.g. at max_tokens) ends the call with its
arguments closed (an unfinished value is kept as written so far). Whatever the split into deltas,
the concatenated results are the same (a tail that could still become a tag is withheld).

Forced calls (`QWEN_XML_CALLS`, the parser's call format) are written as the template writes them,
their arguments constrained by xgrammar's qwen_xml style of the tool's JSON schema.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from flare_core.api import ParsedDelta, ToolCallDelta, ToolCallFormat, partial_match_length

BLOCK_BEGIN, BLOCK_END = "<tool_call>", "</tool_call>"
FUNCTION_BEGIN, FUNCTION_END = "<function=", "</function>"
PARAMETER_BEGIN, PARAMETER_END = "<parameter=", "</parameter>"
_WHITESPACE = " \t\r\n"
_JSON_TYPES = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}
# Calls as the Qwen3.5 template writes them, for forced calls (tool_choice "required" / a named tool).
QWEN_XML_CALLS = ToolCallFormat(call_begin=BLOCK_BEGIN + "\n" + FUNCTION_BEGIN + "{name}>\n",
                                call_end=FUNCTION_END + "\n" + BLOCK_END, separator="\n", arguments="qwen_xml")


def parameter_types(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> parameter name -> the type names its schema allows (`type_names`), from
    tools in the OpenAI function shape ({"type": "function", "function": {"name",
    "parameters"}})."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        parameters = function.get("parameters") if isinstance(function, Mapping) else None
        properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
        if not isinstance(properties, Mapping):
            continue  # a schema this reader cannot use types nothing
        types[str(function.get("name", ""))] = {
            name: type_names(schema.get("type") if isinstance(schema, Mapping) else None)
            for name, schema in properties.items()}
    return types


def type_names(declared: Any) -> list[str]:
    """The type names a JSON schema's "type" allows (a name or a list of names); empty when it
    says none this reader can use."""
    names = declared if isinstance(declared, list) else [declared]
    return [name for name in names if isinstance(name, str)]


def argument_json(text: str, declared: Any) -> str:
    """The JSON text of one argument value written as `text`, for a parameter whose schema type
    is `declared` (a name, a list of names; None or empty: undeclared)."""
    kinds = type_names(declared)
    if kinds == ["string"]:
        return json.dumps(text, ensure_ascii=False)
    # The templates write scalars with Jinja's `string` filter: Python's True / False / None.
    python = {"True": True, "False": False, "None": None}
    if text.strip() in python and any(kind in ("boolean", "null") for kind in kinds):
        value = python[text.strip()]
        if any(_fits(value, kind) for kind in kinds):
            return json.dumps(value)
    try:
        value = json.loads(text)
    except ValueError:
        return json.dumps(text, ensure_ascii=False)
    if kinds and not any(_fits(value, kind) for kind in kinds):
        return json.dumps(text, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _fits(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "string":
        return isinstance(value, str)
    expected = _JSON_TYPES.get(kind)
    if expected is None:
        return True  # a type this reader does not know: keep what the text says
    if isinstance(value, bool) and kind != "boolean":
        return False
    return isinstance(value, expected)


class QwenXmlToolParser:
    """Streams Qwen's XML tool calls (see the module docstring); `tools` are the request's tools,
    whose schemas type the argument values."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self._types = parameter_types(tools)
        # content | block (after <tool_call>) | name (after <function=) | function | parameter_name | value
        # | after_function (before </tool_call>) | broken (a call ended early; skipping to </tool_call>)
        self._state = "content"
        self._pending = ""
        self._after_block = False  # whitespace that follows a block is dropped
        self._calls_done = 0
        self._opening = ""  # a block's text up to its function name, as written (for malformed output)
        self._function = ""
        self._parameter = ""
        self._members = 0
        self._output = ParsedDelta()

    def feed(self, text: str) -> ParsedDelta:
        self._pending += text
        self._advance(final=False)
        return self._take_output()

    def finish(self) -> ParsedDelta:
        self._advance(final=True)
        if self._state == "value":
            self._add_member(self._value_text(self._pending))
            self._end_call()
        elif self._state in ("function", "parameter_name"):
            self._end_call()
        elif self._state == "block":
            self._emit_content(BLOCK_BEGIN + self._pending)
        elif self._state == "name":
            self._emit_content(self._opening + self._pending)
        elif self._state == "content":
            self._emit_content(self._pending.lstrip(_WHITESPACE) if self._after_block else self._pending)
        self._pending = ""
        self._state = "content"
        return self._take_output()

    def _take_output(self) -> ParsedDelta:
        output, self._output = self._output, ParsedDelta()
        return output

    def _emit_content(self, text: str) -> None:
        if text:
            self._output += ParsedDelta(content=text)

    def _send(self, delta: ToolCallDelta) -> None:
        self._output += ParsedDelta(tool_calls=(delta,))

    def _advance(self, final: bool) -> None:
        steps = {"content": self._content, "block": self._block, "name": self._name, "function": self._in_function,
                 "parameter_name": self._parameter_name, "value": self._value, "after_function": self._after_function,
                 "broken": self._broken}
        while self._pending and steps[self._state](final):
            pass

    def _content(self, final: bool) -> bool:
        if self._after_block:
            self._pending = self._pending.lstrip(_WHITESPACE)
            if not self._pending:
                return False
            self._after_block = False
        start = self._pending.find(BLOCK_BEGIN)
        if start >= 0:
            self._emit_content(self._pending[:start].rstrip(_WHITESPACE))
            self._pending = self._pending[start + len(BLOCK_BEGIN):]
            self._state = "block"
            return True
        if final:
            return False
        held = partial_match_length(self._pending, (BLOCK_BEGIN,))
        # Trailing whitespace may turn out to precede a block (and be dropped): hold it too.
        ready = self._pending[:len(self._pending) - held].rstrip(_WHITESPACE)
        self._emit_content(ready)
        self._pending = self._pending[len(ready):]
        return False

    def _block(self, final: bool) -> bool:
        head = self._pending.lstrip(_WHITESPACE)
        if head.startswith(FUNCTION_BEGIN):
            self._opening = BLOCK_BEGIN + self._pending[:len(self._pending) - len(head)] + FUNCTION_BEGIN
            self._pending = head[len(FUNCTION_BEGIN):]
            self._state = "name"
            return True
        if not final and FUNCTION_BEGIN.startswith(head):
            return False
        self._emit_content(BLOCK_BEGIN)  # not a call: the text as written, read on as content
        self._state = "content"
        return True

    def _name(self, final: bool) -> bool:
        end = self._pending.find(">")
        if end < 0:
            return False
        name = self._pending[:end].strip()
        if not name or "\n" in name or "<" in name:
            self._emit_content(self._opening + self._pending[:end + 1])
            self._pending = self._pending[end + 1:]
            self._state = "content"
            return True
        self._function, self._members = name, 0
        self._send(ToolCallDelta(self._calls_done, "call_" + secrets.token_hex(12), name))
        self._pending = self._pending[end + 1:]
        self._state = "function"
        return True

    def _in_function(self, final: bool) -> bool:
        head = self._pending.lstrip(_WHITESPACE)
        for tag, state in ((PARAMETER_BEGIN, "parameter_name"), (FUNCTION_END, "after_function")):
            if head.startswith(tag):
                self._pending = head[len(tag):]
                if state == "after_function":
                    self._end_call()
                self._state = state
                return True
        if not final and (not head or PARAMETER_BEGIN.startswith(head) or FUNCTION_END.startswith(head)):
            return False
        self._end_call()  # text that is neither a parameter nor the function's end
        self._state = "broken"
        return True

    def _parameter_name(self, final: bool) -> bool:
        end = self._pending.find(">")
        if end < 0:
            return False
        self._parameter = self._pending[:end].strip()
        self._pending = self._pending[end + 1:]
        self._state = "value"
        return True

    def _value(self, final: bool) -> bool:
        end = self._pending.find(PARAMETER_END)
        if end < 0:
            return False  # a value becomes a member only whole (its type decides its JSON)
        self._add_member(self._value_text(self._pending[:end]))
        self._pending = self._pending[end + len(PARAMETER_END):]
        self._state = "function"
        return True

    def _after_function(self, final: bool) -> bool:
        head = self._pending.lstrip(_WHITESPACE)
        if head.startswith(BLOCK_END):
            self._pending = head[len(BLOCK_END):]
        elif not final and BLOCK_END.startswith(head):
            return False
        else:
            self._pending = head  # the model left the block without its closing tag
        self._state = "content"
        self._after_block = True
        return True

    def _broken(self, final: bool) -> bool:
        end = self._pending.find(BLOCK_END)
        if end < 0:
            if final:
                self._emit_content(self._pending.strip(_WHITESPACE))
                self._pending = ""
            return False
        self._emit_content(self._pending[:end].strip(_WHITESPACE))
        self._pending = self._pending[end + len(BLOCK_END):]
        self._state = "content"
        self._after_block = True
        return True

    @staticmethod
    def _value_text(raw: str) -> str:
        """A value as written: the template puts a newline after the opening tag and one before
        the closing tag."""
        text = raw[1:] if raw.startswith("\n") else raw
        return text[:-1] if text.endswith("\n") else text

    def _add_member(self, text: str) -> None:
        declared = self._types.get(self._function, {}).get(self._parameter)
        member = json.dumps(self._parameter, ensure_ascii=False) + ": " + argument_json(text, declared)
        self._send(ToolCallDelta(self._calls_done, arguments=("{" if self._members == 0 else ", ") + member))
        self._members += 1

    def _end_call(self) -> None:
        self._send(ToolCallDelta(self._calls_done, arguments="{}" if self._members == 0 else "}", done=True))
        self._calls_done += 1
