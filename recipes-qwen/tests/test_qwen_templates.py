"""The Qwen template patches: they fit the published templates, keep the rendered text,
and their marks land on message endpoints whose token prefixes later requests share."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from flare_core.contract.template_patch import MARK_TAG
from flare_core.frontend import (
    ChatTemplate,
    Tokenizer,
    apply_template_patch,
    build_tokenizer_json,
    mark_token_endpoints,
    strip_marks,
)
from flare_recipe_qwen.templates import (
    QWEN2_5_TEMPLATE_PATCH,
    QWEN3_5_TEMPLATE_PATCH,
    QWEN3_V1_TEMPLATE_PATCH,
    QWEN3_V2_TEMPLATE_PATCH,
    QWEN_TEMPLATE_PATCHES,
)

ASSETS = resources.files("flare_recipe_qwen") / "assets"
CORE_TEMPLATES = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "chat_templates"
SOURCES = {
    QWEN3_V1_TEMPLATE_PATCH.id: (CORE_TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_bytes().decode("utf-8"),
    QWEN3_V2_TEMPLATE_PATCH.id: (ASSETS / "qwen3.jinja").read_bytes().decode("utf-8"),
    QWEN2_5_TEMPLATE_PATCH.id: (CORE_TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_bytes().decode("utf-8"),
    # Qwen3.5's own tokenizer is not a fixture: its prompts are tokenized with Qwen3's here, whose
    # <|im_start|> / <|im_end|> are the same special tokens.
    QWEN3_5_TEMPLATE_PATCH.id: (Path(__file__).parent / "fixtures" / "qwen3.5" / "chat_template.jinja").read_bytes()
    .decode("utf-8"),
}
PATCHES = {patch.id: patch for patch in QWEN_TEMPLATE_PATCHES}
# Templates with Qwen3's marks (no mark after assistant messages).
QWEN3_IDS = (QWEN3_V1_TEMPLATE_PATCH.id, QWEN3_V2_TEMPLATE_PATCH.id, QWEN3_5_TEMPLATE_PATCH.id)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    with resources.as_file(ASSETS) as assets_dir:
        return Tokenizer.from_str(build_tokenizer_json(assets_dir))


@pytest.fixture(scope="module")
def templates() -> dict[str, tuple[ChatTemplate, ChatTemplate]]:
    """Per patch id: (the published template, the patched one)."""
    return {
        patch_id: (ChatTemplate(source), ChatTemplate(apply_template_patch(source, PATCHES[patch_id])))
        for patch_id, source in SOURCES.items()
    }


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def weather_call(city: str) -> dict:
    return {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}


# name -> (messages, tools, message counts whose rendering each mark ends, for Qwen3 and for Qwen2.5).
# Count 0 is the opening block alone (tools preamble or Qwen2.5's default system prompt).
CONVERSATIONS = {
    "chat": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi 👋"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
            {"role": "user", "content": "Bye"},
        ],
        None,
        (1, 2, 4),
        (1, 2, 3, 4),
    ),
    "no_system": (
        [
            {"role": "user", "content": "中文?"},
            {"role": "assistant", "content": "是的。"},
            {"role": "user", "content": "好"},
        ],
        None,
        (1, 3),
        (0, 1, 2, 3),
    ),
    "tool_loop": (
        [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Two calls.",
                "tool_calls": [weather_call("Oslo"), weather_call("Rome")],
            },
            {"role": "tool", "content": "-2"},
            {"role": "tool", "content": "18"},
            {"role": "assistant", "content": "-2 °C and 18 °C.", "reasoning_content": "Report."},
        ],
        TOOLS,
        (1, 2, 5),
        (1, 2, 3, 5, 6),
    ),
    "tools_without_system": (
        [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [weather_call("Oslo")]},
            {"role": "tool", "content": "-2"},
            {"role": "assistant", "content": "-2 °C."},
            {"role": "user", "content": "Thanks"},
        ],
        TOOLS,
        (0, 1, 3, 5),
        (0, 1, 2, 3, 4, 5),
    ),
}


def test_patches_fit_the_published_templates_exactly():
    assert len(PATCHES) == len(QWEN_TEMPLATE_PATCHES) == 4
    for patch_id, source in SOURCES.items():
        annotated = apply_template_patch(source, PATCHES[patch_id])
        assert annotated.count(MARK_TAG) == len(PATCHES[patch_id].insertions)
        assert strip_marks(annotated).encode("utf-8") == source.encode("utf-8")


@pytest.mark.parametrize("patch_id", sorted(SOURCES))
@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_patched_template_renders_the_same_text(templates, patch_id, conversation_name):
    messages, tools, _, _ = CONVERSATIONS[conversation_name]
    published, patched = templates[patch_id]
    for add_generation_prompt in (True, False):
        for thinking in ({}, {"enable_thinking": False}):
            kwargs = dict(tools=tools, add_generation_prompt=add_generation_prompt, **thinking)
            assert patched.render(messages, **kwargs).text == published.render(messages, **kwargs).text


def token_count_of_prefix(tokenizer: Tokenizer, template: ChatTemplate, messages, tools, count: int, text: str) -> int:
    if count == 0:
        # The opening block cannot be rendered alone (the templates index messages[0]); it ends at the first <|im_end|>.
        prefix = text[: text.index("<|im_end|>\n") + len("<|im_end|>\n")]
    else:
        prefix = template.render(messages[:count], tools=tools).text
        assert text.startswith(prefix)
    return len(tokenizer.encode(prefix))


# Qwen3.5's template renders a prefix of a conversation differently from the conversation (it
# refuses one without a user message, and writes an empty reasoning block into assistant turns
# after the last user query): its marks are checked against the blocks of the whole rendering.
@pytest.mark.parametrize("patch_id", sorted(set(SOURCES) - {QWEN3_5_TEMPLATE_PATCH.id}))
@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_marks_end_complete_messages(tokenizer, templates, patch_id, conversation_name):
    messages, tools, qwen3_counts, qwen2_5_counts = CONVERSATIONS[conversation_name]
    counts = qwen3_counts if patch_id in QWEN3_IDS else qwen2_5_counts
    published, patched = templates[patch_id]
    for add_generation_prompt in (True, False):
        rendered = patched.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        endpoints = mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
        assert len(endpoints) == len(rendered.marks)  # every mark is a clean token boundary
        expected = tuple(
            token_count_of_prefix(tokenizer, published, messages, tools, count, rendered.text) for count in counts
        )
        assert endpoints == expected


def blocks(messages, tools) -> int:
    """The `<|im_start|>` blocks Qwen's templates write for `messages`: the tools preamble or the
    system message, each user and assistant message, one user block per run of tool messages."""
    count = 1 if tools or (messages and messages[0]["role"] == "system") else 0
    previous = None
    for message in messages:
        if message["role"] != "system" and not (message["role"] == "tool" and previous == "tool"):
            count += 1
        previous = message["role"]
    return count


@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_qwen3_5_marks_end_complete_messages(tokenizer, templates, conversation_name):
    messages, tools, counts, _ = CONVERSATIONS[conversation_name]
    _, patched = templates[QWEN3_5_TEMPLATE_PATCH.id]
    for add_generation_prompt in (True, False):
        rendered = patched.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        endpoints = mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
        assert len(endpoints) == len(rendered.marks)  # every mark is a clean token boundary
        text = rendered.text.encode("utf-8")
        ends = [text[:mark].decode("utf-8") for mark in rendered.marks]
        assert all(end.endswith("<|im_end|>\n") for end in ends)
        assert [end.count("<|im_start|>") for end in ends] == [blocks(messages[:count], tools) for count in counts]


def test_qwen3_marks_before_the_last_query_survive_new_turns(tokenizer, templates):
    """A simulated agentic session: each request extends the previous conversation.

    Marks of request N must describe token prefixes of request N+1, except Qwen3's
    marks after the last user query once a new user query arrives, because the
    template then drops the earlier turn's reasoning."""
    turn1 = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"}]
    turn1_tool_loop = turn1 + [
        {"role": "assistant", "content": "", "reasoning_content": "Call it.", "tool_calls": [weather_call("Oslo")]},
        {"role": "tool", "content": "-2"},
    ]
    turn2 = turn1_tool_loop + [
        {"role": "assistant", "content": "-2 °C.", "reasoning_content": "Answer."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    turn3 = turn2 + [
        {"role": "assistant", "content": "Unknown.", "reasoning_content": "No forecast tool."},
        {"role": "user", "content": "OK"},
    ]
    requests = [turn1, turn1_tool_loop, turn2, turn3]
    for patch_id, (_, patched) in templates.items():
        checkpoints = []
        for messages in requests:
            rendered = patched.render(messages, tools=TOOLS, add_generation_prompt=True)
            ids = tokenizer.encode(rendered.text)
            checkpoints.append((ids, mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))))
        for (ids, endpoints), (next_ids, _) in zip(checkpoints, checkpoints[1:]):
            kept = [end for end in endpoints if next_ids[:end] == ids[:end]]
            if patch_id in QWEN3_IDS and (ids, endpoints) == checkpoints[1]:
                # The end of the tool results in turn 1 includes turn 1's reasoning, dropped in turn 2.
                assert kept == list(endpoints[:-1])
            else:
                assert kept == list(endpoints), patch_id
        assert [len(endpoints) for _, endpoints in checkpoints] == (
            [2, 3, 4, 5] if patch_id in QWEN3_IDS else [2, 4, 6, 8]
        )
