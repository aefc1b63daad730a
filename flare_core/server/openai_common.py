"""What the OpenAI-style routes share: generation fields, usage, finish reasons and logprobs."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from flare_core.frontend import Frontend
from flare_core.requests import GenerationRequest, TokenLogprob, Usage
from flare_core.server.generation import INTERRUPTED, EventSink, Outcome, choices_usage, execution_error
from flare_core.server.models import resolve_model
from flare_core.server.prompts import Prompt, fit_max_tokens
from flare_core.server.sampling import (OPENAI_SAMPLING_FIELDS, Sampling, read_logit_bias, read_max_tokens,
                                        read_sampling, read_stop, read_token_ids)
from flare_core.server.spec import RequestSpec
from flare_core.server.structured import ForcedCalls, forced_calls
from flare_core.server.state import ServerState
from flare_core.server.validation import get_bool, get_object, invalid


B = TypeVar("B")  # a choice builder

def generation_request(frontend: Frontend, body: Mapping[str, Any], prompt: Prompt, *, request_id: str,
                       max_tokens_fields: tuple[str, ...], logprobs: bool = False,
                       top_logprobs: int = 0, prompt_logprobs: int | None = None,
                       min_max_tokens: int = 1, logit_bias: bool = False,
                       default_max_tokens: int | None = None) -> tuple[GenerationRequest, Sampling]:
    """The GenerationRequest an OpenAI-style body describes (vLLM's extra sampling fields included;
    `logit_bias` on the routes that define it). Without a max-tokens field the budget is
    `default_max_tokens` where the route has one (at most the context's room), else the room."""
    sampling = read_sampling(frontend.sampling_policy, body, OPENAI_SAMPLING_FIELDS)
    requested, field = read_max_tokens(body, max_tokens_fields, minimum=min_max_tokens)
    max_tokens = fit_max_tokens(len(prompt.ids), requested, field, frontend.context_length)
    if requested is None and default_max_tokens is not None:
        max_tokens = min(max_tokens, default_max_tokens)
    request = GenerationRequest(
        prompt_ids=prompt.ids,
        max_tokens=max_tokens,
        sampling=sampling.params,
        stop_strings=read_stop(body, "stop"),
        stop_token_ids=read_token_ids(body, "stop_token_ids", frontend.tokenizer.vocab_size),
        ignore_eos=get_bool(body, "ignore_eos"),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        message_ends=prompt.message_ends,
        skip_special_tokens=get_bool(body, "skip_special_tokens", default=True),
        request_id=request_id,
        logit_bias=read_logit_bias(body, "logit_bias", frontend.tokenizer.vocab_size) if logit_bias else (),
    )
    return request, sampling


def read_choices(state: ServerState, n: int | None) -> int:
    """OpenAI's `n` (default 1). Every choice is admitted at once, so at most what the server
    admits: its max_concurrency + queue_capacity."""
    n = 1 if n is None else n
    info = state.engine.info
    room = info.max_concurrency + info.queue_capacity
    if n > room:
        raise invalid("n", f"must be at most {room} here (max_concurrency {info.max_concurrency} + queue_capacity "
                           f"{info.queue_capacity}: every choice is admitted at once), got {n}")
    return n


@dataclass(frozen=True)
class RequestHead:
    """What every OpenAI chat or legacy completion body starts with: its fields as `spec` read
    them (each checked once, defaults applied), the served model it names, whether it streams and
    whether its stream ends with a usage chunk."""

    values: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool


def read_head(state: ServerState, spec: RequestSpec, body: dict[str, Any]) -> RequestHead:
    values = spec.read(body)
    stream = values["stream"]
    return RequestHead(values, resolve_model(state, values["model"]), stream, read_stream_options(body, stream))


def read_stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
    options = get_object(body, "stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    return get_bool(options, "include_usage", where="stream_options.include_usage")


def usage_json(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def finish_reason(runtime_reason: str, tool_calls: bool) -> str:
    """OpenAI finish reasons of complete generations."""
    if runtime_reason in ("error", "cancelled"):
        raise ValueError(f"a {runtime_reason} generation has no OpenAI finish reason; answer it as an error")
    if runtime_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def object_head(object_id: str, object_type: str, created: int, model: str) -> dict[str, Any]:
    """The fields every (chat) completion object and chunk starts with."""
    return {"id": object_id, "object": object_type, "created": created, "model": model, "system_fingerprint": None}


def choice_builders(builder: Callable[[Any, str, int, ChoiceChunks, int], B], call: Any, completion_id: str,
                    created: int, sink: EventSink, chunk_object: str, content_key: str) -> list[B]:
    """One `builder` per choice of `call` (a chat or legacy completion), streaming through one
    ChoiceChunks of `chunk_object` chunks whose choices carry `content_key` ("delta" / "text")."""
    chunks = ChoiceChunks(object_head(completion_id, chunk_object, created, call.model), content_key,
                          call.include_usage, sink, call.choices)
    return [builder(call, completion_id, created, chunks, index) for index in range(call.choices)]


class ChoiceChunks:
    """The stream events of a (chat) completion's `choices` choices, sent through `sink`: each
    choice's chunks and finish chunk; once every choice has finished, the usage chunk when asked
    for and "[DONE]". An execution error or a shutdown ends the stream with an error chunk."""

    def __init__(self, head: dict[str, Any], content_key: str, include_usage: bool, sink: EventSink,
                 choices: int = 1):
        self._head = head
        self._content_key = content_key  # "delta" (chat) or "text" (completions)
        self._include_usage = include_usage
        self._sink = sink
        self._choices = choices
        self._finished: list[Outcome] = []

    async def chunk(self, content: Any, *, index: int, finish: str | None = None, logprobs: Any = None) -> None:
        data = {**self._head, "choices": [{"index": index, self._content_key: content, "logprobs": logprobs,
                                           "finish_reason": finish}]}
        if self._include_usage:
            data["usage"] = None
        await self._sink(data)

    async def finish(self, outcome: Outcome, last_content: Any, tool_calls: bool, *, index: int) -> None:
        if outcome.finish_reason == "error":
            await self._sink(error_chunk(execution_error(outcome.error).message))
        elif outcome.finish_reason == "cancelled":  # cut short by shutdown
            await self._sink(error_chunk(INTERRUPTED.message, INTERRUPTED.code))
        else:
            await self.chunk(last_content, index=index, finish=finish_reason(outcome.finish_reason, tool_calls))
            self._finished.append(outcome)
            if len(self._finished) < self._choices:
                return
            if self._include_usage:
                await self._sink({**self._head, "choices": [], "usage": usage_json(choices_usage(self._finished))})
            await self._sink("[DONE]")


def combine_choices(objects: Sequence[dict[str, Any]], outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """One (chat) completion of several choices' objects: every choice, the prompt counted once."""
    return {**objects[0], "choices": [choice for o in objects for choice in o["choices"]],
            "usage": usage_json(choices_usage(outcomes))}


def error_chunk(message: str, code: str = "execution_failed") -> dict[str, Any]:
    """The body of the SSE event that reports a failure mid-stream (the openai SDK raises on it)."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    return {"content": [
        {"token": item.token, "logprob": item.logprob, "bytes": _token_bytes(item.token),
         "top_logprobs": [{"token": text, "logprob": value, "bytes": _token_bytes(text)}
                          for _, text, value in item.top]}
        for item in logprobs], "refusal": None}


def completion_logprobs(logprobs: Sequence[TokenLogprob], text_offset: int,
                        first_token: str | None = None) -> dict[str, Any]:
    """Legacy completions logprobs; offsets count characters from `text_offset`. `first_token`
    (an echoed prompt's first token, which nothing predicts) leads with null logprobs."""
    tokens = ([first_token] if first_token is not None else []) + [item.token for item in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    lead = [None] if first_token is not None else []
    return {"tokens": tokens,
            "token_logprobs": lead + [item.logprob for item in logprobs],
            "top_logprobs": lead + [{text: value for _, text, value in item.top} for item in logprobs],
            "text_offset": offsets}


def read_tool_choice(body: Mapping[str, Any], tools: Sequence[Mapping[str, Any]] | None, *,
                     responses: bool = False) -> tuple[tuple[Mapping[str, Any], ...], ForcedCalls | None]:
    """OpenAI's `tool_choice`: the tools whose calls are parsed out of the output (those offered;
    none with "none"), and the calls it forces: "required" (one or more of the tools; exactly one with
    `parallel_tool_calls: false`) or a named function (Chat Completions:
    {"type": "function", "function": {"name"}}; Responses: {"type": "function", "name"})."""
    choice = body.get("tool_choice")
    names = [tool["function"]["name"] for tool in tools or ()]
    offered = tuple(tools or ())
    if choice is None or choice == "auto":
        return offered, None
    if choice == "none":
        return (), None
    if choice == "required":
        return offered, forced_calls(names, None, "tool_choice", one=body.get("parallel_tool_calls") is False)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice if responses else choice.get("function")
        field = "tool_choice.name" if responses else "tool_choice.function.name"
        name = function.get("name") if isinstance(function, Mapping) else None
        if name is None:
            raise invalid(field, "is required: the function to call")
        return offered, forced_calls(names, name, field)
    raise invalid("tool_choice", f'must be "auto", "none", "required" or a named function, got '
                                 f"{json.dumps(choice)[:80]}")


def thinking_switch(effort: Any, field: str) -> bool | None:
    """OpenAI's reasoning effort as the template's thinking switch: "none" turns it off, any
    other effort on, absent leaves the core's default."""
    if effort is None:
        return None
    if not isinstance(effort, str):
        raise invalid(field, "must be a string")
    return effort != "none"
