"""Qwen's XML tool calls (Qwen3-Coder, Qwen3.5; flare_recipe_qwen.parsers, parser `qwen3-xml`):
calls rendered by the Qwen3.5 chat template (tests/fixtures/qwen3.5, see its SOURCES.md) come back
as the OpenAI tool calls they were rendered from, however the text is split into deltas, with
argument values typed by the request's tool schemas."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flare_core.frontend.parsers import ParsedOutput
from flare_core.frontend.template import ChatTemplate
from flare_core.plugins import load_registry
from flare_recipe_qwen.parsers import QwenXmlToolParser, argument_json

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3.5" / "chat_template.jinja").read_text(encoding="utf-8")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "zip": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array", "items": {"type": "integer"}}, "where": {"type": "object"},
        "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}}}}},
]
CALLS = [
    ("get_weather", {"zip": "10115", "days": 3, "metric": True, "hours": [6, 18], "where": {"lat": 52.5, "tag": "x<y"},
                     "note": "two\nlines, 🌦️"}),
    ("search", {"query": "true"}),
]


def rendered_assistant(content: str, calls) -> str:
    """What the template writes for an assistant turn with `content` and `calls` (the text the
    model was trained to produce), without the turn's framing and its (empty) reasoning block,
    which the reasoning parser takes before the tool parser sees the text."""
    messages = [{"role": "user", "content": "Weather in Berlin?"},
                {"role": "assistant", "content": content,
                 "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]}]
    text = ChatTemplate(TEMPLATE).render(messages, tools=TOOLS).text
    turn = text[text.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    return turn.removesuffix("<|im_end|>\n").split("</think>\n\n", 1)[1]


def parse(text: str, pieces: list[str] | None = None, tools=TOOLS) -> ParsedOutput:
    parser = QwenXmlToolParser(tools)
    output = ParsedOutput()
    for piece in pieces if pieces is not None else [text]:
        output.add(parser.feed(piece))
    output.add(parser.finish())
    return output


def splits(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def test_the_templates_calls_come_back_typed_by_the_schemas():
    text = rendered_assistant("Let me look that up.", CALLS)
    assert "<parameter=zip>\n10115\n</parameter>" in text and "<parameter=days>\n3\n</parameter>" in text
    output = parse(text)
    assert output.content == "Let me look that up."
    assert [(c.name, json.loads(c.arguments)) for c in output.tool_calls] == CALLS
    assert all(not c.id for c in output.tool_calls)  # Qwen writes no call ids: the protocol adapter mints them


@pytest.mark.parametrize("seed", range(12))
def test_any_split_into_deltas_gives_the_same_calls(seed):
    text = rendered_assistant("", CALLS)
    whole = parse(text)
    output = parse(text, splits(text, seed))
    assert output.content == whole.content == ""
    assert [(c.name, c.arguments) for c in output.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_character_by_character_streaming_sends_members_as_they_close():
    text = rendered_assistant("Sure.", CALLS[:1])
    parser = QwenXmlToolParser(TOOLS)
    pieces = []
    for char in text:
        pieces.extend(d.arguments for d in parser.feed(char).tool_calls if d.arguments)
    pieces.extend(d.arguments for d in parser.finish().tool_calls if d.arguments)
    assert pieces[0] == '{"zip": "10115"' and pieces[1] == ', "days": 3' and pieces[-1] == "}"
    assert json.loads("".join(pieces)) == CALLS[0][1]


def test_without_a_schema_json_text_is_read_as_json():
    output = parse("<tool_call>\n<function=other>\n<parameter=n>\n10115\n</parameter>\n<parameter=s>\nOslo\n"
                   "</parameter>\n</function>\n</tool_call>")
    assert json.loads(output.tool_calls[0].arguments) == {"n": 10115, "s": "Oslo"}
    # A value that does not fit its declared type stays the text the model wrote.
    assert argument_json("three", "integer") == '"three"' and argument_json("3", "integer") == "3"
    assert argument_json("1", "boolean") == '"1"' and argument_json("null", ["string", "null"]) == "null"
    # The template writes booleans and None as Python does (Jinja's `string` filter).
    assert argument_json("False", "boolean") == "false" and argument_json("None", ["integer", "null"]) == "null"
    assert argument_json("True", None) == '"True"' and argument_json("True", "string") == '"True"'


def test_a_call_without_parameters_has_empty_arguments():
    output = parse("<tool_call>\n<function=search>\n</function>\n</tool_call>")
    assert [(c.name, c.arguments) for c in output.tool_calls] == [("search", "{}")]


@pytest.mark.parametrize("text, content, calls", [
    ("<tool_call>\nnot a call\n</tool_call> after", "<tool_call>\nnot a call\n</tool_call> after", []),
    ("<tool_call>\n<function=search>\nchatter\n</tool_call>\ntail", "chattertail", [("search", {})]),
    ("<tool_call>\n<function=search>\n<parameter=query>\nhal", "", [("search", {"query": "hal"})]),
    ("<tool_call>\n<function=get", "<tool_call>\n<function=get", []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
])
def test_malformed_output_stays_readable(text, content, calls):
    for pieces in ([text], list(text)):
        output = parse(text, pieces)
        assert output.content == content
        assert [(c.name, json.loads(c.arguments)) for c in output.tool_calls] == calls


def test_the_plugin_registers_it_as_a_tool_parser_reading_the_tools():
    parser = load_registry().parsers["qwen3-xml"]
    assert parser.kind == "tool" and parser.reads_tools and parser.call_format.arguments == "qwen_xml"
    assert isinstance(parser.factory(tools=TOOLS), QwenXmlToolParser)


@pytest.mark.parametrize("tools", [
    [{"type": "function", "function": {"name": "search", "parameters": {"properties": ["query"]}}}],
    [{"type": "function", "function": {"name": "search", "parameters": {"properties": {"query": {"type": {"x": 1}}}}}}],
    [{"type": "function", "function": {"name": "search", "parameters": {"properties": {"query": {"type": [7, "string"]}}}}}],
    [{"type": "function", "function": {"name": "search", "parameters": {"properties": {"query": "string"}}}}],
])
def test_schemas_this_reader_cannot_use_type_nothing(tools):
    output = parse("<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n</function>\n</tool_call>",
                   tools=tools)
    assert json.loads(output.tool_calls[0].arguments)["query"] in (42, "42")
