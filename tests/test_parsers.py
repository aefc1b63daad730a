"""Streaming reasoning / tool-call parsers: split-independence, withheld tags, fallbacks, and
real Qwen3 outputs streamed token by token through the real tokenizer and detokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flare_core.frontend.parsers import (
    HermesToolParser,
    OutputParser,
    ParsedDelta,
    ParsedOutput,
    ThinkParser,
    ToolCallDelta,
    prompt_opens_reasoning,
)
from flare_core.frontend.template import ChatTemplate
from flare_core.frontend.tokenizer import Tokenizer
from flare_core.plugins.registry import load_registry
from flare_testing.text import parse_token_ids

FIXTURES = Path(__file__).parent / "fixtures"


def parse(parser, deltas: list[str]) -> tuple[ParsedOutput, list[ParsedDelta]]:
    out, pieces = ParsedOutput(), []
    for delta in deltas:
        pieces.append(parser.feed(delta))
        out.add(pieces[-1])
    pieces.append(parser.finish())
    out.add(pieces[-1])
    return out, pieces


def random_splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def summary(out: ParsedOutput) -> tuple:
    """What must not depend on how the text was split (ids are random per call)."""
    return out.content, out.reasoning, [(call.name, call.arguments) for call in out.tool_calls]


def assert_split_independent(make_parser, text: str, expected: tuple, seed: int = 0) -> None:
    whole, _ = parse(make_parser(), [text])
    assert summary(whole) == expected
    assert summary(parse(make_parser(), list(text))[0]) == expected
    rng = random.Random(seed)
    for _ in range(10):
        assert summary(parse(make_parser(), random_splits(text, rng))[0]) == expected


# ---------------------------------------------------------------- think


@pytest.mark.parametrize("text, starts_in_reasoning, content, reasoning", [
    ("<think>\nLet me think.\n\nStep two.\n</think>\n\nThe answer is 4.", False,
     "The answer is 4.", "Let me think.\n\nStep two."),
    ("Okay, so 2+2.\n</think>\n\nIt is 4.", True, "It is 4.", "Okay, so 2+2."),
    ("<think>\nx\n</think>\ny", True, "y", "x"),  # a template-opened block re-opened by the model
    ("<think>\nthoughts cut off by max_tokens\n", False, "", "thoughts cut off by max_tokens"),
    ("still thinking when it ended", True, "", "still thinking when it ended"),
    ("<think>\n\n</think>\n\nHi there.", False, "Hi there.", ""),
    ("No reasoning here.\n\nTwo paragraphs.\n", False, "No reasoning here.\n\nTwo paragraphs.\n", ""),
    ("Reasoning\n</think>\n\nAnswer", False, "Reasoning\n</think>\n\nAnswer", ""),  # no block was opened
    ("  <think>a\n\nb</think>after <think>not again</think>", False, "after <think>not again</think>", "a\n\nb"),
    ("<think>\nends with a partial tag </thi", False, "", "ends with a partial tag </thi"),
    ("<thin", False, "<thin", ""),
])
def test_think_parser_is_split_independent(text: str, starts_in_reasoning: bool, content: str, reasoning: str) -> None:
    assert_split_independent(lambda: ThinkParser(starts_in_reasoning=starts_in_reasoning), text,
                             (content, reasoning, []))


def test_think_parser_withholds_partial_tags_and_newlines_before_them() -> None:
    parser = ThinkParser()
    assert parser.feed("<th") == ParsedDelta()
    assert parser.feed("ink>\n") == ParsedDelta()
    assert parser.feed("step one\n") == ParsedDelta(reasoning="step one")
    assert parser.feed("step two\n</th") == ParsedDelta(reasoning="\nstep two")
    assert parser.feed("ink>\n") == ParsedDelta()
    assert parser.feed("\nDone") == ParsedDelta(content="Done")
    assert parser.finish() == ParsedDelta()


def test_think_parser_releases_text_that_only_looked_like_a_tag() -> None:
    parser = ThinkParser()
    assert parser.feed("<thi") == ParsedDelta()
    assert parser.feed("s is content") == ParsedDelta(content="<this is content")
    parser = ThinkParser(starts_in_reasoning=True)
    assert parser.feed("a </thin") == ParsedDelta(reasoning="a ")
    assert parser.feed("g>") == ParsedDelta(reasoning="</thing>")


def test_think_whitespace_rule_matches_the_qwen3_template() -> None:
    """Qwen3's template re-renders a raw past answer by stripping newlines around the tags; our
    split must render to exactly the same prompt when passed back as reasoning_content + content."""
    template = ChatTemplate((FIXTURES / "chat_templates" / "Qwen-Qwen3.chat_template.jinja").read_text())
    outputs = ["<think>\nFirst.\n\nSecond.\n</think>\n\nAnswer.\n\nMore.",
               "<think>\n\n\nx\n\n</think>Tight answer",
               "<think>\n\n</think>\n\nNo thoughts."]
    for raw in outputs:
        parsed, _ = parse(ThinkParser(), [raw])
        user = {"role": "user", "content": "q"}
        from_raw = template.render([user, {"role": "assistant", "content": raw}]).text
        from_parsed = template.render([user, {"role": "assistant", "content": parsed.content,
                                              "reasoning_content": parsed.reasoning}]).text
        assert from_parsed == from_raw


def test_prompt_opens_reasoning_on_real_templates() -> None:
    user = [{"role": "user", "content": "hi"}]
    deepseek = ChatTemplate((FIXTURES / "chat_templates" / "deepseek-ai-DeepSeek-V3.1.jinja").read_text())
    assert prompt_opens_reasoning(deepseek.render(user, add_generation_prompt=True, thinking=True).text)
    assert not prompt_opens_reasoning(deepseek.render(user, add_generation_prompt=True, thinking=False).text)
    qwen = ChatTemplate((FIXTURES / "chat_templates" / "Qwen-Qwen3.chat_template.jinja").read_text())
    assert not prompt_opens_reasoning(qwen.render(user, add_generation_prompt=True, enable_thinking=False).text)
    assert not prompt_opens_reasoning(qwen.render(user, add_generation_prompt=True).text)


# ---------------------------------------------------------------- hermes

WEATHER = {"city": "Paris", "days": [1, 2.5e3, -0.5], "metric": True, "note": None,
           "text": "naïve \"quoted\" \\ back\nslash 日本 😀", "nested": {"a": {}, "b": []}}


def block(name: str, arguments: dict, separators=(", ", ": ")) -> str:
    call = {"name": name, "arguments": arguments}
    return "<tool_call>\n" + json.dumps(call, ensure_ascii=False, separators=separators) + "\n</tool_call>"


@pytest.mark.parametrize("text, expected", [
    (block("get_weather", WEATHER), ("", "", [("get_weather", WEATHER)])),
    ("Let me check that for you.\n" + block("get_weather", {"city": "Oslo"}),
     ("Let me check that for you.", "", [("get_weather", {"city": "Oslo"})])),
    (block("a", {"x": 1}) + "\n" + block("b", {}, separators=(",", ":")) + "\n" + block("c", {"y": [True]}),
     ("", "", [("a", {"x": 1}), ("b", {}), ("c", {"y": [True]})])),
    ("Before " + block("a", {"x": 1}) + "\n\nAfter the call.", ("BeforeAfter the call.", "", [("a", {"x": 1})])),
    ("No tools, just text with <tags> and a trailing space ", ("No tools, just text with <tags> and a trailing space ",
                                                               "", [])),
    ('<tool_call>\n{"name": "now"}\n</tool_call>', ("", "", [("now", {})])),
    ('<tool_call>\n{"arguments": {"q": "x"}, "name": "search"}\n</tool_call>', ("", "", [("search", {"q": "x"})])),
    ('<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>',
     ("", "", [("search", {"q": "x"})])),
    ('<tool_call>{"name": "f", "arguments": {"k": 2}}</tool_call>', ("", "", [("f", {"k": 2})])),
    ('<tool_call>\n{"name": "f", "arguments": {"k": 2}}\nthen text', ("then text", "", [("f", {"k": 2})])),
])
def test_hermes_parser_is_split_independent(text: str, expected: tuple) -> None:
    for make in (HermesToolParser, lambda: OutputParser(tool=HermesToolParser())):
        whole, _ = parse(make(), [text])
        decoded = (whole.content, whole.reasoning, [(c.name, json.loads(c.arguments)) for c in whole.tool_calls])
        assert decoded == expected
        assert_split_independent(make, text, summary(whole))


def test_tool_call_deltas_stream_name_first_then_argument_fragments() -> None:
    text = "Checking.\n" + block("get_weather", WEATHER) + "\n" + block("get_time", {"tz": "UTC"})
    _, pieces = parse(HermesToolParser(), list(text))
    deltas = [d for piece in pieces for d in piece.tool_calls]
    for index, (name, arguments) in enumerate([("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]):
        own = [d for d in deltas if d.index == index]
        # The parser writes no id (the model wrote none): the protocol adapter mints one.
        assert own[0].name == name and own[0].id is None
        assert all(d.id is None and d.name is None for d in own[1:])
        assert [d.done for d in own] == [False] * (len(own) - 1) + [True]
        fragments = "".join(d.arguments for d in own)
        assert json.loads(fragments) == arguments
        assert len([d for d in own if d.arguments]) > 10  # arguments really streamed in pieces


def test_tool_call_is_announced_as_soon_as_the_name_is_known() -> None:
    parser = HermesToolParser()
    assert parser.feed('<tool_call>\n{"name": "get_weath') == ParsedDelta()
    announced = parser.feed('er"')
    assert [(d.index, d.name, d.arguments, d.done) for d in announced.tool_calls] == [(0, "get_weather", "", False)]
    assert parser.feed(', "arguments": {"ci').tool_calls == (ToolCallDelta(0, arguments='{"ci'),)
    assert parser.feed('ty": 1}}').tool_calls == (ToolCallDelta(0, arguments='ty": 1}', done=True),)
    assert parser.feed("\n</tool_call>") == ParsedDelta()
    assert parser.finish() == ParsedDelta()


def test_partial_tool_call_tag_is_withheld() -> None:
    parser = HermesToolParser()
    assert parser.feed("Let me check <tool_") == ParsedDelta(content="Let me check")
    assert parser.feed("cal") == ParsedDelta()
    assert parser.feed("x> is not a tag") == ParsedDelta(content=" <tool_calx> is not a tag")
    assert parser.feed(" <tool_call") == ParsedDelta()
    assert parser.finish() == ParsedDelta(content=" <tool_call")


@pytest.mark.parametrize("text", [
    "Use <tool_call>\nnot json at all\n</tool_call> carefully.",
    '<tool_call>\n{"name": get_weather, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"name": 42, "arguments": {}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
    "<tool_call>\n{'name': 'single_quotes'}\n</tool_call>",
    'Text <tool_call>\n{"name": "cut',
])
def test_malformed_block_falls_back_to_verbatim_content(text: str) -> None:
    assert_split_independent(HermesToolParser, text, (text, "", []))


def test_json_failing_after_the_announcement_ends_the_call_and_keeps_the_rest_as_content() -> None:
    trailing_comma = '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>\nok'
    assert_split_independent(HermesToolParser, trailing_comma, ("}}ok", "", [("f", '{"a": 1,')]))
    missing_brace = 'Hi\n<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'
    assert_split_independent(HermesToolParser, missing_brace, ("Hi", "", [("f", '{"a": 1}')]))
    truncated = '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'
    assert_split_independent(HermesToolParser, truncated, ("", "", [("f", '{"a": [1, 2')]))
    truncated_before_arguments = '<tool_call>\n{"name": "f", "argu'
    assert_split_independent(HermesToolParser, truncated_before_arguments, ("", "", [("f", "{}")]))


# ---------------------------------------------------------------- chain and registration


def test_output_parser_routes_reasoning_and_tool_calls() -> None:
    text = ("<think>\nI could write <tool_call> here, it is only reasoning.\n</think>\n\n"
            "Sure.\n" + block("lookup", {"id": 7}))
    expected = ("Sure.", "I could write <tool_call> here, it is only reasoning.", [("lookup", '{"id": 7}')])
    assert_split_independent(lambda: OutputParser(ThinkParser(), HermesToolParser()), text, expected)
    only_reasoning = "<think>\nhmm\n</think>\n\nplain"
    assert_split_independent(lambda: OutputParser(reasoning=ThinkParser()), only_reasoning, ("plain", "hmm", []))
    assert_split_independent(OutputParser, only_reasoning, (only_reasoning, "", []))


def test_parsers_are_registered_through_the_builtin_hook() -> None:
    registry = load_registry(entry_points=False)
    think, hermes = registry.parsers["think"], registry.parsers["hermes"]
    assert (think.kind, hermes.kind) == ("reasoning", "tool")
    chain = OutputParser(think.factory(starts_in_reasoning=True), hermes.factory())
    out, _ = parse(chain, ["thinking\n</think>\n\n", block("f", {"a": 1})])
    assert summary(out) == ("", "thinking", [("f", '{"a": 1}')])


# ---------------------------------------------------------------- real Qwen3 tokenizer


def stream_tokens(tokenizer: Tokenizer, text: str, parser) -> tuple[ParsedOutput, list[int]]:
    """Encode a model output (+ <|im_end|>), then push it token by token through the detokenizer
    (special tokens skipped, as the server does) into the parser."""
    ids = tokenizer.encode(text) + [tokenizer.token_to_id("<|im_end|>")]
    return parse_token_ids(parser, tokenizer, ids, skip_special_tokens=True), ids


def test_real_qwen3_thinking_tool_call_token_by_token(qwen3_tokenizer: Tokenizer) -> None:
    arguments = {"location": "Zürich", "unit": "celsius", "days": 3}
    text = ("<think>\nThe user asks about the weather in Zürich 🌦. I should call get_weather.\n</think>\n\n"
            "I'll look that up.\n" + block("get_weather", arguments) + "\n"
            + block("get_time", {"timezone": "Europe/Zurich"}))
    out, ids = stream_tokens(qwen3_tokenizer, text, OutputParser(ThinkParser(), HermesToolParser()))
    for tag in ("<think>", "</think>", "<tool_call>", "</tool_call>"):
        assert qwen3_tokenizer.token_to_id(tag) in ids  # the tags arrive as single tokens
    assert out.reasoning == "The user asks about the weather in Zürich 🌦. I should call get_weather."
    assert out.content == "I'll look that up."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", arguments), ("get_time", {"timezone": "Europe/Zurich"})]


def test_real_qwen3_non_thinking_and_opened_reasoning(qwen3_tokenizer: Tokenizer) -> None:
    answer = "<think>\n\n</think>\n\nBonjour ! Voilà la réponse : 42 😀\n\nEt c'est tout."
    out, _ = stream_tokens(qwen3_tokenizer, answer, OutputParser(ThinkParser(), HermesToolParser()))
    assert summary(out) == ("Bonjour ! Voilà la réponse : 42 😀\n\nEt c'est tout.", "", [])
    opened = "Let me reason: 6 × 7 = 42.\n</think>\n\nThe answer is 42."
    out, _ = stream_tokens(qwen3_tokenizer, opened, OutputParser(ThinkParser(starts_in_reasoning=True)))
    assert summary(out) == ("The answer is 42.", "Let me reason: 6 × 7 = 42.", [])
