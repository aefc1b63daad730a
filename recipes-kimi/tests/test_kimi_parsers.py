"""Kimi K2 tool-call parsing: split-independence, the model's own call ids, what the template
renders back, malformed output, and real token-by-token streaming."""

from __future__ import annotations

import json
import random
from importlib import resources
from pathlib import Path

import pytest
import tokenizers

from flare_core.frontend import ChatTemplate, Tokenizer, build_tokenizer_json
from flare_core.frontend.parsers import ParsedOutput
from flare_testing.text import parse_token_ids
from flare_recipe_kimi.parsers import KIMI_PARSERS, KimiK2ToolParser

CORE_FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
MARKERS = [SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENTS_BEGIN, CALL_END]
OSLO, ROME = '{"city": "Oslo"}', '{"city": "Rome", "when": "<|tool_call_end| is not a marker>"}'


def call(header: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{header}{ARGUMENTS_BEGIN}{arguments}{CALL_END}"


def parse(deltas: list[str]) -> ParsedOutput:
    parser, out = KimiK2ToolParser(), ParsedOutput()
    for delta in deltas:
        out.add(parser.feed(delta))
    out.add(parser.finish())
    return out


def summary(out: ParsedOutput) -> tuple:
    return out.content, [(c.id or "generated", c.name, c.arguments) for c in out.tool_calls]


def assert_split_independent(text: str, expected: tuple) -> None:
    assert summary(parse([text])) == expected
    assert summary(parse(list(text))) == expected
    rng = random.Random(0)
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        bounds = [0, *cuts, len(text)]
        assert summary(parse([text[a:b] for a, b in zip(bounds, bounds[1:])])) == expected


CASES = [
    (SECTION_BEGIN + call("functions.get_weather:0", OSLO) + SECTION_END,
     ("", [("functions.get_weather:0", "get_weather", OSLO)])),
    ("Checking both. " + SECTION_BEGIN + call("functions.get_weather:0", OSLO) + "\n"
     + call(" functions.get_weather:1 ", " " + ROME + "\n") + SECTION_END + "\nOne moment.",
     ("Checking both.One moment.", [("functions.get_weather:0", "get_weather", OSLO),
                                    ("functions.get_weather:1", "get_weather", ROME)])),
    # A header without the functions.NAME:INDEX form still names the function; the id is generated.
    (SECTION_BEGIN + call("get_time", "") + SECTION_END, ("", [("generated", "get_time", "{}")])),
    ("No tools: <|tool_calls_section", ("No tools: <|tool_calls_section", [])),
    # Malformed: no call in the section, a header that is not a name, output cut off in the arguments.
    (SECTION_BEGIN + "plain words", (SECTION_BEGIN + "plain words", [])),
    (SECTION_BEGIN + call("functions.bad name:0", OSLO) + call("functions.ok:1", "{}") + SECTION_END,
     (SECTION_BEGIN + call("functions.bad name:0", OSLO), [("functions.ok:1", "ok", "{}")])),
    (SECTION_BEGIN + CALL_BEGIN + "functions.f:0" + ARGUMENTS_BEGIN + '{"a": "cut',
     ("", [("functions.f:0", "f", '{"a": "cut')])),
]


@pytest.mark.parametrize("text, expected", CASES)
def test_parser_is_split_independent(text: str, expected: tuple) -> None:
    assert_split_independent(text, expected)


def test_random_marker_soup_is_split_independent() -> None:
    pieces = [*MARKERS, CALL_END[:5], ARGUMENTS_BEGIN[:7], "functions.f:0", "f", "\n", " ", '{"a": 1}', "x", "é🌦"]
    rng = random.Random(1)
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        assert_split_independent(text, summary(parse([text])))


def test_call_is_announced_with_the_models_id_then_arguments_stream() -> None:
    parser = KimiK2ToolParser()
    assert parser.feed(SECTION_BEGIN + CALL_BEGIN + "functions.get_weather:3").tool_calls == ()
    (first,) = parser.feed(ARGUMENTS_BEGIN + '{"city":').tool_calls  # announcement and first piece, merged
    assert (first.index, first.id, first.name, first.arguments) == (
        0, "functions.get_weather:3", "get_weather", '{"city":')
    (arguments,) = parser.feed(' "Oslo"}' + CALL_END[:-1]).tool_calls
    assert arguments.arguments == ' "Oslo"}' and not arguments.done
    (done,) = parser.feed(CALL_END[-1] + SECTION_END).tool_calls
    assert done.done and done.arguments == ""


def test_parser_is_exposed_for_the_plugin_hook() -> None:
    assert [(parser.id, parser.kind) for parser in KIMI_PARSERS] == [("kimi-k2-tools", "tool")]
    assert isinstance(KIMI_PARSERS[0].factory(), KimiK2ToolParser)
    assert KimiK2ToolParser.markers.tokens == (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, ARGUMENTS_BEGIN)


def test_parser_reads_back_the_calls_the_template_renders() -> None:
    """The assistant turn as the template renders it is what the model was trained to emit."""
    source = (resources.files("flare_recipe_kimi") / "assets" / "kimi-k2.jinja").read_bytes().decode("utf-8")
    messages = [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": json.loads(OSLO)}},
            {"type": "function", "function": {"name": "get_weather", "arguments": json.loads(ROME)}},
        ]},
    ]
    text = ChatTemplate(source).render(messages).text
    opening = "<|im_assistant|>assistant<|im_middle|>"
    emitted = text[text.index(opening) + len(opening):].removesuffix("<|im_end|>")
    assert_split_independent(emitted, ("Checking.", [("functions.get_weather:0", "get_weather", OSLO),
                                                     ("functions.get_weather:1", "get_weather", ROME)]))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The Qwen3 BPE plus Kimi's markers (flagged special, which `skip_special_tokens=False` keeps)."""
    backend = tokenizers.Tokenizer.from_str(build_tokenizer_json(CORE_FIXTURES / "tokenizers" / "qwen3"))
    backend.add_special_tokens([tokenizers.AddedToken(marker, special=True, normalized=False) for marker in MARKERS])
    return Tokenizer(backend)


def test_real_tokens_streamed_one_by_one(tokenizer: Tokenizer) -> None:
    arguments = json.dumps({"city": "Zürich", "note": "🌦 «heute»"}, ensure_ascii=False)
    text = "Ich schaue nach." + SECTION_BEGIN + call("functions.get_weather:0", arguments) + SECTION_END
    ids = tokenizer.encode(text)
    assert all(tokenizer.token_to_id(marker) in ids for marker in MARKERS)
    out = parse_token_ids(KimiK2ToolParser(), tokenizer, ids, skip_special_tokens=False)
    assert summary(out) == ("Ich schaue nach.", [("functions.get_weather:0", "get_weather", arguments)])
