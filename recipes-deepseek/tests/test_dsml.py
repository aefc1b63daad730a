"""DeepSeek V4's DSML tool calls, streamed (flare_recipe_deepseek.dsml).

The calls in DeepSeek's own test vectors (tests/fixtures/deepseek-v4-encoding/test_output_N.txt,
the assistant turns after `</think>`) must come out with the arguments text DeepSeek's reference
decoder writes (`{"location": "Beijing", "unit": "celsius"}`: members `"key": value` joined by
", "), whatever the split of the output into deltas; calls rendered by our own encoder must read
back to what they were; malformed output stays readable as content.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from flare_core.frontend.parsers import ParsedOutput
from flare_recipe_deepseek.dsml import DsmlToolParser
from flare_recipe_deepseek.v4_encoder import ASSISTANT, END_THINK, EOS, render

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v4-encoding"


def parse(text: str, pieces: int | None = None) -> ParsedOutput:
    """`text` fed whole, or in `pieces`-character deltas."""
    parser, output = DsmlToolParser(), ParsedOutput()
    size = pieces or max(len(text), 1)
    for start in range(0, len(text), size):
        output.add(parser.feed(text[start:start + size]))
    output.add(parser.finish())
    return output


def calls(output: ParsedOutput) -> list[tuple[str, str]]:
    assert all(not call.id for call in output.tool_calls)  # DSML has no call ids: the protocol adapter mints them
    return [(call.name, call.arguments) for call in output.tool_calls]


def assistant_answers(number: int) -> list[str]:
    """Each assistant turn of a vector after its reasoning (what follows `</think>`), less EOS."""
    text = (FIXTURES / f"test_output_{number}.txt").read_text(encoding="utf-8")
    turns = re.findall(f"{ASSISTANT}(.*?){EOS}", text, flags=re.DOTALL)
    return [turn[turn.index(END_THINK) + len(END_THINK):] for turn in turns]


def test_the_calls_of_deepseeks_vectors():
    answers = assistant_answers(1)
    expected = [[("get_weather", '{"location": "Beijing", "unit": "celsius"}')], []]
    assert len(answers) == 2
    for answer, wanted in zip(answers, expected):
        for pieces in (None, 1, 3, 7):
            output = parse(answer, pieces)
            assert calls(output) == wanted
            assert output.content == ("" if wanted else answer)
    search = [c for answer in assistant_answers(3) for c in calls(parse(answer, 2))]
    assert search and all(name in ("search", "open") for name, _ in search)
    assert all(isinstance(json.loads(arguments), dict) for _, arguments in search)


def test_calls_our_encoder_renders_read_back():
    arguments = {"city": "Oslo \"north\"\n", "days": 3, "flags": [True, None], "where": {"lat": 59.9}}
    conversation = [{"role": "user", "content": "Weather?"},
                    {"role": "assistant", "content": "Let me check.",
                     "tool_calls": [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                                                 "arguments": arguments}},
                                    {"id": "b", "type": "function", "function": {"name": "now", "arguments": {}}}]}]
    text = render(conversation, thinking=False).text
    answer = text[text.rindex(END_THINK) + len(END_THINK):-len(EOS)]
    for pieces in (None, 1, 5):
        output = parse(answer, pieces)
        assert output.content == "Let me check."
        assert [(name, json.loads(args)) for name, args in calls(output)] == [("get_weather", arguments),
                                                                             ("now", {})]


@pytest.mark.parametrize("text,content,expected", [
    # no call in the block: the block is content, verbatim
    ("Hi.\n\n<｜DSML｜tool_calls>\nnothing here", "Hi.<｜DSML｜tool_calls>\nnothing here", []),
    # output ending inside a value: the call ends with its arguments closed
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="q" string="true">par', "",
     [("f", '{"q": "par"}')]),
    # text after the block is content; the whitespace around the block is dropped
    ('A\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nB', "AB",
     [("f", "{}")]),
    # a tag-like value inside a string stays in it
    ('<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="x" string="true">a</b'
     '</｜DSML｜parameter></｜DSML｜invoke></｜DSML｜tool_calls>', "", [("f", '{"x": "a</b"}')]),
    # a call header that is no name: the call is content
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="two words">\n</｜DSML｜invoke>', 
     '<｜DSML｜tool_calls><｜DSML｜invoke name="two words">\n</｜DSML｜invoke>', []),
    # text inside a call that is no parameter ends the call and is content
    ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\noops', "oops", [("f", "{}")]),
])
def test_malformed_output_stays_readable(text, content, expected):
    for pieces in (None, 1, 4):
        output = parse(text, pieces)
        assert output.content == content and calls(output) == expected
