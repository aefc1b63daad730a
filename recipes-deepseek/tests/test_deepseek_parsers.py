"""DeepSeek V3 / V3.1 tool-call parsing (and V3.1 reasoning through `think`): split-independence,
what the templates render back, malformed output, and real token-by-token streaming."""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import pytest
import tokenizers

from flare_core.frontend import ChatTemplate, Tokenizer, build_tokenizer_json
from flare_core.frontend.parsers import OutputParser, ParsedOutput, ThinkParser, prompt_opens_reasoning
from flare_testing.text import parse_token_ids
from flare_recipe_deepseek.dsml import DsmlToolParser
from flare_recipe_deepseek.parsers import DEEPSEEK_PARSERS, DeepSeekV3ToolParser, DeepSeekV31ToolParser

ASSETS = resources.files("flare_recipe_deepseek") / "assets"
CORE_FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


def v3_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v3_1_call(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


def parse(parser, deltas: list[str]) -> ParsedOutput:
    out = ParsedOutput()
    for delta in deltas:
        out.add(parser.feed(delta))
    out.add(parser.finish())
    return out


def summary(out: ParsedOutput) -> tuple:
    return out.content, out.reasoning, [(call.name, call.arguments) for call in out.tool_calls]


def assert_split_independent(make_parser, text: str, expected: tuple) -> None:
    """Whole, character by character and in random pieces, the result is the same."""
    assert summary(parse(make_parser(), [text])) == expected
    assert summary(parse(make_parser(), list(text))) == expected
    rng = random.Random(0)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        assert summary(parse(make_parser(), [text[a:b] for a, b in zip(bounds, bounds[1:])])) == expected


OSLO, ROME = '{"city": "Oslo"}', '{"city": "Rome", "note": "a `tick` and\\n```fence```"}'
V3_CASES = [
    (CALLS_BEGIN + v3_call("get_weather", OSLO) + CALLS_END, ("", "", [("get_weather", OSLO)])),
    ("Let me check. \n" + CALLS_BEGIN + v3_call("get_weather", OSLO) + "\n" + v3_call("get_time", "{}")
     + CALLS_END + "\n\nDone.",  # whitespace next to a section is formatting
     ("Let me check.Done.", "", [("get_weather", OSLO), ("get_time", "{}")])),
    (CALLS_BEGIN + v3_call("get_weather", ROME) + CALLS_END, ("", "", [("get_weather", ROME)])),
    # Multi-line arguments keep their inner whitespace; an empty fence gives "{}".
    (CALLS_BEGIN + v3_call("f", '{\n  "a": [1, 2]\n}') + CALLS_END, ("", "", [("f", '{\n  "a": [1, 2]\n}')])),
    (CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n```json\n```{CALL_END}" + CALLS_END, ("", "", [("f", "{}")])),
    # Without the fence the arguments are taken as they are.
    (CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n{OSLO}{CALL_END}" + CALLS_END, ("", "", [("f", OSLO)])),
    ("No tools needed: ``` code ```\n", ("No tools needed: ``` code ```\n", "", [])),
]
V3_1_CASES = [
    (CALLS_BEGIN + v3_1_call("get_weather", OSLO) + CALLS_END, ("", "", [("get_weather", OSLO)])),
    ("Checking both.\n\n" + CALLS_BEGIN + v3_1_call("get_weather", OSLO) + v3_1_call("get_weather", ROME)
     + CALLS_END, ("Checking both.", "", [("get_weather", OSLO), ("get_weather", ROME)])),
    (CALLS_BEGIN + v3_1_call("get_time", "") + CALLS_END, ("", "", [("get_time", "{}")])),
    (CALLS_BEGIN + v3_1_call("f", ' {"a": 1}\n') + CALLS_END + " and after", ("and after", "", [("f", '{"a": 1}')])),
    ("Plain answer, <｜tool▁calls mentioned", ("Plain answer, <｜tool▁calls mentioned", "", [])),
    # Two sections: call indices continue.
    (CALLS_BEGIN + v3_1_call("a", "{}") + CALLS_END + "then" + CALLS_BEGIN + v3_1_call("b", "{}") + CALLS_END,
     ("then", "", [("a", "{}"), ("b", "{}")])),
]
MALFORMED_CASES = [
    # A section that does not start with a call stays as written.
    (CALLS_BEGIN + "I cannot call tools.", (CALLS_BEGIN + "I cannot call tools.", "", [])),
    ("Answer " + CALLS_BEGIN, ("Answer" + CALLS_BEGIN, "", [])),
    # A call without a name, or without its separator, is content up to its end marker.
    (CALLS_BEGIN + v3_1_call("", OSLO) + CALLS_END, (CALLS_BEGIN + v3_1_call("", OSLO), "", [])),
    (CALLS_BEGIN + f"{CALL_BEGIN}get_weather{CALL_END}" + v3_1_call("ok", "{}") + CALLS_END,
     (CALLS_BEGIN + f"{CALL_BEGIN}get_weather{CALL_END}", "", [("ok", "{}")])),
    # Text after the calls inside a section ends the section and is content.
    (CALLS_BEGIN + v3_1_call("ok", "{}") + "\nstray text", ("stray text", "", [("ok", "{}")])),
    # Output cut off inside the arguments (max_tokens): the call ends with what arrived.
    (CALLS_BEGIN + v3_1_call("ok", "{}") + CALL_BEGIN + "f" + SEP + '{"a": [1, ',
     ("", "", [("ok", "{}"), ("f", '{"a": [1,')])),
    # Cut off inside a header: nothing was announced, so it is content.
    (CALLS_BEGIN + CALL_BEGIN + "get_wea", (CALLS_BEGIN + CALL_BEGIN + "get_wea", "", [])),
]


@pytest.mark.parametrize("text, expected", V3_CASES)
def test_v3_parser_is_split_independent(text: str, expected: tuple) -> None:
    assert_split_independent(DeepSeekV3ToolParser, text, expected)


@pytest.mark.parametrize("text, expected", V3_1_CASES + MALFORMED_CASES)
def test_v3_1_parser_is_split_independent(text: str, expected: tuple) -> None:
    assert_split_independent(DeepSeekV31ToolParser, text, expected)


@pytest.mark.parametrize("parser_class", [DeepSeekV3ToolParser, DeepSeekV31ToolParser])
def test_random_marker_soup_is_split_independent(parser_class) -> None:
    """Arbitrary mixes of markers, their fragments, fences and text: however split, the same result."""
    pieces = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP, CALL_END[:4], SEP[:2], "function", "f",
              "\n", " ", "```", "```json\n", "`", '{"a": 1}', "{", "}", "x y", "é🌦"]
    rng = random.Random(1)
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        expected = summary(parse(parser_class(), [text]))
        assert_split_independent(parser_class, text, expected)


def test_v3_malformed_header_and_cut_off_fence() -> None:
    no_separator = CALLS_BEGIN + f"{CALL_BEGIN}get_weather\n```json\n{OSLO}\n```{CALL_END}" + CALLS_END
    assert_split_independent(DeepSeekV3ToolParser, no_separator,
                             (CALLS_BEGIN + f"{CALL_BEGIN}get_weather\n```json\n{OSLO}\n```{CALL_END}", "", []))
    cut_in_fence = CALLS_BEGIN + f"{CALL_BEGIN}function{SEP}f\n``"
    assert_split_independent(DeepSeekV3ToolParser, cut_in_fence, ("", "", [("f", "{}")]))


def test_call_is_announced_with_its_header_then_arguments_stream() -> None:
    parser = DeepSeekV31ToolParser()
    before = parser.feed("Sure." + CALLS_BEGIN + CALL_BEGIN + "get_wea")
    assert before.content == "Sure." and not before.tool_calls
    (first,) = parser.feed("ther" + SEP).tool_calls
    assert (first.index, first.name, first.arguments, first.done) == (0, "get_weather", "", False)
    assert first.id is None  # DeepSeek writes no call ids: the protocol adapter mints them
    pieces = [parser.feed(piece).tool_calls for piece in ('{"city": ', '"Oslo"}', CALL_END[:3], CALL_END[3:])]
    # Trailing whitespace waits for the next piece: it could be the formatting before the end marker.
    assert [piece[0].arguments for piece in pieces[:2]] == ['{"city":', ' "Oslo"}']
    assert pieces[2] == ()  # a partial end marker is withheld
    assert pieces[3][0].done and pieces[3][0].arguments == ""
    assert parser.feed(CALLS_END).tool_calls == () and not parser.finish()


def test_v3_fence_is_withheld_until_decided() -> None:
    parser = DeepSeekV3ToolParser()
    parser.feed(CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "f\n``")
    assert parser.feed("`json").tool_calls == ()
    assert parser.feed('\n{"a": 1}\n`').tool_calls[0].arguments == '{"a": 1}'
    assert parser.feed("``").tool_calls == ()
    assert parser.feed(CALL_END).tool_calls[0].done


def test_parsers_are_exposed_for_the_plugin_hook() -> None:
    assert [(parser.id, parser.kind) for parser in DEEPSEEK_PARSERS] == [
        ("deepseek-v3-tools", "tool"), ("deepseek-v3.1-tools", "tool"), ("deepseek-v4-tools", "tool"),
        ("deepseek-v4.1-tools", "tool")]
    assert DEEPSEEK_PARSERS[2].call_format is None and isinstance(DEEPSEEK_PARSERS[2].factory(), DsmlToolParser)
    assert DEEPSEEK_PARSERS[3].call_format is None and DEEPSEEK_PARSERS[3].factory().tags.block_begin == "<｜DSML｜ calls>"
    assert isinstance(DEEPSEEK_PARSERS[0].factory(), DeepSeekV3ToolParser)
    assert isinstance(DEEPSEEK_PARSERS[1].factory(), DeepSeekV31ToolParser)
    assert DeepSeekV31ToolParser.markers.tokens == (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    assert DeepSeekV3ToolParser.markers.tokens == (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)


# ---------------------------------------------------------------- what the templates render back


def template(name: str) -> ChatTemplate:
    return ChatTemplate((ASSETS / name).read_bytes().decode("utf-8"))


TOOL_CALL_TURN = [
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": "I'll check both.", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": OSLO}},
        {"type": "function", "function": {"name": "get_weather", "arguments": ROME}},
    ]},
]


@pytest.mark.parametrize("template_name, parser_class, opening", [
    ("deepseek-v3.jinja", DeepSeekV3ToolParser, "<｜Assistant｜>"),
    ("deepseek-v3.1.jinja", DeepSeekV31ToolParser, "<｜Assistant｜></think>"),
])
def test_parser_reads_back_the_calls_the_template_renders(template_name, parser_class, opening) -> None:
    """The assistant turn as the template renders it is what the model was trained to emit."""
    text = template(template_name).render(TOOL_CALL_TURN, bos_token=BOS).text
    emitted = text[text.index(opening) + len(opening):].removesuffix(EOS)
    assert_split_independent(parser_class, emitted,
                             ("I'll check both.", "", [("get_weather", OSLO), ("get_weather", ROME)]))


def test_v3_1_thinking_prompt_and_reasoning_then_tool_call() -> None:
    v3_1 = template("deepseek-v3.1.jinja")
    messages = TOOL_CALL_TURN[:1]
    thinking = v3_1.render(messages, bos_token=BOS, add_generation_prompt=True, thinking=True).text
    direct = v3_1.render(messages, bos_token=BOS, add_generation_prompt=True, thinking=False).text
    after_tool = v3_1.render(TOOL_CALL_TURN + [{"role": "tool", "content": "-2"}], bos_token=BOS,
                             add_generation_prompt=True, thinking=True).text
    assert prompt_opens_reasoning(thinking) and not prompt_opens_reasoning(direct)
    assert not prompt_opens_reasoning(after_tool)  # after tool results the template opens no reasoning
    output = ("The user wants two cities.\n</think>I'll check both." + CALLS_BEGIN
              + v3_1_call("get_weather", OSLO) + CALLS_END)
    assert_split_independent(
        lambda: OutputParser(ThinkParser(starts_in_reasoning=True), DeepSeekV31ToolParser()), output,
        ("I'll check both.", "The user wants two cities.", [("get_weather", OSLO)]))
    assert_split_independent(
        lambda: OutputParser(ThinkParser(starts_in_reasoning=False), DeepSeekV31ToolParser()), "Hi.",
        ("Hi.", "", []))


# ---------------------------------------------------------------- token by token


MARKERS = [CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP]


@pytest.fixture(scope="module")
def qwen3_bpe() -> str:
    return build_tokenizer_json(CORE_FIXTURES / "tokenizers" / "qwen3")


def with_markers(bpe_json: str, special: bool) -> Tokenizer:
    """The Qwen3 BPE plus DeepSeek's markers and EOS, the markers flagged special or not."""
    backend = tokenizers.Tokenizer.from_str(bpe_json)
    backend.add_tokens([tokenizers.AddedToken(marker, special=special, normalized=False) for marker in MARKERS])
    backend.add_special_tokens([EOS])
    return Tokenizer(backend)


def stream(tokenizer: Tokenizer, text: str, skip_special_tokens: bool) -> ParsedOutput:
    return parse_token_ids(DeepSeekV31ToolParser(), tokenizer, tokenizer.encode(text), skip_special_tokens)


def test_real_tokens_streamed_one_by_one(qwen3_bpe: str) -> None:
    arguments = {"city": "Zürich", "note": "🌦 «heute»"}
    text = ("Ich schaue nach. " + CALLS_BEGIN + v3_1_call("get_weather", json.dumps(arguments, ensure_ascii=False))
            + v3_1_call("get_time", '{"tz": "Europe/Zurich"}') + CALLS_END)
    expected = ("Ich schaue nach.", "",
                [("get_weather", json.dumps(arguments, ensure_ascii=False)), ("get_time", '{"tz": "Europe/Zurich"}')])
    plain = with_markers(qwen3_bpe, special=False)
    assert all(plain.token_to_id(marker) in plain.encode(text) for marker in MARKERS)
    # Markers not flagged special survive skip_special_tokens=True, the server's default.
    assert summary(stream(plain, text, skip_special_tokens=True)) == expected
    # Flagged special, they need skip_special_tokens=False (and are lost otherwise).
    flagged = with_markers(qwen3_bpe, special=True)
    assert set(MARKERS) <= set(flagged.special_tokens)
    assert summary(stream(flagged, text, skip_special_tokens=False)) == expected
    assert stream(flagged, text, skip_special_tokens=True).tool_calls == []
