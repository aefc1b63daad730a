"""The Kimi K2 template patch: it fits the published (CRLF) template, keeps the rendered text
(byte-equal to Transformers' apply_chat_template), and its marks end complete messages."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from flare_core.contract.template_patch import MARK_TAG
from flare_core.frontend import ChatTemplate, Tokenizer, apply_template_patch, mark_token_endpoints, strip_marks
from flare_recipe_kimi.templates import KIMI_K2_TEMPLATE_PATCH, KIMI_TEMPLATE_PATCHES
from flare_testing.text import SHORT_CHAT

SOURCE = (resources.files("flare_recipe_kimi") / "assets" / "kimi-k2.jinja").read_bytes().decode("utf-8")
CORE_FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
# The control tokens of Kimi K2's tokenizer that this template writes.
KIMI_TOKENS = [
    "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
    "<|media_start|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
]
DEFAULT_SYSTEM = "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The Qwen3 BPE with Kimi's control tokens added: Kimi's own tiktoken.model is not in the
    fixtures, and only the control tokens decide where a message boundary can be cut."""
    tokenizer = AutoTokenizer.from_pretrained(str(CORE_FIXTURES / "tokenizers" / "qwen3"), local_files_only=True)
    tokenizer.add_tokens(KIMI_TOKENS, special_tokens=True)
    tokenizer.chat_template = SOURCE
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(hf_tokenizer) -> Tokenizer:
    return Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())


PUBLISHED = ChatTemplate(SOURCE)
PATCHED = ChatTemplate(apply_template_patch(SOURCE, KIMI_K2_TEMPLATE_PATCH))
TOOLS = [{
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather «here» & <now>",
                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}]


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


CONVERSATIONS = {
    "chat": SHORT_CHAT,
    "no_system_text_parts": [
        {"role": "user", "content": [{"type": "text", "text": "中文?"}, {"type": "text", "text": " 好"}]},
        {"role": "assistant", "content": "是的。"},
        {"role": "user", "content": "OK"},
    ],
    "tool_loop": [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [call("get_weather", {"city": "Oslo"}), call("get_weather", '{"city": "Rome"}')]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "-2"},
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "18"},
        {"role": "assistant", "content": "-2 °C and 18 °C."},
        {"role": "user", "content": "Thanks"},
    ],
    "ends_with_tool_result": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": '{"temp": -2}'},
    ],
}


def test_patch_fits_the_published_template_exactly():
    assert KIMI_TEMPLATE_PATCHES == (KIMI_K2_TEMPLATE_PATCH,)
    assert SOURCE.encode("utf-8") == (CORE_FIXTURES / "chat_templates" / "moonshotai-Kimi-K2.jinja").read_bytes()
    assert b"\r\n" in SOURCE.encode("utf-8")  # offsets count the published CRLF bytes
    annotated = apply_template_patch(SOURCE, KIMI_K2_TEMPLATE_PATCH)
    assert annotated.count(MARK_TAG) == len(KIMI_K2_TEMPLATE_PATCH.insertions)
    assert strip_marks(annotated).encode("utf-8") == SOURCE.encode("utf-8")


@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_render_matches_transformers(hf_tokenizer, conversation_name):
    messages = CONVERSATIONS[conversation_name]
    for tools in (TOOLS, None):
        for add_generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt)
            kwargs = dict(tools=tools, add_generation_prompt=add_generation_prompt, **hf_tokenizer.special_tokens_map)
            assert PUBLISHED.render(messages, **kwargs).text == expected
            assert PATCHED.render(messages, **kwargs).text == expected


@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_marks_end_complete_messages(tokenizer, conversation_name):
    messages = CONVERSATIONS[conversation_name]
    for tools in (TOOLS, None):
        declaration = PUBLISHED.render([], tools=tools).text  # the tool block alone, or nothing
        prefixes = [declaration] if tools else []
        if messages[0]["role"] != "system":
            prefixes.append(declaration + DEFAULT_SYSTEM)
        prefixes += [PUBLISHED.render(messages[:count], tools=tools).text for count in range(1, len(messages) + 1)]
        for add_generation_prompt in (True, False):
            rendered = PATCHED.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
            endpoints = mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
            assert len(endpoints) == len(rendered.marks) == len(prefixes)  # every mark is a clean token boundary
            assert all(rendered.text.startswith(prefix) for prefix in prefixes)
            assert endpoints == tuple(len(tokenizer.encode(prefix)) for prefix in prefixes)


def test_marks_survive_the_next_turns(tokenizer):
    conversation = CONVERSATIONS["tool_loop"]
    previous = None
    for messages in (conversation[:1], conversation[:4], conversation[:6]):
        rendered = PATCHED.render(messages, tools=TOOLS, add_generation_prompt=True)
        ids = tokenizer.encode(rendered.text)
        if previous is not None:
            previous_ids, previous_endpoints = previous
            assert all(ids[:end] == previous_ids[:end] for end in previous_endpoints)
        previous = ids, mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
    assert len(previous[1]) == 8  # tool block, default system message, six messages
