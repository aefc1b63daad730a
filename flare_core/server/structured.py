"""Structured output: the grammar fields of each API, read into one `GrammarSpec`, compiled and
attached to the generation request.

OpenAI `response_format` (chat, completions) and Responses `text.format`: `json_object`, or
`json_schema` with its `schema`. vLLM's extra fields: `guided_json` (a schema, as an object or
JSON text), `guided_regex`, `guided_choice` (strings), `guided_grammar` (EBNF / GBNF). Ollama
`format`: "json" or a schema. Anthropic `output_config.format`: `json_schema` with its `schema`. A
request gives at most one of them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from flare_core.frontend import Frontend
from flare_core.frontend.grammar import GrammarError, GrammarKind, GrammarSpec
from flare_core.runtime.types import GenerationRequest
from flare_core.server.spec import Field
from flare_core.server.validation import invalid, json_type

GUIDED_FIELDS = (
    Field("guided_json", "any", "constrain the output to this JSON schema (vLLM)", shape="object or string"),
    Field("guided_regex", "string", "constrain the output to this regular expression (vLLM)"),
    Field("guided_choice", "array", "the output is exactly one of these strings (vLLM)"),
    Field("guided_grammar", "string", "constrain the output to this EBNF / GBNF grammar, root rule `root` (vLLM)"),
)
RESPONSE_FORMAT_FIELD = Field(
    "response_format", "object", '{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", '
    '"json_schema": {"name", "schema", "strict"}}: the output is constrained to JSON / the schema')


def openai_response_format(value: Mapping[str, Any] | None, field: str = "response_format") -> GrammarSpec | None:
    """Chat Completions' `response_format` (the schema under `json_schema.schema`)."""
    if value is None:
        return None
    kind = _format_type(value, field)
    if kind == "json_schema":
        schema_field = f"{field}.json_schema"
        holder = value.get("json_schema")
        if not isinstance(holder, Mapping):
            raise invalid(schema_field, f"must be an object holding the schema, got {json_type(holder)}")
        return _schema_spec(holder.get("schema"), f"{schema_field}.schema")
    return _simple_format(kind, field)


def responses_format(value: Mapping[str, Any] | None, field: str = "text.format") -> GrammarSpec | None:
    """Responses' `text.format` (the schema directly under `schema`)."""
    if value is None:
        return None
    kind = _format_type(value, field)
    if kind == "json_schema":
        return _schema_spec(value.get("schema"), f"{field}.schema")
    return _simple_format(kind, field)


def ollama_format(value: Any, field: str = "format") -> GrammarSpec | None:
    """Ollama's `format`: "json" (any JSON object), a JSON schema object, or empty."""
    if value is None or value == "":
        return None
    if value == "json":
        return GrammarSpec(GrammarKind.JSON_OBJECT, "", field)
    if isinstance(value, Mapping):
        return _schema_spec(value, field)
    raise invalid(field, f'must be "json" or a JSON schema object, got {json.dumps(value)[:60]}')


def anthropic_format(value: Any, field: str = "output_config.format") -> GrammarSpec | None:
    """Anthropic's `output_config.format`: {"type": "json_schema", "schema": ...}."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") != "json_schema":
        raise invalid(f"{field}.type", f'must be "json_schema", got {json.dumps(_type_of(value))[:60]}')
    return _schema_spec(value.get("schema"), f"{field}.schema")


def _type_of(value: Any) -> Any:
    return value.get("type") if isinstance(value, Mapping) else value


def guided_spec(body: Mapping[str, Any]) -> GrammarSpec | None:
    """vLLM's `guided_*` fields (their types are checked by the route's spec)."""
    specs = []
    if body.get("guided_json") is not None:
        value = body["guided_json"]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise invalid("guided_json", f"is not valid JSON: {exc}") from None
        specs.append(_schema_spec(value, "guided_json"))
    if body.get("guided_regex") is not None:
        specs.append(GrammarSpec(GrammarKind.REGEX, body["guided_regex"], "guided_regex"))
    if body.get("guided_choice") is not None:
        choices = body["guided_choice"]
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise invalid("guided_choice", "must be a non-empty array of non-empty strings")
        specs.append(GrammarSpec(GrammarKind.CHOICE, tuple(choices), "guided_choice"))
    if body.get("guided_grammar") is not None:
        specs.append(GrammarSpec(GrammarKind.EBNF, body["guided_grammar"], "guided_grammar"))
    return one_spec(*specs)


def one_spec(*specs: GrammarSpec | None) -> GrammarSpec | None:
    """The request's grammar: at most one of its grammar fields may be set."""
    given = [spec for spec in specs if spec is not None]
    if len(given) > 1:
        raise invalid(given[1].field, f"cannot be combined with {given[0].field}: a request has one grammar")
    return given[0] if given else None


def constrained(frontend: Frontend, request: GenerationRequest, spec: GrammarSpec | None,
                prompt_text: str | None) -> GenerationRequest:
    """`request` with its grammar compiled (a 400 naming the field when it cannot be). On a core
    whose reasoning parser names its closing tag, a prompt that does not end with that tag lets
    the model reason first: the grammar applies after the tag."""
    if spec is None:
        return request
    if frontend.grammars is None:
        raise invalid(spec.field, "structured output is not available on this server")
    try:
        grammar = frontend.grammars.compile(spec, starts_after=_reasoning_end(frontend, prompt_text))
    except GrammarError as exc:
        raise invalid(exc.field, f"cannot be compiled into a grammar: {exc.problem}") from None
    return dataclasses.replace(request, grammar=grammar)


def _reasoning_end(frontend: Frontend, prompt_text: str | None) -> int | None:
    parser = frontend.reasoning_parser
    if parser is None or parser.closing is None or prompt_text is None:
        return None
    if prompt_text.rstrip().endswith(parser.closing):  # the template closed reasoning (thinking off)
        return None
    ids = frontend.tokenizer.encode(parser.closing)
    return ids[0] if len(ids) == 1 else None


def _format_type(value: Mapping[str, Any], field: str) -> str:
    kind = value.get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(f"{field}.type", f'must be "text", "json_object" or "json_schema", got {json.dumps(kind)[:60]}')
    return kind


def _simple_format(kind: str, field: str) -> GrammarSpec | None:
    return GrammarSpec(GrammarKind.JSON_OBJECT, "", field) if kind == "json_object" else None


def _schema_spec(schema: Any, field: str) -> GrammarSpec:
    if isinstance(schema, bool) or not isinstance(schema, Mapping):
        raise invalid(field, f"must be a JSON schema object, got {json_type(schema)}")
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), field)
