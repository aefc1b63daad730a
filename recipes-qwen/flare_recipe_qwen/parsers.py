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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flare_core.api import ToolCallFormat, ToolCallStream

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


class QwenXmlToolParser(ToolCallStream):
    """Streams Qwen's XML tool calls (see the module docstring); `tools` are the request's tools,
    whose schemas type the argument values."""

    block_begin = BLOCK_BEGIN
    whitespace = _WHITESPACE

    def __init__(self, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self._types = parameter_types(tools)
        # content | block (after <tool_call>) | name (after <function=) | function | parameter_name | value
        # | after_function (before </tool_call>) | broken (a call ended early; skipping to </tool_call>)
        super().__init__()
        self._opening = ""  # a block's text up to its function name, as written (for malformed output)
        self._function = ""
        self._parameter = ""
        self._members = 0

    def block_states(self) -> dict[str, Callable[[bool], bool]]:
        return {"block": self._block, "name": self._name, "function": self._in_function,
                "parameter_name": self._parameter_name, "value": self._value, "after_function": self._after_function,
                "broken": self._broken}

    def open_block(self, whitespace_before: str) -> None:
        self.state = "block"

    def end_block(self) -> None:
        if self.state == "value":
            self._add_member(self._value_text(self.pending))
            self._end_call()
        elif self.state in ("function", "parameter_name"):
            self._end_call()
        elif self.state == "block":
            self.emit_content(BLOCK_BEGIN + self.pending)
        elif self.state == "name":
            self.emit_content(self._opening + self.pending)

    def _block(self, final: bool) -> bool:
        head = self.pending.lstrip(_WHITESPACE)
        if head.startswith(FUNCTION_BEGIN):
            self._opening = BLOCK_BEGIN + self.pending[:len(self.pending) - len(head)] + FUNCTION_BEGIN
            self.pending = head[len(FUNCTION_BEGIN):]
            self.state = "name"
            return True
        if not final and FUNCTION_BEGIN.startswith(head):
            return False
        self.emit_content(BLOCK_BEGIN)  # not a call: the text as written, read on as content
        self.state = "content"
        return True

    def _name(self, final: bool) -> bool:
        end = self.pending.find(">")
        if end < 0:
            return False
        name = self.pending[:end].strip()
        if not name or "\n" in name or "<" in name:
            self.emit_content(self._opening + self.pending[:end + 1])
            self.pending = self.pending[end + 1:]
            self.state = "content"
            return True
        self._function, self._members = name, 0
        self.announce(name)
        self.pending = self.pending[end + 1:]
        self.state = "function"
        return True

    def _in_function(self, final: bool) -> bool:
        head = self.pending.lstrip(_WHITESPACE)
        for tag, state in ((PARAMETER_BEGIN, "parameter_name"), (FUNCTION_END, "after_function")):
            if head.startswith(tag):
                self.pending = head[len(tag):]
                if state == "after_function":
                    self._end_call()
                self.state = state
                return True
        if not final and (not head or PARAMETER_BEGIN.startswith(head) or FUNCTION_END.startswith(head)):
            return False
        self._end_call()  # text that is neither a parameter nor the function's end
        self.state = "broken"
        return True

    def _parameter_name(self, final: bool) -> bool:
        end = self.pending.find(">")
        if end < 0:
            return False
        self._parameter = self.pending[:end].strip()
        self.pending = self.pending[end + 1:]
        self.state = "value"
        return True

    def _value(self, final: bool) -> bool:
        end = self.pending.find(PARAMETER_END)
        if end < 0:
            return False  # a value becomes a member only whole (its type decides its JSON)
        self._add_member(self._value_text(self.pending[:end]))
        self.pending = self.pending[end + len(PARAMETER_END):]
        self.state = "function"
        return True

    def _after_function(self, final: bool) -> bool:
        head = self.pending.lstrip(_WHITESPACE)
        if head.startswith(BLOCK_END):
            self.pending = head[len(BLOCK_END):]
        elif not final and BLOCK_END.startswith(head):
            return False
        else:
            self.pending = head  # the model left the block without its closing tag
        self.close_block()
        return True

    def _broken(self, final: bool) -> bool:
        end = self.pending.find(BLOCK_END)
        if end < 0:
            if final:
                self.emit_content(self.pending.strip(_WHITESPACE))
                self.pending = ""
            return False
        self.emit_content(self.pending[:end].strip(_WHITESPACE))
        self.pending = self.pending[end + len(BLOCK_END):]
        self.close_block()
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
        self.send_arguments(("{" if self._members == 0 else ", ") + member)
        self._members += 1

    def _end_call(self) -> None:
        self.end_call("{}" if self._members == 0 else "}")
