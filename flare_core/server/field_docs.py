"""docs/api-fields.md, rendered from every endpoint's `RequestSpec`: kept apart from the specs so
that the spec module imports no endpoint (each endpoint imports it for its own spec).

`python -c "from flare_core.server.field_docs import render; print(render(), end='')" > docs/api-fields.md`
"""

from __future__ import annotations

from flare_core.server import anthropic_messages, ollama, openai_chat, openai_completions, openai_responses
from flare_core.server.spec import RequestSpec


def all_specs() -> list[RequestSpec]:
    """Every endpoint's spec, in the order docs/api-fields.md lists them."""
    return [openai_chat.SPEC, openai_completions.SPEC, openai_responses.SPEC, openai_responses.INPUT_TOKENS_SPEC,
            anthropic_messages.SPEC,
            anthropic_messages.COUNT_TOKENS_SPEC, ollama.CHAT_SPEC, ollama.GENERATE_SPEC, ollama.OPTIONS_SPEC]


def render() -> str:
    header = ("# Request fields\n\nEvery field each generating endpoint accepts, generated from the endpoints' "
              "`RequestSpec`s (`flare_core.server.field_docs.render`). A value of the wrong type, outside its "
              "limits, or set on a refused field is a 400 naming the field.\n")
    return header + "\n\n" + "\n\n".join(spec.table() for spec in all_specs()) + "\n"
