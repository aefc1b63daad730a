"""Chat template rendering (parity with Transformers), `{% mark %}`, mark endpoints and template patches."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from datetime import datetime
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from flare_core.contract.template_patch import MARK_TAG, TemplatePatch
from flare_core.frontend import (
    ChatTemplate,
    RenderedPrompt,
    TemplateError,
    TemplatePatchError,
    Tokenizer,
    apply_template_patch,
    build_tokenizer_json,
    make_template_patch,
    mark_token_endpoints,
    strip_marks,
)

FIXTURES = Path(__file__).parent / "fixtures"
TEMPLATES = FIXTURES / "chat_templates"
QWEN_TEMPLATES = ("Qwen-Qwen3-0.6B.jinja", "Qwen-Qwen3.chat_template.jinja", "Qwen-Qwen2.5-7B-Instruct.jinja")


def read_template(name: str) -> str:
    return (TEMPLATES / name).read_bytes().decode("utf-8")


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(FIXTURES / "tokenizers" / "qwen3"), local_files_only=True)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(build_tokenizer_json(FIXTURES / "tokenizers" / "qwen3"))


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather <b>now</b> & «here» — in °C",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": {}}}


def weather_call(arguments):
    return {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}


CONVERSATIONS = {
    "system_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! 你好 👋"},
    ],
    "user_only": [{"role": "user", "content": "  leading and trailing spaces  \n\n"}],
    "multi_turn_reasoning": [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n6"},
        {"role": "user", "content": "Thanks."},
    ],
    "reasoning_alias_and_none_values": [
        {"role": "user", "content": "Capital of France?", "name": None},
        {"role": "assistant", "content": "Paris.", "reasoning": "Well known.", "tool_calls": None},
    ],
    "tool_loop_dict_arguments": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Zürich and Köln?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call the tool twice.",
            "tool_calls": [weather_call({"city": "Zürich"}), weather_call({"city": "Köln"})],
        },
        {"role": "tool", "content": '{"temp": 3}'},
        {"role": "tool", "content": '{"temp": 5}'},
        {"role": "assistant", "content": "3 °C and 5 °C.", "reasoning_content": "Report both."},
    ],
    "tool_call_string_arguments_after_answer": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [weather_call('{"city": "Oslo"}')]},
        {"role": "tool", "content": "-2"},
        {"role": "assistant", "content": "-2 °C."},
        {"role": "user", "content": "<tool_response>\nmanual\n</tool_response>"},
    ],
}


@pytest.mark.parametrize("template_name", QWEN_TEMPLATES)
@pytest.mark.parametrize("conversation_name", sorted(CONVERSATIONS))
def test_render_matches_transformers(hf_tokenizer, template_name, conversation_name):
    source = read_template(template_name)
    hf_tokenizer.chat_template = source
    template = ChatTemplate(source)
    messages = CONVERSATIONS[conversation_name]
    uses_tools = "tool" in conversation_name
    for tools in ([WEATHER_TOOL, TIME_TOOL], None) if uses_tools else (None,):
        for add_generation_prompt in (True, False):
            for thinking in ({}, {"enable_thinking": True}, {"enable_thinking": False}):
                expected = hf_tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **thinking
                )
                rendered = template.render(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    **hf_tokenizer.special_tokens_map,
                    **thinking,
                )
                assert rendered.text == expected
                assert rendered.marks == ()


def test_render_does_not_modify_the_callers_messages():
    messages = copy.deepcopy(CONVERSATIONS["reasoning_alias_and_none_values"])
    before = copy.deepcopy(messages)
    ChatTemplate(read_template("Qwen-Qwen3.chat_template.jinja")).render(messages)
    assert messages == before


def test_none_valued_message_keys_are_dropped_like_transformers():
    template = ChatTemplate("{{ messages[0].content is defined }} {{ messages[0].role }}")
    assert template.render([{"role": "assistant", "content": None}]).text == "False assistant"


def test_enable_thinking_false_adds_an_empty_think_block():
    template = ChatTemplate(read_template("Qwen-Qwen3.chat_template.jinja"))
    messages = CONVERSATIONS["user_only"]
    plain = template.render(messages, add_generation_prompt=True).text
    no_thinking = template.render(messages, add_generation_prompt=True, enable_thinking=False).text
    assert plain.endswith("<|im_start|>assistant\n")
    assert no_thinking == plain + "<think>\n\n</think>\n\n"


def test_environment_globals_and_filters():
    assert ChatTemplate("{{ bos_token }}|{{ eos_token }}").render([], bos_token="<s>", eos_token="</s>").text == (
        "<s>|</s>"
    )
    value = {"b": "ü<&>", "a": [1, 2]}
    tojson = ChatTemplate(
        "{{ x | tojson }}\n{{ x | tojson(indent=2, sort_keys=True) }}\n{{ x | tojson(separators=(',', ':')) }}"
    )
    assert tojson.render([], x=value).text == "\n".join(
        [
            json.dumps(value, ensure_ascii=False),
            json.dumps(value, ensure_ascii=False, indent=2, sort_keys=True),
            json.dumps(value, ensure_ascii=False, separators=(",", ":")),
        ]
    )
    loop = ChatTemplate(
        "{% for i in range(9) %}{% if i == 2 %}{% continue %}{% endif %}"
        "{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    )
    assert loop.render([]).text == "013"
    before = datetime.now().strftime("%Y-%m-%d")
    rendered = ChatTemplate("{{ strftime_now('%Y-%m-%d') }}").render([]).text
    assert rendered in {before, datetime.now().strftime("%Y-%m-%d")}
    # trim_blocks and lstrip_blocks: block tags leave no newline or indentation behind.
    assert ChatTemplate("a\n    {% if true %}\nb\n    {% endif %}\nc").render([]).text == "a\nb\nc"


def test_raise_exception_becomes_template_error():
    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}")
    with pytest.raises(TemplateError, match="first message must be user"):
        template.render([{"role": "assistant", "content": "x"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{% set x = messages.append(1) %}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ undefined_name.attribute }}",
    ],
)
def test_sandbox_and_render_errors_are_template_errors(source):
    with pytest.raises(TemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_python_errors_from_request_data_are_template_errors():
    with pytest.raises(TemplateError, match="TypeError"):
        ChatTemplate("{{ messages[0].content + 'x' }}").render([{"role": "user", "content": 1}])


def test_syntax_error_names_the_line():
    with pytest.raises(TemplateError, match="line 2"):
        ChatTemplate("ok\n{% if %}")


def test_bad_inputs_are_rejected_with_their_position():
    template = ChatTemplate("{{ messages | length }}")
    with pytest.raises(TypeError, match=r"messages\[1\]"):
        template.render([{"role": "user", "content": "a"}, "not a message"])
    with pytest.raises(TypeError, match=r"tools\[0\]"):
        template.render([], tools=[print])
    with pytest.raises(TypeError, match=r"messages\[0\]\['content'\]"):
        template.render([{"role": "user", "content": object()}])


def test_mark_records_utf8_byte_offsets_and_emits_nothing():
    template = ChatTemplate("a{% mark %}é{% mark %}{% mark %}😀{% for m in messages %}{{ m.content }}{% mark %}{% endfor %}")
    rendered = template.render([{"role": "user", "content": "x"}, {"role": "user", "content": "yz"}])
    assert rendered == RenderedPrompt(text="aé😀xyz", marks=(1, 3, 8, 10))


def test_mark_inside_macro_and_captured_block():
    template = ChatTemplate(
        "{% macro turn(text) %}<{{ text }}>{% mark %}{% endmacro %}"
        "{% set captured %}[{% mark %}]{% endset %}"
        "{{ turn('a') }}{{ turn('bc') }}{{ captured }}"
    )
    rendered = template.render([])
    assert rendered.text == "<a><bc>[]"
    assert rendered.marks == (3, 7, 8)


def test_mark_whose_output_a_filter_changes_is_an_error():
    template = ChatTemplate("{% set captured %}x{% mark %}y{% endset %}{{ captured | replace('m', 'M') }}")
    with pytest.raises(TemplateError, match="mark"):
        template.render([])


def test_mark_token_endpoints_keep_only_clean_cuts(tokenizer):
    template = ChatTemplate(
        "{% mark %}<|im_start|>user\né😀 中文字{% mark %}<|im_end|>\n{% mark %}<|im_start|>assistant\nHel{% mark %}lo"
        "{% mark %}"
    )
    rendered = template.render([])
    assert rendered.text == "<|im_start|>user\né😀 中文字<|im_end|>\n<|im_start|>assistant\nHello"
    ids = tokenizer.encode(rendered.text)
    endpoints = mark_token_endpoints(rendered, tokenizer.encoding(rendered.text))
    before_im_end = rendered.text.index("<|im_end|>")
    after_newline = before_im_end + len("<|im_end|>\n")
    assert tokenizer.token_to_id("Hello") is not None  # "Hel|lo" is inside one token, so that mark is dropped
    assert endpoints == (
        0,
        len(tokenizer.encode(rendered.text[:before_im_end])),
        len(tokenizer.encode(rendered.text[:after_newline])),
        len(ids),
    )
    assert ids[: endpoints[2]] == tokenizer.encode(rendered.text[:after_newline])


# Template patches


def test_make_apply_strip_round_trip_on_crlf_template():
    source = read_template("moonshotai-Kimi-K2.jinja")
    assert "\r\n" in source
    source_bytes = source.encode("utf-8")
    offsets = [index + 2 for index in range(len(source_bytes) - 1) if source_bytes[index : index + 2] == b"%}"][:3]
    patch = make_template_patch("kimi-k2-test", source, offsets)
    assert patch.source_sha256 == hashlib.sha256(source_bytes).hexdigest()
    assert [offset for offset, _ in patch.insertions] == offsets
    annotated = apply_template_patch(source, patch)
    assert annotated.count(MARK_TAG) == 3
    assert annotated.encode("utf-8")[offsets[0] : offsets[0] + len(MARK_TAG)] == MARK_TAG.encode()
    assert hashlib.sha256(annotated.encode("utf-8")).hexdigest() == patch.result_sha256
    assert strip_marks(annotated).encode("utf-8") == source_bytes
    # Reading the file in text mode turns CRLF into LF: a different template, which the patch refuses.
    with pytest.raises(TemplatePatchError, match="kimi-k2-test"):
        apply_template_patch((TEMPLATES / "moonshotai-Kimi-K2.jinja").read_text(), patch)


def test_patched_template_renders_the_same_text_with_marks():
    source = read_template("Qwen-Qwen2.5-7B-Instruct.jinja")
    anchor = b"+ '<|im_end|>' + '\\n' }}"
    offset = source.encode("utf-8").index(anchor) + len(anchor)
    patch = make_template_patch("qwen2.5-test", source, [offset])
    messages = CONVERSATIONS["multi_turn_reasoning"][1:4]
    plain = ChatTemplate(source).render(messages, add_generation_prompt=True)
    marked = ChatTemplate(apply_template_patch(source, patch)).render(messages, add_generation_prompt=True)
    assert marked.text == plain.text
    ends = [index + len("<|im_end|>\n") for index in range(len(plain.text)) if plain.text.startswith("<|im_end|>", index)]
    # The user/plain-assistant branch is marked; the default system prompt is not.
    assert marked.marks == tuple(ends[1:])


def test_apply_checks_source_then_result_hash():
    source = read_template("Qwen-Qwen3.chat_template.jinja")
    patch = make_template_patch("qwen3-test", source, [0, 10])
    with pytest.raises(TemplatePatchError, match="'qwen3-test' is for a template with sha256"):
        apply_template_patch(source + " ", patch)
    wrong_result = dataclasses.replace(patch, result_sha256="0" * 64)
    with pytest.raises(TemplatePatchError, match="'qwen3-test': the patched template has sha256"):
        apply_template_patch(source, wrong_result)
    beyond_end = make_template_patch("short", "ab", [2])
    with pytest.raises(TemplatePatchError, match="past the template end"):
        apply_template_patch("ab", dataclasses.replace(beyond_end, insertions=((3, MARK_TAG),)))


def test_make_template_patch_rejects_bad_offsets():
    with pytest.raises(TemplatePatchError, match="splits a UTF-8 character"):
        make_template_patch("p", "é", [1])
    with pytest.raises(TemplatePatchError, match="outside the template"):
        make_template_patch("p", "ab", [3])
    with pytest.raises(TemplatePatchError, match="already contains"):
        make_template_patch("p", "a{% mark %}b", [0])


@pytest.mark.parametrize(
    ("changes", "field_name"),
    [
        ({"id": ""}, "id"),
        ({"source_sha256": "abc"}, "source_sha256"),
        ({"result_sha256": "A" * 64}, "result_sha256"),
        ({"insertions": [(0, MARK_TAG)]}, "insertions"),
        ({"insertions": ((5, MARK_TAG), (5, MARK_TAG))}, "strictly increasing"),
        ({"insertions": ((3, MARK_TAG), (1, MARK_TAG))}, "strictly increasing"),
        ({"insertions": ((-1, MARK_TAG),)}, "offset"),
        ({"insertions": ((1, "{% if x %}"),)}, "text"),
        ({"insertions": ((1,),)}, r"insertions\[0\]"),
    ],
)
def test_template_patch_validation_names_the_field(changes, field_name):
    valid = {"id": "p", "source_sha256": "a" * 64, "result_sha256": "b" * 64, "insertions": ((1, MARK_TAG),)}
    TemplatePatch(**valid)
    with pytest.raises(ValueError, match=field_name):
        TemplatePatch(**{**valid, **changes})
