"""DeepSeek V4's prompt encoder (flare_recipe_deepseek.v4_encoder) against DeepSeek's own encoder.

* The four test vectors DeepSeek ships beside `encoding/encoding_dsv4.py` (tests/fixtures/
  deepseek-v4-encoding/test_input_N.json -> test_output_N.txt: tool calls in thinking mode,
  reasoning dropped from earlier turns, latest_reminder + developer search turns, a quick
  instruction task in chat mode), rendered byte for byte.
* Ten conversations in the shapes Flare's server hands over (request-level tools, tool messages
  answered out of call order, arguments as objects and as strings, chat and thinking mode,
  reasoning effort, non-ASCII text): the text and the byte offset after each message that
  DeepSeek's encoder produced for them (flare_cases.json; SOURCES.md says how).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flare_recipe_deepseek.v4_encoder import (ASSISTANT, BOS, END_THINK, EOS, THINK, USER, V4EncoderError,
                                              render)

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v4-encoding"
CASES = json.loads((FIXTURES / "flare_cases.json").read_text(encoding="utf-8"))["cases"]


def _vector(number: int) -> tuple[list[dict], list[dict] | None, str]:
    data = json.loads((FIXTURES / f"test_input_{number}.json").read_text(encoding="utf-8"))
    messages, tools = (data["messages"], data["tools"]) if isinstance(data, dict) else (data, None)
    return messages, tools, (FIXTURES / f"test_output_{number}.txt").read_text(encoding="utf-8")


@pytest.mark.parametrize("number,thinking", [(1, True), (2, True), (3, True), (4, False)])
def test_deepseek_test_vectors(number, thinking):
    messages, tools, expected = _vector(number)
    # DeepSeek's test attaches the tools to the first (system) message; `tools=` does the same.
    rendered = render(messages, tools=tools, thinking=thinking)
    assert rendered.text == expected


@pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])
def test_flare_shaped_conversations_match_deepseeks_encoder(case):
    rendered = render(case["messages"], tools=case.get("tools"), **case["kwargs"])
    assert rendered.text == case["expected"]
    assert list(rendered.marks) == case["marks"]
    assert rendered.marks[-1] == len(rendered.text.encode("utf-8"))


def test_marks_are_the_prefix_a_following_turn_shares():
    """In chat mode every earlier turn renders the same in the next request, so the next
    request's marks include all of this one's (the prefix cache resumes at them)."""
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn = render(first, thinking=False)
    following = render([*first, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
                       thinking=False)
    assert following.text.startswith(turn.text) and set(turn.marks) <= set(following.marks)
    assert turn.text == f"{BOS}Be brief.{USER}Hi{ASSISTANT}{END_THINK}"
    assert following.text == turn.text + f"Hello!{EOS}{USER}Bye{ASSISTANT}{END_THINK}"


def test_thinking_mode_reopens_reasoning_only_for_the_last_turn():
    rendered = render([{"role": "user", "content": "a"},
                       {"role": "assistant", "reasoning_content": "r1", "content": "b"},
                       {"role": "user", "content": "c"}])
    assert rendered.text == f"{BOS}{USER}a{ASSISTANT}{END_THINK}b{EOS}{USER}c{ASSISTANT}{THINK}"
    assert "r1" not in rendered.text


def test_without_a_generation_prompt_the_final_user_message_stays_open():
    rendered = render([{"role": "user", "content": "a"}], add_generation_prompt=False)
    assert rendered.text == f"{BOS}{USER}a"


@pytest.mark.parametrize("messages,kwargs,message", [
    ([{"role": "user", "content": "a"}], {"reasoning_effort": "extreme"}, "reasoning_effort must be one of"),
    ([{"role": "narrator", "content": "a"}], {}, r"messages\[0\]: DeepSeek V4 has no role 'narrator'"),
    ([{"role": "developer", "content": ""}], {}, r"messages\[0\]: a developer message needs content"),
    ([{"role": "user", "content": "a", "task": "poem"}], {}, r"messages\[0\]\.task must be one of action, query"),
])
def test_what_the_format_cannot_express_is_refused(messages, kwargs, message):
    with pytest.raises(V4EncoderError, match=message):
        render(messages, **kwargs)
