"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages API).

Like the real API, unknown top-level fields are refused ("Extra inputs are not permitted").
Output becomes thinking, text and tool_use content blocks; streaming sends message_start,
content_block_start / _delta / _stop per block, message_delta (stop reason + final usage) and
message_stop. `input_tokens` counts prompt tokens not read from the cache, as Anthropic
defines it; the cached ones are `cache_read_input_tokens`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from aiohttp import web

from flare_core.requests import GenerationRequest, Usage
from flare_core.server.errors import ApiError
from flare_core.server.generation import (INTERRUPTED, Call, EventSink, Outcome, Piece, answer, anthropic_call_id,
                                          execution_error, no_events, read_call)
from flare_core.server.models import resolve_model
from flare_core.server.prompts import (Prompt, chat_prompt, fit_max_tokens, template_options, template_tool_call,
                                       text_of_parts, tool_function, tool_name)
from flare_core.server.request_log import RECORD
from flare_core.server.sampling import read_sampling, read_stop
from flare_core.server.spec import Field, RequestSpec, Use, sampling_fields
from flare_core.server.state import STATE, ServerState, add_post
from flare_core.frontend.grammar import GrammarSpec
from flare_core.server.structured import (ForcedCalls, anthropic_format, constrained, forced_calls, one_spec,
                                          tool_calls_spec)
from flare_core.server.validation import (as_object, get_number, get_object, get_str, invalid, json_body, json_type,
                                         reject_unknown)

_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
# The fields of the Messages API that shape the prompt (count_tokens takes them too). Those
# without an effect here (service tier, cache hints: prefix caching is automatic) are accepted and
# ignored; fields the API does not define are refused, as Anthropic's API does.
_PROMPT_FIELDS = (
    Field("mcp_servers", "array", "MCP servers are not supported", use=Use.REFUSED),
    Field("context_management", "object", "context management is not supported", use=Use.REFUSED),
    Field("model", "string", "a served model name", required=True),
    Field("messages", "array", "the conversation; a final assistant message is continued (prefill)",
          required=True),
    Field("system", "any", "the system prompt", shape="string or array"),
    Field("tools", "array", "tools: described by the chat template, or by Flare's generic format where "
          "the recipe declares none (see /v1/models tool_calls); calls parsed by the core's tool parser"),
    Field("tool_choice", "object", 'type "auto" (default), "none", "any" or "tool" (with name): forced calls are '
          "written in the core's tool-call format, arguments constrained to the tool's input_schema"),
    Field("thinking", "object", 'type "enabled" / "adaptive" turns the template\'s thinking on, "disabled" off'),
    Field("output_config", "object", 'output_config.format: {"type": "json_schema", "schema"}: the output is '
          "constrained to the schema"),
    Field("cache_control", "any", "prefix caching is automatic", use=Use.IGNORED),
    Field("speed", "any", "", use=Use.IGNORED),
    Field("user_profile_id", "any", "", use=Use.IGNORED),
    Field("workspace_id", "any", "", use=Use.IGNORED),
    Field("diagnostics", "any", "", use=Use.IGNORED),
    Field("inference_geo", "any", "", use=Use.IGNORED),
)
SPEC = RequestSpec("POST /v1/messages", (
    Field("container", "any", "code execution containers are not supported", use=Use.REFUSED),
    *_PROMPT_FIELDS,
    Field("max_tokens", "integer", "at most this many output tokens", required=True, minimum=1),
    Field("stop_sequences", "array", "stop strings, withheld from the output"),
    Field("stream", "boolean", "stream typed server-sent events"),
    *sampling_fields(_SAMPLING_FIELDS, seed=None),
    Field("metadata", "any", "", use=Use.IGNORED),
    Field("service_tier", "any", "", use=Use.IGNORED),
), reject_undeclared=True)
COUNT_TOKENS_SPEC = RequestSpec("POST /v1/messages/count_tokens", (
    *_PROMPT_FIELDS,
    Field("output_format", "any", "", use=Use.IGNORED),
), reject_undeclared=True)


def _system_text(system: Any) -> str | None:
    if system is None:
        return None
    return text_of_parts(system, "system")


def anthropic_messages(system: Any, raw: list | None) -> list[dict[str, Any]]:
    """Anthropic `system` + `messages` (string or content-block content) -> template messages.
    tool_result blocks become `tool` messages, tool_use blocks assistant tool calls, thinking
    blocks the assistant's reasoning."""
    if raw is None:
        raise invalid("messages", "is required")
    messages: list[dict[str, Any]] = []
    system_text = _system_text(system)
    if system_text:
        messages.append({"role": "system", "content": system_text})
    for index, message in enumerate(raw):
        where = f"messages.{index}"
        message = as_object(message, where)
        reject_unknown(message, ("role", "content"), where)
        role = get_str(message, "role", where=f"{where}.role", required=True)
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", f"must be 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
        elif isinstance(content, list):
            converter = _user_blocks if role == "user" else _assistant_blocks
            messages.extend(converter(content, f"{where}.content"))
        else:
            raise invalid(f"{where}.content", f"must be a string or an array of content blocks, got "
                                              f"{json_type(content)}")
    return messages


def _other_blocks(blocks: list, where: str, texts: list[str]) -> Iterator[tuple[dict[str, Any], Any, str]]:
    """The content blocks other than text, as (block, its type, its field path); the text blocks'
    texts go to `texts`."""
    for index, block in enumerate(blocks):
        at = f"{where}.{index}"
        block = as_object(block, at)
        if block.get("type") == "text":
            texts.append(get_str(block, "text", where=f"{at}.text", required=True))
        else:
            yield block, block.get("type"), at


def _user_blocks(blocks: list, where: str) -> list[dict[str, Any]]:
    tool_messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for block, block_type, at in _other_blocks(blocks, where, texts):
        if block_type == "tool_result":
            tool_messages.append({
                "role": "tool",
                "tool_call_id": get_str(block, "tool_use_id", where=f"{at}.tool_use_id", required=True),
                "content": text_of_parts(block.get("content"), f"{at}.content"),
            })
        else:
            raise invalid(f"{at}.type", f"{block_type!r} blocks are not supported in user messages "
                                        f"(supported: text, tool_result)")
    converted = list(tool_messages)
    if texts or not tool_messages:
        converted.append({"role": "user", "content": "\n".join(texts)})
    return converted


def _assistant_blocks(blocks: list, where: str) -> list[dict[str, Any]]:
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    texts: list[str] = []
    for block, block_type, at in _other_blocks(blocks, where, texts):
        if block_type == "thinking":
            message["reasoning_content"] = get_str(block, "thinking", where=f"{at}.thinking", required=True)
        elif block_type == "redacted_thinking":
            continue  # encrypted reasoning from another provider: nothing a template can render
        elif block_type == "tool_use":
            tool_input = get_object(block, "input", where=f"{at}.input") or {}
            message.setdefault("tool_calls", []).append(template_tool_call(
                get_str(block, "id", where=f"{at}.id", required=True), tool_name(block, "name", f"{at}.name"),
                tool_input))
        else:
            raise invalid(f"{at}.type", f"{block_type!r} blocks are not supported in assistant "
                                        f"messages (supported: text, thinking, tool_use)")
    message["content"] = "".join(texts)
    return [message]


def anthropic_tools(raw: list | None) -> list[dict[str, Any]] | None:
    """Custom tools ({"name", "description", "input_schema"}) in the template's function shape."""
    if not raw:
        return None
    tools = []
    for index, tool in enumerate(raw):
        tool = as_object(tool, f"tools.{index}")
        if tool.get("type") not in (None, "custom"):
            raise invalid(f"tools.{index}.type", f"server tools are not supported, got {tool.get('type')!r}")
        function = tool_function(tool, f"tools.{index}", schema_key="input_schema", schema_required=True)
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(body: dict[str, Any], tools: list | None) -> tuple[tuple[dict[str, Any], ...], ForcedCalls | None]:
    """The tools whose calls are parsed out of the output (those offered; none with "none"), and
    the calls `tool_choice` forces: "any"
    (one or more of the tools) or "tool" (the one named); `disable_parallel_tool_use` makes
    "any" exactly one call."""
    choice = get_object(body, "tool_choice")
    choice_type = None if choice is None else choice.get("type")
    names = [tool["function"]["name"] for tool in tools or ()]
    offered = tuple(tools or ())
    if choice_type in (None, "auto"):
        return offered, None
    if choice_type == "none":
        return (), None
    if choice_type == "any":
        return offered, forced_calls(names, None, "tool_choice", one=choice.get("disable_parallel_tool_use") is True)
    if choice_type == "tool":
        if choice.get("name") is None:
            raise invalid("tool_choice.name", "is required: the tool to call")
        return offered, forced_calls(names, choice.get("name"), "tool_choice.name")
    raise invalid("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', got {choice_type!r}")


def _thinking(body: dict[str, Any]) -> bool | None:
    """Anthropic's `thinking` switch as the template's thinking option (absent: the core's default)."""
    thinking = get_object(body, "thinking")
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind in ("enabled", "adaptive"):
        return True
    if kind == "disabled":
        return False
    raise invalid("thinking.type", f"must be 'enabled', 'adaptive' or 'disabled', got {kind!r}")


def build_prompt(state: ServerState, body: dict[str, Any], values: dict[str, Any], *,
                 generates: bool = True) -> tuple[str, Prompt, tuple[dict[str, Any], ...], GrammarSpec | None]:
    """(served model, prompt, the tools whose calls are parsed, the grammar of forced tool calls) for a
    messages or count_tokens body, whose fields `values` holds (read by its spec). Counting
    (`generates` false) builds no grammar: what tool_choice forces does not change the prompt."""
    frontend = state.frontend
    model = resolve_model(state, values["model"], required=True)
    messages = anthropic_messages(values["system"], values["messages"])
    tools = anthropic_tools(values["tools"])
    options = template_options(frontend, thinking=_thinking(body))
    prefill = messages[-1]["role"] == "assistant" if messages else False
    prompt = chat_prompt(frontend, messages, tools=tools, options=options, continue_final_message=prefill)
    parsed_tools, forced = _tool_choice(body, tools)
    return model, prompt, parsed_tools, tool_calls_spec(frontend, tools, forced) if generates else None


@dataclass(frozen=True, kw_only=True)
class MessagesCall(Call):
    stop_sequences: tuple[str, ...]  # the stop reason names the one that matched


def parse_messages_request(state: ServerState, body: dict[str, Any], request_id: str) -> MessagesCall:
    frontend = state.frontend
    values = SPEC.read(body)
    temperature = get_number(body, "temperature")
    if temperature is not None and not 0.0 <= temperature <= 1.0:  # Anthropic's own range (OpenAI's is 0-2)
        raise invalid("temperature", f"must be between 0 and 1, got {temperature}")
    model, prompt, parsed_tools, calls = build_prompt(state, body, values)
    max_tokens = fit_max_tokens(len(prompt.ids), values["max_tokens"], "max_tokens", frontend.context_length)
    sampling = read_sampling(frontend.sampling_policy, body, _SAMPLING_FIELDS, seed_field=None)
    stop_sequences = read_stop(body, "stop_sequences")  # an array here (the spec), never a bare string
    request = GenerationRequest(prompt_ids=prompt.ids, max_tokens=max_tokens, sampling=sampling.params,
                                stop_strings=stop_sequences, message_ends=prompt.message_ends, request_id=request_id)
    grammar = one_spec(anthropic_format((values["output_config"] or {}).get("format")), calls)
    request = constrained(frontend, request, grammar, prompt.text)
    return MessagesCall(model, values["stream"], prompt, request, sampling, parsed_tools,
                        stop_sequences=stop_sequences)


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens, "output_tokens": usage.completion_tokens,
            "cache_read_input_tokens": usage.cached_tokens, "cache_creation_input_tokens": 0}


def stop_reason(outcome: Outcome, stop_sequences: tuple[str, ...], tool_use: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a complete generation."""
    if outcome.finish_reason == "length":
        return "max_tokens", None
    if tool_use:
        return "tool_use", None
    if isinstance(outcome.stop, str) and outcome.stop in stop_sequences:
        return "stop_sequence", outcome.stop
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}  # the parser ended a malformed call early; its text went to content
    return value if isinstance(value, dict) else {}


class MessageBuilder:
    """Turns parsed output into content blocks, sending stream events through `sink`."""

    def __init__(self, call: MessagesCall, message_id: str, sink: EventSink = no_events):
        self._call = call
        self._sink = sink
        self.message_id = message_id
        self.content: list[dict[str, Any]] = []
        self._open_key: tuple[str, int] | None = None
        self._tool_arguments: dict[int, str] = {}  # block index -> arguments JSON text
        self._started = False  # message_start sent

    async def start(self) -> None:
        """Nothing yet: message_start waits for the first piece (or the end), since it reports the
        cache reads, as Anthropic's does, and those are known once the request has started."""

    async def _begin(self, cached_tokens: int) -> None:
        if self._started:
            return
        self._started = True
        prompt_tokens = len(self._call.request.prompt_ids)
        await self._sink({"type": "message_start", "message": {
            **self._message_head(), "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}}})

    async def add(self, piece: Piece) -> None:
        await self._begin(piece.cached_tokens)
        delta = piece.delta
        if delta.reasoning:
            await self._switch(("thinking", 0), {"type": "thinking", "thinking": "", "signature": ""})
            self.content[-1]["thinking"] += delta.reasoning
            await self._delta({"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            await self._switch(("text", 0), {"type": "text", "text": ""})
            self.content[-1]["text"] += delta.content
            await self._delta({"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls:
            if call.name is not None:  # a call's first piece: its name and (anthropic_call_id) its id
                await self._switch(("tool_use", call.index),
                                   {"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            if call.arguments:
                index = len(self.content) - 1
                self._tool_arguments[index] = self._tool_arguments.get(index, "") + call.arguments
                await self._delta({"type": "input_json_delta", "partial_json": call.arguments})

    async def finish(self, outcome: Outcome) -> dict[str, Any]:
        """The whole message; after an execution error, the error event that ends the stream instead."""
        await self._begin(outcome.usage.cached_tokens)
        if outcome.finish_reason in ("error", "cancelled"):  # failed, or cut short by shutdown
            error = (_error_event(execution_error(outcome.error).message) if outcome.finish_reason == "error"
                     else _error_event(INTERRUPTED.message, "overloaded_error"))
            await self._sink(error)
            return error
        await self._close()
        for index, arguments in self._tool_arguments.items():
            self.content[index]["input"] = _tool_input(arguments)
        tool_use = any(block["type"] == "tool_use" for block in self.content)
        reason, sequence = stop_reason(outcome, self._call.stop_sequences, tool_use)
        usage = usage_json(outcome.usage)
        await self._sink({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": usage})
        await self._sink({"type": "message_stop"})
        return {**self._message_head(), "content": self.content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage}

    def _message_head(self) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self._call.model}

    async def _switch(self, key: tuple[str, int], block: dict[str, Any]) -> None:
        if self._open_key == key:
            return
        await self._close()
        self.content.append(block)
        self._open_key = key
        await self._sink({"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)})

    async def _delta(self, delta: dict[str, Any]) -> None:
        await self._sink({"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})

    async def _close(self) -> None:
        if self._open_key is None:
            return
        self._open_key = None
        await self._sink({"type": "content_block_stop", "index": len(self.content) - 1})


def _error_event(message: str, error_type: str = "api_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}}


# anthropic-beta names of features Flare serves (as part of the API, not as betas): prompt caching
# is automatic, token counting is /v1/messages/count_tokens. The Messages API answers 400 for
# names it does not know; so does Flare for every other name, rather than ignore the feature.
SERVED_BETAS = ("prompt-caching-2024-07-31", "token-counting-2024-11-01")


def check_betas(request: web.Request) -> None:
    """400 naming the header for an anthropic-beta feature Flare does not serve."""
    names = [name.strip() for value in request.headers.getall("anthropic-beta", [])
             for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in SERVED_BETAS]
    if unknown:
        raise ApiError(400, f"anthropic-beta: {', '.join(unknown)} is not served here (served: "
                            f"{', '.join(SERVED_BETAS)})", param="anthropic-beta")


async def messages(request: web.Request) -> web.StreamResponse:
    check_betas(request)
    call = await read_call(request, parse_messages_request)
    message_id = f"msg_{request[RECORD].request_id}"
    return await answer(request, call, lambda sink: [MessageBuilder(call, message_id, sink)],
                        call_ids=anthropic_call_id)


async def count_tokens(request: web.Request) -> web.Response:
    check_betas(request)
    state = request.app[STATE]

    def count() -> tuple[str, Prompt]:
        body = json_body(request)
        model, prompt, _, _ = build_prompt(state, body, COUNT_TOKENS_SPEC.read(body), generates=False)
        return model, prompt

    model, prompt = await state.prepare(count)
    request[RECORD].model = model
    request[RECORD].prompt_tokens = len(prompt.ids)
    return web.json_response({"input_tokens": len(prompt.ids)})


def add_routes(app: web.Application) -> None:
    add_post(app, "/v1/messages", messages)
    add_post(app, "/v1/messages/count_tokens", count_tokens)
