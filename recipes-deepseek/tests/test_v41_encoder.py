"""DeepSeek V4.1's prompt format (flare_recipe_deepseek.v4_encoder, dialect V41) and its DSML tool
calls (flare_recipe_deepseek.dsml.DsmlV41ToolParser) against the vectors the V4.1 encoder
produced (tests/fixtures/deepseek-v41-encoding, SOURCES.md says how).

Every vector whose conversation a Flare request can carry is rendered byte for byte, and every
rejection among them is a rejection here. The rest are listed in NOT_CARRIED with the reason: a
core serves text only, so image and other non-text content parts are refused by the server
before any encoder runs (tests/test_server_validation.py), and special-token spellings a client
types reach the encoder escaped (flare_core.frontend), so a typed image placeholder is text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flare_core.api import TemplateOptionError
from flare_core.frontend.parsers import ParsedOutput
from flare_recipe_deepseek.dsml import DsmlV41ToolParser
from flare_recipe_deepseek.v4_encoder import (ASSISTANT, BOS, END_THINK, EOS, USER, V41, DeepSeekV41Encoder,
                                              V4EncoderError, render)

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v41-encoding"
VECTORS = json.loads((FIXTURES / "dsv41-vectors.json").read_text(encoding="utf-8"))["vectors"]
PARSE_VECTORS = json.loads((FIXTURES / "dsv41-parse-vectors.json").read_text(encoding="utf-8"))["vectors"]

NOT_CARRIED = {
    "chat_images": "image content parts: refused by the server (text-only cores)",
    "thinking_image_in_tool_result": "image content parts: refused by the server",
    "error_image_placeholder_in_text": "a typed placeholder arrives escaped: it is text, not the image token",
    "error_image_placeholder_in_reasoning": "a typed placeholder arrives escaped",
    "chat_unsupported_block": "non-text content parts: refused by the server",
    "chat_no_bos": "every Flare prompt starts with BOS (the encoder's add_default_bos_token=False)",
    "error_thinking_mode_invalid": "thinking is a boolean option here (test_the_encoders_options)",
}
CARRIED = [vector for vector in VECTORS if vector["name"] not in NOT_CARRIED]


def _render(vector: dict):
    arguments = vector["arguments"]
    context = arguments.get("context") or []
    return render(context + vector["messages"], thinking=arguments["thinking_mode"] == "thinking",
                  reasoning_effort=arguments.get("reasoning_effort"),
                  drop_reasoning=arguments.get("drop_thinking", True), dialect=V41)


def test_every_vector_is_either_carried_or_listed():
    assert set(NOT_CARRIED) <= {vector["name"] for vector in VECTORS}
    assert len(CARRIED) == 53


@pytest.mark.parametrize("vector", [v for v in CARRIED if "output" in v], ids=lambda v: v["name"])
def test_rendered_byte_for_byte(vector):
    rendered = _render(vector)
    if vector["arguments"].get("context"):
        # The reference renders only the new messages after a context; Flare renders the whole
        # conversation, whose end is those messages.
        assert rendered.text.endswith(vector["output"]) and rendered.text.startswith(BOS)
    else:
        assert rendered.text == vector["output"]
    assert (rendered.marks or (len(BOS.encode("utf-8")),))[-1] == len(rendered.text.encode("utf-8"))


@pytest.mark.parametrize("vector", [v for v in CARRIED if "error" in v], ids=lambda v: v["name"])
def test_refused_where_the_reference_refuses(vector):
    with pytest.raises(V4EncoderError):
        _render(vector)


def test_marks_are_the_prefix_a_following_turn_shares():
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn = render(first, thinking=False, dialect=V41)
    following = render([*first, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
                       thinking=False, dialect=V41)
    assert turn.text == f"{BOS}<｜System｜>Be brief.{USER}Hi{ASSISTANT}{END_THINK}"
    assert following.text == turn.text + f"Hello!{EOS}{USER}Bye{ASSISTANT}{END_THINK}"
    assert set(turn.marks) <= set(following.marks)


def test_the_encoders_options():
    """The `deepseek-v41` encoder as a core runs it: options thinking (a boolean) and reasoning_effort
    (1-100 or low / high / xhigh / max), each refused by name when invalid (the server names the
    request field the value came from)."""
    encoder, messages = DeepSeekV41Encoder(), [{"role": "user", "content": "Hi"}]
    assert "Reasoning Effort: 37 " in encoder.render(messages, reasoning_effort=37, add_generation_prompt=True).text
    assert "Reasoning Effort: 75 " in encoder.render(messages, reasoning_effort="xhigh").text
    assert "Reasoning Effort" not in encoder.render(messages, thinking=False, reasoning_effort="max").text
    assert encoder.render(messages, reasoning_effort=None).text == encoder.render(messages).text  # high
    for effort in (0, 101, True, 50.0, "medium", "50"):
        with pytest.raises(TemplateOptionError, match="reasoning_effort must be an integer from 1") as error:
            encoder.render(messages, reasoning_effort=effort)
        assert error.value.option == "reasoning_effort"
    with pytest.raises(TemplateOptionError, match="thinking must be true or false"):
        encoder.render(messages, thinking="auto")


def _parse(text: str, pieces: int) -> ParsedOutput:
    parser, output = DsmlV41ToolParser(), ParsedOutput()
    for start in range(0, len(text), pieces):
        output.add(parser.feed(text[start:start + pieces]))
    output.add(parser.finish())
    return output


@pytest.mark.parametrize("vector", [v for v in PARSE_VECTORS if "parsed" in v], ids=lambda v: v["name"])
def test_v41_tool_calls_stream_as_the_reference_parses_them(vector):
    """The reference's completion parser's results, streamed in deltas of any size. (Its four
    rejections are of whole completions, which a streaming parser cannot wait for: a missing EOS
    is a length finish here, and malformed calls stay readable as content.)"""
    text = vector["text"].removesuffix(EOS)  # EOS is the stop token: the parser never sees it
    if vector["thinking_mode"] == "thinking":  # reasoning is the `think` parser's; tools read what follows
        text = text[text.index(END_THINK) + len(END_THINK):]
    parsed = vector["parsed"]
    for pieces in (1, 3, 7, len(text)):
        output = _parse(text, pieces)
        assert output.content == parsed["content"]
        assert [(call.name, call.arguments) for call in output.tool_calls] == [
            (call["function"]["name"], call["function"]["arguments"]) for call in parsed["tool_calls"]]


def test_calls_the_encoder_renders_read_back():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"q": "x y", "n": [1, 2]}}}]
    rendered = render([{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": calls}],
                      thinking=False, dialect=V41)
    answer = rendered.text[rendered.text.rindex(END_THINK) + len(END_THINK):].removesuffix(EOS)
    output = _parse(answer, 5)
    assert [(call.name, json.loads(call.arguments)) for call in output.tool_calls] == [("f", {"q": "x y", "n": [1, 2]})]
