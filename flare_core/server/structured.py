"""Structured output: the grammar fields of each API, read into one `GrammarSpec`, compiled and
attached to the generation request.

OpenAI `response_format` (chat, completions) and Responses `text.format`: `json_object`, or
`json_schema` with its `schema`. vLLM's extra fields: `guided_json` (a schema, as an object or
JSON text), `guided_regex`, `guided_choice` (strings), `guided_grammar` (EBNF / GBNF). Ollama
`format`: "json" or a schema. Anthropic `output_config.format`: `json_schema` with its `schema`. A
forced tool call (`tool_choice` "required" / "any" / a named tool) is a grammar too: the calls
written in the core's tool-call format (its tool parser's `call_format`), each tool's arguments
constrained to its parameters schema. A request gives at most one of them.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flare_core.contract import ToolCallFormat
from flare_core.frontend import Frontend
from flare_core.frontend.grammar import GrammarError, GrammarKind, GrammarSpec, compact_json_ebnf
from flare_core.requests import GenerationRequest
from flare_core.server.spec import Field
from flare_core.server.validation import invalid, json_type, parse_json_string

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
            value = parse_json_string(value, "guided_json")
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


@dataclass(frozen=True)
class ForcedCalls:
    """Tool calls a request forces: the tools the output may call, and whether exactly one call
    (a named tool, or no parallel calls) or one or more."""

    names: tuple[str, ...]
    one: bool


# Tool names a forced call's grammar writes: OpenAI's function-name characters (plus . and :), which
# every tool-call format takes as they are, with nothing to escape.
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,256}")


def forced_calls(names: Sequence[str], name: Any, field: str, one: bool = False) -> ForcedCalls:
    """The calls a tool_choice forces among the request's tool `names`: any of them (`name`
    None), or the one named (read from `field`)."""
    if not names:
        raise invalid("tool_choice", "forces a tool call, but the request offers no tools")
    if name is None:
        return ForcedCalls(tuple(names), one)
    if not isinstance(name, str) or name not in names:
        raise invalid(field, f"names no tool the request offers: {json.dumps(name)[:80]} (offered: "
                             f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''})")
    return ForcedCalls((name,), True)


def tool_calls_spec(frontend: Frontend, tools: Sequence[Mapping[str, Any]] | None,
                    forced: ForcedCalls | None) -> GrammarSpec | None:
    """The grammar of the forced calls in the core's tool-call format (`tools`: the request's
    tools in the template's shape, {"type": "function", "function": {"name", "parameters"}})."""
    if forced is None:
        return None
    parser = frontend.tool_parser
    if parser is None or parser.call_format is None:
        why = "this core takes no tools (it has no chat template)" if parser is None else \
            f"this core's tool parser {parser.id!r} cannot write them"
        raise invalid("tool_choice", f"forcing a tool call is not available: {why}")
    call_format, tags = parser.call_format, []
    for tool in tools or ():
        function = tool["function"]
        if function["name"] not in forced.names:
            continue
        if not _PLAIN_NAME.fullmatch(function["name"]):
            raise invalid("tool_choice", f"can force only tools whose names are letters, digits, _ . : and -; "
                                         f"got {json.dumps(function['name'])[:80]}")
        tags.append(_call_tag(call_format, function["name"], function.get("parameters") or {"type": "object"}))
    calls = {"type": "tags_with_separator", "tags": tags, "separator": call_format.separator, "at_least_one": True,
             "stop_after_first": forced.one}
    if call_format.section_begin:
        calls = {"type": "tag", "begin": call_format.section_begin, "content": calls, "end": call_format.section_end}
    tag = {"type": "structural_tag", "format": calls}
    return GrammarSpec(GrammarKind.STRUCTURAL_TAG, json.dumps(tag), "tool_choice")


def _call_tag(call_format: ToolCallFormat, name: str, schema: Mapping[str, Any]) -> dict[str, Any]:
    """The xgrammar tag of one call of tool `name` whose arguments follow `schema`."""
    begin, end = call_format.around(name)
    arguments: dict[str, Any]
    if call_format.arguments == "json":
        # Compact JSON, as response_format writes it: a model cannot pad with whitespace.
        try:
            arguments = {"type": "grammar", "grammar": compact_json_ebnf(schema, "tools")}
        except GrammarError as exc:
            raise invalid("tools", f"the parameters of tool {json.dumps(name)} cannot be compiled into a grammar: "
                                   f"{exc.problem}") from None
    else:
        # xgrammar writes the schema in that style; at most one whitespace character between
        # tokens, so that a model cannot pad forever (values sit between newlines).
        arguments = {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1,
                     "style": call_format.arguments}
    head, index, tail = begin.partition("{index}")
    if not index:
        return {"type": "tag", "begin": begin, "content": arguments, "end": end}
    # The model numbers its calls: digits, then the rest of the opening, then the arguments.
    elements = [{"type": "regex", "pattern": "[0-9]{1,4}"}]
    if tail:
        elements.append({"type": "const_string", "value": tail})
    return {"type": "tag", "begin": head, "content": {"type": "sequence", "elements": [*elements, arguments]},
            "end": end}


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
