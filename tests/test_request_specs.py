"""The endpoints' request specs (flare_core.server.spec): the one declaration of the fields each
endpoint accepts, which docs/api-fields.md renders and every request is checked against."""

from __future__ import annotations

from pathlib import Path

import pytest

from flare_core.server import anthropic_messages, ollama, openai_chat, openai_completions
from flare_core.server.errors import ApiError
from flare_core.server.field_docs import all_specs, render

DOCS = Path(__file__).resolve().parents[1] / "docs" / "api-fields.md"


def test_the_field_reference_is_generated_from_the_specs():
    assert DOCS.read_text() == render(), (
        "docs/api-fields.md is stale: python -c \"from flare_core.server.field_docs import render; "
        "print(render(), end='')\" > docs/api-fields.md")
    assert len(all_specs()) == 9


def test_defaults_apply_and_refused_values_name_the_field():
    values = openai_chat.SPEC.read({"messages": []})
    assert values["stream"] is False and values["skip_special_tokens"] is True and values["model"] is None
    assert ollama.CHAT_SPEC.read({})["stream"] is True
    for body, message in [({"n": 129}, "'n': must be at most 128"),
                          ({"best_of": 2}, "'best_of': only best_of=1 is supported, got 2"),
                          ({"logit_bias": [5]}, "'logit_bias': must be an object"),
                          ({"top_logprobs": 21}, "'top_logprobs'"),
                          ({"user": 5}, "'user': must be a string")]:
        with pytest.raises(ApiError, match=message):
            openai_chat.SPEC.read({"messages": [], **body})
    with pytest.raises(ApiError, match="'suffix': is not supported"):
        openai_completions.SPEC.read({"prompt": "x", "suffix": "y"})
    with pytest.raises(ApiError, match=r"'options.mirostat': mirostat sampling is not supported \(only 0"):
        ollama.OPTIONS_SPEC.read({"mirostat": 2})
    assert ollama.OPTIONS_SPEC.read({"mirostat": 0, "num_gpu": 1})["mirostat"] == 0


def test_undeclared_fields_are_ignored_or_refused_as_the_api_does():
    assert "unheard_of" not in openai_chat.SPEC.read({"messages": [], "unheard_of": 1})
    with pytest.raises(ApiError, match="unheard_of: Extra inputs are not permitted"):
        anthropic_messages.SPEC.read({"model": "m", "messages": [], "max_tokens": 1, "unheard_of": 1})
    # count_tokens takes the prompt's fields, not the generation's
    with pytest.raises(ApiError, match="max_tokens: Extra inputs are not permitted"):
        anthropic_messages.COUNT_TOKENS_SPEC.read({"model": "m", "messages": [], "max_tokens": 1})
