"""POST /v1/responses (OpenAI Responses API), stateless: the whole conversation comes in `input`.

Output is a list of items (reasoning, message, function_call). Streaming sends the lifecycle
events the openai SDK accumulates: response.created / in_progress, output_item.added,
content_part.added, *.delta, *.done, output_item.done, and response.completed (or
.incomplete / .failed), each with a running sequence_number. The non-streaming path runs the
same builder without sending events, so both agree by construction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from flare_core.requests import TokenLogprob, Usage
from flare_core.server.generation import Call, EventSink, Outcome, Piece, answer, execution_error, no_events, read_call
from flare_core.server.models import resolve_model
from flare_core.server.openai_common import chat_logprobs, generation_request, read_tool_choice, thinking_switch
from flare_core.server.prompts import (Prompt, chat_prompt, template_options, template_tool_call, text_of_parts,
                                       tool_arguments, tool_function, tool_name)
from flare_core.server.request_log import RECORD
from flare_core.server.sampling import OPENAI_SAMPLING_FIELDS
from flare_core.server.spec import OPENAI_STOP_FIELDS, TOP_LOGPROBS_LIMIT, Field, RequestSpec, Use, sampling_fields
from flare_core.server.state import STATE, ServerState, add_post
from flare_core.server.structured import constrained, one_spec, responses_format, tool_calls_spec
from flare_core.server.validation import as_object, get_object, get_str, invalid, json_body, json_type

_TEXT_PARTS = ("input_text", "output_text", "text")
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_ITEM_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


SPEC = RequestSpec("POST /v1/responses", (
    Field("previous_response_id", "string", "this server keeps no responses; send the whole conversation in input",
          use=Use.REFUSED),
    Field("conversation", "any", "this server keeps no conversations; send the whole conversation in input",
          use=Use.REFUSED),
    Field("prompt", "object", "stored prompt templates are not supported", use=Use.REFUSED),
    Field("background", "boolean", "background responses are not supported", use=Use.REFUSED),
    Field("model", "string", "a served model name; absent: the first"),
    Field("input", "any", "the conversation: a string (one user message) or input items", required=True,
          shape="string or array"),
    Field("instructions", "string", "a system message before the input"),
    Field("tools", "array", "function tools: described by the chat template, or by Flare's generic format where "
          "the recipe declares none (see /v1/models tool_calls); calls parsed by the core's tool parser"),
    Field("tool_choice", "any", '"auto" (default), "none", "required" or {"type": "function", "name"}: forced '
          "calls are written in the core's tool-call format, arguments constrained to the tool's schema",
          shape="string or object"),
    Field("stream", "boolean", "stream typed server-sent events"),
    Field("max_output_tokens", "integer", "at most this many output tokens; absent: the context's room",
          minimum=1),
    *sampling_fields(OPENAI_SAMPLING_FIELDS),
    *OPENAI_STOP_FIELDS,
    Field("top_logprobs", "integer", "logprobs of the output tokens with this many alternatives",
          **TOP_LOGPROBS_LIMIT),
    Field("include", "array", f'"{_LOGPROBS_INCLUDE}" asks for output logprobs'),
    Field("text", "object", 'text.format: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
          '"name", "schema", "strict"}: the output is constrained to JSON / the schema'),
    Field("reasoning", "object", 'reasoning.effort: "none" turns the template\'s thinking off, any other effort '
          'on; where the core\'s prompt format takes an effort it is rendered, and one it does not know is a 400'),
    Field("chat_template_kwargs", "object", "template options the core allows (its template_options)"),
    Field("metadata", "object", "echoed in the response"),
    Field("parallel_tool_calls", "boolean", 'echoed in the response; false: a forced ("required") call is exactly '
          "one call", default=True),
    Field("truncation", "string", "echoed in the response"),
    Field("user", "string", "echoed in the response"),
    Field("store", "boolean", "responses are never stored (echoed as false)", use=Use.IGNORED),
))


# The openai SDK's `responses.input_tokens.count`: the prompt a Responses request with these fields
# would have, counted (fields that shape only the output are accepted and do not count).
INPUT_TOKENS_SPEC = RequestSpec("POST /v1/responses/input_tokens", (
    *(field for field in SPEC.fields if field.name in ("previous_response_id", "conversation", "model", "input",
                                                       "instructions", "tools", "reasoning", "chat_template_kwargs")),
    *(Field(name, kind, "accepted; it does not change the prompt", use=Use.IGNORED)
      for name, kind in (("tool_choice", "any"), ("text", "object"), ("parallel_tool_calls", "boolean"),
                         ("truncation", "string"), ("personality", "any"))),
))


@dataclass(frozen=True, kw_only=True)
class ResponsesCall(Call):
    echo: dict[str, Any]  # request settings every response object repeats


def _tools(raw: list | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters"}) in the template's shape."""
    if not raw:
        return None
    tools = []
    for index, tool in enumerate(raw):
        tool = as_object(tool, f"tools[{index}]")
        if tool.get("type") != "function":
            raise invalid(f"tools[{index}].type", f"only function tools are supported, got {tool.get('type')!r}")
        tools.append({"type": "function", "function": tool_function(tool, f"tools[{index}]")})
    return tools


def responses_messages(instructions: str | None, raw_input: Any) -> list[dict[str, Any]]:
    """Responses `instructions` + `input` (a string or a list of items) -> template messages."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(raw_input, str):
        messages.append({"role": "user", "content": raw_input})
        return messages
    if not isinstance(raw_input, list):
        raise invalid("input", f"must be a string or an array of input items, got {json_type(raw_input)}")
    pending_reasoning: str | None = None

    def assistant_message() -> dict[str, Any]:
        nonlocal pending_reasoning
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if pending_reasoning is not None:
            message["reasoning_content"], pending_reasoning = pending_reasoning, None
        messages.append(message)
        return message

    for index, item in enumerate(raw_input):
        where = f"input[{index}]"
        item = as_object(item, where)
        item_type = item.get("type") or ("message" if "role" in item else None)
        if item_type == "message":
            role = get_str(item, "role", where=f"{where}.role", required=True)
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(f"{where}.role", f"must be user, assistant, system or developer, got {role!r}")
            text = text_of_parts(item.get("content"), f"{where}.content", _TEXT_PARTS + ("refusal",))
            if role == "assistant":
                assistant_message()["content"] = text
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif item_type == "function_call":
            call = template_tool_call(
                get_str(item, "call_id", where=f"{where}.call_id", required=True),
                tool_name(item, "name", f"{where}.name"),
                tool_arguments(item.get("arguments"), f"{where}.arguments"))
            last = messages[-1] if messages else None
            target = last if last is not None and last["role"] == "assistant" and pending_reasoning is None \
                else assistant_message()
            target.setdefault("tool_calls", []).append(call)
        elif item_type == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool",
                             "tool_call_id": get_str(item, "call_id", where=f"{where}.call_id", required=True),
                             "content": text_of_parts(output, f"{where}.output", _TEXT_PARTS)})
        elif item_type == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            pending_reasoning = text_of_parts(parts, f"{where}.content", ("reasoning_text", "summary_text"))
        else:
            raise invalid(f"{where}.type", f"input items of type {item_type!r} are not supported "
                                           f"(supported: message, function_call, function_call_output, reasoning)")
    return messages


def _prompt(state: ServerState, values: dict[str, Any]) -> tuple[Prompt, list[dict[str, Any]] | None]:
    """The prompt of a Responses body's fields `values` (read by its spec), and its tools."""
    messages = responses_messages(values["instructions"], values["input"])
    tools = _tools(values["tools"])
    reasoning = values["reasoning"] or {}
    options = template_options(state.frontend, values["chat_template_kwargs"] or {},
                               thinking=thinking_switch(reasoning.get("effort"), "reasoning.effort"),
                               effort=("reasoning.effort", reasoning.get("effort")))
    return chat_prompt(state.frontend, messages, tools=tools, options=options), tools


def parse_responses_request(state: ServerState, body: dict[str, Any], request_id: str) -> ResponsesCall:
    frontend = state.frontend
    values = SPEC.read(body)
    model = resolve_model(state, values["model"])
    text_format = get_object(values["text"] or {}, "format", where="text.format")
    stream = values["stream"]
    prompt, tools = _prompt(state, values)
    parsed_tools, forced = read_tool_choice(body, tools, responses=True)
    grammar = one_spec(responses_format(text_format), tool_calls_spec(frontend, tools, forced))
    top_logprobs = values["top_logprobs"]
    include = values["include"] or []
    logprobs = top_logprobs is not None or _LOGPROBS_INCLUDE in include
    request, sampling = generation_request(frontend, body, prompt, request_id=request_id,
                                           max_tokens_fields=("max_output_tokens",), logprobs=logprobs,
                                           top_logprobs=top_logprobs or 0)
    request = constrained(frontend, request, grammar, prompt.text)
    echo = {
        "instructions": values["instructions"],
        "max_output_tokens": values["max_output_tokens"],
        "metadata": values["metadata"] or {},
        "parallel_tool_calls": values["parallel_tool_calls"],
        "temperature": sampling.params.temperature,
        "top_p": sampling.params.top_p,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": values["tools"] or [],
        "text": {"format": dict(text_format) if text_format is not None else {"type": "text"}},
        "reasoning": {"effort": (values["reasoning"] or {}).get("effort"), "summary": None},
        "truncation": values["truncation"] or "disabled",
        "store": False,
        "user": values["user"],
    }
    return ResponsesCall(model, stream, prompt, request, sampling, parsed_tools, echo=echo)


class ResponseBuilder:
    """Turns parsed output into Responses output items, sending stream events through `sink`."""

    def __init__(self, call: ResponsesCall, response_id: str, sink: EventSink = no_events):
        self._call = call
        self._sink = sink
        self._sequence = 0
        self.response_id = response_id
        self.created_at = int(time.time())
        self.output: list[dict[str, Any]] = []
        # The last output item receives deltas while this is set: ("reasoning"|"message", 0) or
        # ("function_call", index).
        self._open_key: tuple[str, int] | None = None

    async def start(self) -> None:
        await self._emit("response.created", response=self.response("in_progress"))
        await self._emit("response.in_progress", response=self.response("in_progress"))

    async def add(self, piece: Piece) -> None:
        delta = piece.delta
        if delta.reasoning:
            await self._switch(("reasoning", 0))
            await self._append_text(delta.reasoning, "response.reasoning_text.delta")
        if delta.content:
            await self._switch(("message", 0))
            await self._append_text(delta.content, "response.output_text.delta", piece.logprobs)
        for call in delta.tool_calls:
            await self._switch(("function_call", call.index), call.id, call.name)
            if call.arguments:
                self.output[-1]["arguments"] += call.arguments
                await self._emit("response.function_call_arguments.delta", item_id=self.output[-1]["id"],
                                 output_index=len(self.output) - 1, delta=call.arguments)

    async def finish(self, outcome: Outcome) -> dict[str, Any]:
        await self._close()
        if outcome.finish_reason == "error":
            response = self.response("failed", outcome.usage, error={
                "code": "server_error", "message": execution_error(outcome.error).message})
            await self._emit("response.failed", response=response)
        elif outcome.finish_reason in ("length", "cancelled"):
            details = {"reason": "max_output_tokens"} if outcome.finish_reason == "length" else None
            response = self.response("incomplete", outcome.usage, incomplete_details=details)
            await self._emit("response.incomplete", response=response)
        else:
            response = self.response("completed", outcome.usage)
            await self._emit("response.completed", response=response)
        return response

    def response(self, status: str, usage: Usage | None = None, *, error: dict[str, Any] | None = None,
                 incomplete_details: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self._call.model, "output": list(self.output), "error": error,
            "incomplete_details": incomplete_details, "usage": _usage_json(usage) if usage is not None else None,
            **self._call.echo,
        }

    async def _switch(self, key: tuple[str, int], call_id: str | None = None, name: str | None = None) -> None:
        if self._open_key == key:
            return
        await self._close()
        kind, _ = key
        item_id = f"{_ITEM_PREFIX[kind]}_{self.response_id.removeprefix('resp_')}_{len(self.output)}"
        if kind == "reasoning":
            item = {"id": item_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        elif kind == "message":
            item = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                    "status": "in_progress"}
            part = None
        self.output.append(item)
        self._open_key = key
        await self._emit("response.output_item.added", output_index=len(self.output) - 1, item=_snapshot(item))
        if part is not None:
            item["content"].append(part)
            await self._emit("response.content_part.added", item_id=item_id, output_index=len(self.output) - 1,
                             content_index=0, part=dict(part))

    async def _append_text(self, text: str, event_type: str, logprobs: tuple[TokenLogprob, ...] = ()) -> None:
        item = self.output[-1]
        part = item["content"][0]
        part["text"] += text
        fields: dict[str, Any] = {"item_id": item["id"], "output_index": len(self.output) - 1,
                                  "content_index": 0, "delta": text}
        if event_type == "response.output_text.delta":
            entries = chat_logprobs(logprobs)["content"] if self._call.request.logprobs else []
            part["logprobs"].extend(entries)
            fields["logprobs"] = entries
        await self._emit(event_type, **fields)

    async def _close(self) -> None:
        kind = self._open_key
        if kind is None:
            return
        self._open_key = None
        item = self.output[-1]
        item["status"] = "completed"
        output_index = len(self.output) - 1
        if kind[0] == "function_call":
            await self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=output_index,
                             arguments=item["arguments"], name=item["name"])
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind[0] == "reasoning" else "response.output_text.done"
            fields = {"logprobs": part["logprobs"]} if kind[0] == "message" else {}
            await self._emit(done, item_id=item["id"], output_index=output_index, content_index=0,
                             text=part["text"], **fields)
            await self._emit("response.content_part.done", item_id=item["id"], output_index=output_index,
                             content_index=0, part=dict(part))
        await self._emit("response.output_item.done", output_index=output_index, item=_snapshot(item))

    async def _emit(self, event_type: str, **fields: Any) -> None:
        event = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        await self._sink(event)


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    copy = dict(item)
    if "content" in copy:
        copy["content"] = [dict(part) for part in copy["content"]]
    return copy


def _usage_json(usage: Usage) -> dict[str, Any]:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


async def responses(request: web.Request) -> web.StreamResponse:
    call = await read_call(request, parse_responses_request)
    response_id = f"resp_{request[RECORD].request_id}"
    return await answer(request, call, lambda sink: [ResponseBuilder(call, response_id, sink)])


async def input_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]

    def count() -> tuple[str, Prompt]:
        values = INPUT_TOKENS_SPEC.read(json_body(request))
        return resolve_model(state, values["model"]), _prompt(state, values)[0]

    model, prompt = await state.prepare(count)
    request[RECORD].model = model
    request[RECORD].prompt_tokens = len(prompt.ids)
    return web.json_response({"object": "response.input_tokens", "input_tokens": len(prompt.ids)})


def add_routes(app: web.Application) -> None:
    add_post(app, "/v1/responses", responses)
    add_post(app, "/v1/responses/input_tokens", input_tokens)
