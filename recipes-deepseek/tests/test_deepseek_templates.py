"""The DeepSeek template patches: they fit the published templates, keep the rendered text
(byte-equal to Transformers' apply_chat_template), and their marks end complete messages."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from flare_core.contract.template_patch import MARK_TAG
from flare_core.frontend import ChatTemplate, Tokenizer, apply_template_patch, mark_token_endpoints, strip_marks
from flare_recipe_deepseek.templates import (
    DEEPSEEK_TEMPLATE_PATCHES,
    DEEPSEEK_V3_1_TEMPLATE_PATCH,
    DEEPSEEK_V3_TEMPLATE_PATCH,
)
from flare_testing.text import SHORT_CHAT

ASSETS = resources.files("flare_recipe_deepseek") / "assets"
CORE_FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
V3, V3_1 = DEEPSEEK_V3_TEMPLATE_PATCH.id, DEEPSEEK_V3_1_TEMPLATE_PATCH.id
SOURCES = {
    V3: (ASSETS / "deepseek-v3.jinja").read_bytes().decode("utf-8"),
    V3_1: (ASSETS / "deepseek-v3.1.jinja").read_bytes().decode("utf-8"),
}
PATCHES = {patch.id: patch for patch in DEEPSEEK_TEMPLATE_PATCHES}
BOS = "<｜begin▁of▁sentence｜>"
# The tokens DeepSeek's tokenizer adds on top of its BPE that these templates write.
DEEPSEEK_TOKENS = [
    BOS, "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜tool▁sep｜>",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The Qwen3 BPE with DeepSeek's control tokens added: DeepSeek's own tokenizer.json is not in the
    fixtures (over 4 MiB), and only the control tokens decide where a message boundary can be cut."""
    tokenizer = AutoTokenizer.from_pretrained(str(CORE_FIXTURES / "tokenizers" / "qwen3"), local_files_only=True)
    tokenizer.add_tokens(DEEPSEEK_TOKENS, special_tokens=True)
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer) -> Tokenizer:
    return Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())


@pytest.fixture(scope="module")
def templates() -> dict[str, tuple[ChatTemplate, ChatTemplate]]:
    """Per patch id: (the published template, the patched one)."""
    return {
        patch_id: (ChatTemplate(source), ChatTemplate(apply_template_patch(source, PATCHES[patch_id])))
        for patch_id, source in SOURCES.items()
    }


def call(name: str, arguments: str) -> dict:
    # Both templates concatenate `arguments`, so it must be the JSON text OpenAI clients send.
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CONVERSATIONS = {
    "chat": SHORT_CHAT,
    "two_system_messages_no_reply": [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Answer in English."},
        {"role": "user", "content": "中文?"},
    ],
    "reasoning_in_content": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nAdd.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "tool_loop": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "",
         "tool_calls": [call("get_weather", '{"city": "Oslo"}'), call("get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "content": "-2"},
        {"role": "tool", "content": "18"},
        {"role": "assistant", "content": "-2 °C and 18 °C."},
        {"role": "user", "content": "Thanks"},
    ],
    "ends_with_tool_results": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("get_weather", '{"city": "Oslo"}')]},
        {"role": "tool", "content": '{"temp": -2}'},
    ],
}


@pytest.mark.parametrize("patch_id", sorted(SOURCES))
@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_render_matches_transformers(hf_tokenizer, templates, patch_id, conversation_name):
    published, patched = templates[patch_id]
    hf_tokenizer.chat_template = SOURCES[patch_id]
    messages = CONVERSATIONS[conversation_name]
    for tools in (TOOLS, None):
        for add_generation_prompt in (True, False):
            for thinking in ({}, {"thinking": True}, {"thinking": False}):
                kwargs = dict(tools=tools, add_generation_prompt=add_generation_prompt, bos_token=BOS, **thinking)
                expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
                assert published.render(messages, **kwargs).text == expected
                assert patched.render(messages, **kwargs).text == expected


def test_patches_fit_the_published_templates_exactly():
    assert [patch.id for patch in DEEPSEEK_TEMPLATE_PATCHES] == ["deepseek-v3-v1", "deepseek-v3.1-v1"]
    for patch_id, source in SOURCES.items():
        fixture = CORE_FIXTURES / "chat_templates" / f"deepseek-ai-DeepSeek-{'V3' if patch_id == V3 else 'V3.1'}.jinja"
        assert source.encode("utf-8") == fixture.read_bytes()
        annotated = apply_template_patch(source, PATCHES[patch_id])
        assert annotated.count(MARK_TAG) == len(PATCHES[patch_id].insertions)
        assert strip_marks(annotated).encode("utf-8") == source.encode("utf-8")


def test_v3_1_thinking_switch_opens_or_closes_the_reasoning_block(templates):
    _, patched = templates[V3_1]
    messages = CONVERSATIONS["chat"]
    assert patched.render(messages, add_generation_prompt=True, bos_token=BOS, thinking=True).text.endswith(
        "<｜User｜>Bye<｜Assistant｜><think>")
    for off in ({}, {"thinking": False}):
        assert patched.render(messages, add_generation_prompt=True, bos_token=BOS, **off).text.endswith(
            "<｜User｜>Bye<｜Assistant｜></think>")


def expected_prefix(template: ChatTemplate, messages: list[dict], count: int) -> str:
    """The text of the first `count` messages as they stand in a longer conversation: V3 closes a
    final run of tool results with <｜tool▁outputs▁end｜>, which belongs to what follows them."""
    text = template.render(messages[:count], bos_token=BOS).text
    if count and messages[count - 1]["role"] == "tool":
        text = text.removesuffix("<｜tool▁outputs▁end｜>")
    return text


@pytest.mark.parametrize("patch_id", sorted(SOURCES))
@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_marks_end_complete_messages(tokenizer, templates, patch_id, conversation_name):
    published, patched = templates[patch_id]
    messages = CONVERSATIONS[conversation_name]
    leading_system = next(i for i, message in enumerate(messages) if message["role"] != "system")
    # The system prompt (or just BOS), then every other message.
    counts = [leading_system] + [i + 1 for i in range(leading_system, len(messages))]
    for add_generation_prompt in (True, False):
        for thinking in (True, False):
            rendered = patched.render(messages, add_generation_prompt=add_generation_prompt, bos_token=BOS,
                                      thinking=thinking)
            endpoints = mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
            assert len(endpoints) == len(rendered.marks) == len(counts)  # every mark is a clean token boundary
            prefixes = [expected_prefix(published, messages, count) for count in counts]
            assert all(rendered.text.startswith(prefix) for prefix in prefixes)
            assert endpoints == tuple(len(tokenizer.encode(prefix)) for prefix in prefixes)


@pytest.mark.parametrize("patch_id", sorted(SOURCES))
def test_marks_survive_the_next_turns(tokenizer, templates, patch_id):
    """Each request extends the previous conversation (a tool loop, then a new question): every mark of
    request N is a token prefix of request N+1 — with thinking on, the generation prompt differs but
    the marks do not include it."""
    _, patched = templates[patch_id]
    conversation = CONVERSATIONS["tool_loop"]
    requests = [conversation[:2], conversation[:5], conversation[:7]]
    for thinking in (True, False):
        previous = None
        for messages in requests:
            rendered = patched.render(messages, add_generation_prompt=True, bos_token=BOS, thinking=thinking)
            ids = tokenizer.encode(rendered.text)
            if previous is not None:
                previous_ids, previous_endpoints = previous
                assert all(ids[:end] == previous_ids[:end] for end in previous_endpoints)
            previous = ids, mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
        assert len(previous[1]) == 7
