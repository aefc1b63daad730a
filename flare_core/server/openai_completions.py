"""POST /v1/completions (OpenAI legacy Completions): a raw prompt, no chat template, no parsers."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from flare_core.runtime.types import GenerationRequest
from flare_core.server.generation import Generation
from flare_core.server.models import resolve_model
from flare_core.server.openai_common import (
    ChoiceStream,
    check_single_choice,
    completion_logprobs,
    finish_reason,
    generation_request,
    object_head,
    read_stream_options,
    usage_json,
)
from flare_core.server.prompts import Prompt, text_prompt, token_prompt
from flare_core.server.request_log import RECORD
from flare_core.server.sampling import Sampling
from flare_core.server.state import STATE, Engine, ServerState
from flare_core.server.validation import get_bool, get_int, get_str, invalid, json_body, json_type


@dataclass(frozen=True)
class CompletionCall:
    model: str
    stream: bool
    include_usage: bool
    echo: str  # prompt text to put before the completion ("" without echo)
    request: GenerationRequest
    sampling: Sampling


def read_prompt(engine: Engine, value: Any) -> Prompt:
    """A prompt given as a string or as token ids; a batch of one is accepted (n=1 only)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return text_prompt(engine, value)
    if isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return token_prompt(engine, value, "prompt")
    if value is None:
        raise invalid("prompt", "is required")
    if isinstance(value, list):
        raise invalid("prompt", "must be one prompt (a string or an array of token ids); batches are not supported")
    raise invalid("prompt", f"must be a string or an array of token ids, got {json_type(value)}")


def parse_completion_request(state: ServerState, body: dict[str, Any], request_id: str) -> CompletionCall:
    engine = state.engine
    model = resolve_model(state, get_str(body, "model"))
    check_single_choice(body)
    if body.get("suffix"):
        raise invalid("suffix", "is not supported by this server")
    stream = get_bool(body, "stream")
    include_usage = read_stream_options(body, stream)
    prompt = read_prompt(engine, body.get("prompt"))
    top_logprobs = get_int(body, "logprobs", minimum=0, maximum=20)
    request, sampling = generation_request(engine, body, prompt, request_id=request_id,
                                           max_tokens_fields=("max_tokens",), logprobs=top_logprobs is not None,
                                           top_logprobs=top_logprobs or 0)
    echo = ""
    if get_bool(body, "echo"):
        echo = prompt.text or engine.tokenizer.decode(prompt.ids)
    return CompletionCall(model, stream, include_usage, echo, request, sampling)


async def completions(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    record = request[RECORD]
    call = await state.prepare(lambda: parse_completion_request(state, json_body(request), record.request_id))
    record.model, record.stream = call.model, call.stream
    generation = Generation(state, record, call.request)
    completion_id = f"cmpl-{record.request_id}"
    created = int(time.time())
    async with generation:
        if call.stream:
            return await _stream(request, call, generation, completion_id, created)
        collected = await generation.collect()
    outcome = generation.outcome
    choice = {"index": 0, "text": call.echo + collected.output.content,
              "logprobs": completion_logprobs(collected.logprobs, len(call.echo)) if call.request.logprobs else None,
              "finish_reason": finish_reason(outcome.finish_reason, False), "stop_reason": outcome.stop}
    return web.json_response({**object_head(completion_id, "text_completion", created, call.model),
                              "choices": [choice], "usage": usage_json(outcome.usage)},
                             headers=call.sampling.headers())


async def _stream(request: web.Request, call: CompletionCall, generation: Generation, completion_id: str,
                  created: int) -> web.StreamResponse:
    chunks = ChoiceStream(request, call.sampling.headers(),
                          object_head(completion_id, "text_completion", created, call.model), "text",
                          call.include_usage)
    await chunks.open()
    # Logprob text offsets count characters of the whole text, echoed prompt included.
    offset = 0
    if call.echo:
        await chunks.chunk(call.echo)
        offset = len(call.echo)
    async for piece in generation.pieces():
        text = piece.delta.content
        logprobs = completion_logprobs(piece.logprobs, offset) if call.request.logprobs else None
        offset += len(text)
        await chunks.chunk(text, logprobs=logprobs)
    return await chunks.finish(generation.outcome, "", False)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
