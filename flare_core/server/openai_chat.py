"""POST /v1/chat/completions (OpenAI Chat Completions, with vLLM's common extensions)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from flare_core.frontend.parsers import ParsedOutput, ToolCallDelta
from flare_core.requests import TokenLogprob
from flare_core.server.generation import Call, Framing, Outcome, Piece, answer, read_call, unfinished_error
from flare_core.server.openai_common import (ChoiceChunks, chat_logprobs, choice_builders, combine_choices,
                                             finish_reason, generation_request, object_head, read_choices, read_head,
                                             read_tool_choice, thinking_switch, usage_json)
from flare_core.server.prompts import chat_prompt, openai_messages, openai_tools, template_options
from flare_core.server.request_log import RECORD
from flare_core.server.sampling import OPENAI_SAMPLING_FIELDS
from flare_core.server.spec import (OPENAI_CHOICE_FIELDS, OPENAI_STOP_FIELDS, TOP_LOGPROBS_LIMIT, Field, RequestSpec,
                                    sampling_fields)
from flare_core.server.state import ServerState, add_post
from flare_core.server.structured import (GUIDED_FIELDS, RESPONSE_FORMAT_FIELD, constrained, guided_spec, one_spec,
                                          openai_response_format, tool_calls_spec)
from flare_core.server.validation import invalid


SPEC = RequestSpec("POST /v1/chat/completions", (
    Field("model", "string", "a served model name; absent: the first"),
    Field("messages", "array", "the conversation, rendered by the core's chat template", required=True),
    Field("tools", "array", "function tools: described by the chat template, or by Flare's generic format where "
          "the recipe declares none (see /v1/models tool_calls); calls parsed by the core's tool parser"),
    Field("tool_choice", "any", '"auto" (default), "none", "required" or {"type": "function", "function": {"name"}}: '
          "forced calls are written in the core's tool-call format, arguments constrained to the tool's schema",
          shape="string or object"),
    Field("parallel_tool_calls", "boolean", 'false: a forced ("required") call is exactly one call', default=True),
    Field("stream", "boolean", "stream chunks as server-sent events"),
    Field("stream_options", "object", "include_usage: a usage chunk ends the stream"),
    Field("max_completion_tokens", "integer", "at most this many output tokens; absent: the context's room",
          minimum=1),
    Field("max_tokens", "integer", "the older name of max_completion_tokens", minimum=1),
    *sampling_fields(OPENAI_SAMPLING_FIELDS),
    *OPENAI_STOP_FIELDS,
    *OPENAI_CHOICE_FIELDS,
    Field("logprobs", "boolean", "logprobs of the output tokens"),
    Field("top_logprobs", "integer", "alternatives per token (needs logprobs)", **TOP_LOGPROBS_LIMIT),
    RESPONSE_FORMAT_FIELD,
    *GUIDED_FIELDS,
    Field("reasoning_effort", "any", '"none" turns the template\'s thinking off, any other effort on; where the '
          'core\'s prompt format takes an effort (its template_options name reasoning_effort) the effort is '
          'rendered, and one the format does not know is a 400', shape="string"),
    Field("chat_template_kwargs", "object", "template options the core allows (its template_options)"),
    Field("continue_final_message", "boolean", "continue the final assistant message instead of a new turn"),
))


@dataclass(frozen=True, kw_only=True)
class ChatCall(Call):
    include_usage: bool  # a usage chunk ends the stream


def parse_chat_request(state: ServerState, body: dict[str, Any], request_id: str) -> ChatCall:
    """Validate a chat completions body and build its prompt and generation request."""
    frontend = state.frontend
    head = read_head(state, SPEC, body)
    values = head.values
    messages = openai_messages(values["messages"])
    tools = openai_tools(values["tools"])
    parsed_tools, forced = read_tool_choice(body, tools)
    grammar = one_spec(openai_response_format(values["response_format"]), guided_spec(body),
                       tool_calls_spec(frontend, tools, forced))
    options = template_options(frontend, values["chat_template_kwargs"] or {},
                               thinking=thinking_switch(values["reasoning_effort"], "reasoning_effort"),
                               effort=("reasoning_effort", values["reasoning_effort"]))
    prompt = chat_prompt(frontend, messages, tools=tools, options=options,
                         continue_final_message=values["continue_final_message"])
    logprobs, top_logprobs = values["logprobs"], values["top_logprobs"] or 0
    if top_logprobs and not logprobs:
        raise invalid("top_logprobs", "requires logprobs to be true")
    request, sampling = generation_request(frontend, body, prompt, request_id=request_id,
                                           max_tokens_fields=("max_completion_tokens", "max_tokens"),
                                           logprobs=logprobs, top_logprobs=top_logprobs, logit_bias=True)
    request = constrained(frontend, request, grammar, prompt.text)
    return ChatCall(head.model, head.stream, prompt, request, sampling, parsed_tools,
                    read_choices(state, values["n"]), include_usage=head.include_usage)


def tool_calls_json(output: ParsedOutput) -> list[dict[str, Any]] | None:
    if not output.tool_calls:
        return None
    return [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in output.tool_calls]


def tool_call_deltas_json(deltas: tuple[ToolCallDelta, ...]) -> list[dict[str, Any]]:
    """Streamed tool calls: the first piece of a call carries id, type and name; later pieces
    carry argument text only (the shape the openai SDK accumulates)."""
    pieces = []
    for delta in deltas:
        if delta.name is not None:  # a call's first piece: its name and (openai_call_id) its id
            pieces.append({"index": delta.index, "id": delta.id, "type": "function",
                           "function": {"name": delta.name, "arguments": delta.arguments}})
        elif delta.arguments:
            pieces.append({"index": delta.index, "function": {"arguments": delta.arguments}})
    return pieces


class ChatBuilder:
    """Choice `index` of a chat completion: its chunks through `chunks` while it streams, a
    chat.completion object of this choice at the end."""

    def __init__(self, call: ChatCall, completion_id: str, created: int, chunks: ChoiceChunks, index: int = 0):
        self._call = call
        self._head = object_head(completion_id, "chat.completion", created, call.model)
        self._chunks = chunks
        self._index = index
        self._output = ParsedOutput()
        self._logprobs: list[TokenLogprob] = []

    async def start(self) -> None:
        await self._chunks.chunk({"role": "assistant", "content": ""}, index=self._index)

    async def add(self, piece: Piece) -> None:
        self._output.add(piece.delta)
        self._logprobs.extend(piece.logprobs)
        delta = _delta_json(piece)
        if delta or piece.logprobs:
            await self._chunks.chunk(delta, index=self._index,
                                     logprobs=chat_logprobs(piece.logprobs) if self._call.request.logprobs else None)

    async def finish(self, outcome: Outcome) -> dict[str, Any]:
        tool_calls = tool_calls_json(self._output)
        await self._chunks.finish(outcome, {}, bool(tool_calls), index=self._index)
        if unfinished_error(outcome) is not None:  # reported on the stream; nothing else is answered
            return {}
        output = self._output
        message = {"role": "assistant", "content": output.content if output.content or not tool_calls else None,
                   "reasoning_content": output.reasoning or None, "tool_calls": tool_calls}
        choice = {"index": self._index, "message": message,
                  "logprobs": chat_logprobs(self._logprobs) if self._call.request.logprobs else None,
                  "finish_reason": finish_reason(outcome.finish_reason, bool(tool_calls)),
                  "stop_reason": outcome.stop}
        return {**self._head, "choices": [choice], "usage": usage_json(outcome.usage)}


async def chat_completions(request: web.Request) -> web.StreamResponse:
    call = await read_call(request, parse_chat_request)
    completion_id, created = f"chatcmpl-{request[RECORD].request_id}", int(time.time())
    return await answer(request, call, lambda sink: choice_builders(ChatBuilder, call, completion_id, created, sink,
                                                                    "chat.completion.chunk", "delta"),
                        framing=Framing.SSE, combine=combine_choices)


def _delta_json(piece: Piece) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if piece.delta.reasoning:
        delta["reasoning_content"] = piece.delta.reasoning
    if piece.delta.content:
        delta["content"] = piece.delta.content
    tool_calls = tool_call_deltas_json(piece.delta.tool_calls)
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return delta


def add_routes(app: web.Application) -> None:
    add_post(app, "/v1/chat/completions", chat_completions)
