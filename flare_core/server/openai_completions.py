"""POST /v1/completions (OpenAI legacy Completions): a raw prompt, no chat template, no parsers.

`echo` with `logprobs` returns the prompt tokens' logprobs too (the first token, which nothing
predicts, with nulls), and `max_tokens: 0` with `echo` scores the prompt without generating:
what log-likelihood evaluation (lm-evaluation-harness) sends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from flare_core.frontend import Frontend
from flare_core.runtime.types import MAX_TOP_LOGPROBS, GenerationRequest
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
from flare_core.server.state import STATE, ServerState
from flare_core.server.validation import get_bool, get_int, get_str, invalid, json_body, json_type


@dataclass(frozen=True)
class CompletionCall:
    model: str
    stream: bool
    include_usage: bool
    echo: str  # prompt text to put before the completion ("" without echo)
    first_token: str | None  # with echoed logprobs: the prompt's first token, which has none
    request: GenerationRequest
    sampling: Sampling


def read_prompt(frontend: Frontend, value: Any) -> Prompt:
    """A prompt given as a string or as token ids; a batch of one is accepted (n=1 only)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return text_prompt(frontend, value)
    if isinstance(value, list) and all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        return token_prompt(frontend, value, "prompt")
    if value is None:
        raise invalid("prompt", "is required")
    if isinstance(value, list):
        raise invalid("prompt", "must be one prompt (a string or an array of token ids); batches are not supported")
    raise invalid("prompt", f"must be a string or an array of token ids, got {json_type(value)}")


def parse_completion_request(state: ServerState, body: dict[str, Any], request_id: str) -> CompletionCall:
    frontend = state.frontend
    model = resolve_model(state, get_str(body, "model"))
    check_single_choice(body)
    if body.get("suffix"):
        raise invalid("suffix", "is not supported by this server")
    stream = get_bool(body, "stream")
    include_usage = read_stream_options(body, stream)
    prompt = read_prompt(frontend, body.get("prompt"))
    top_logprobs = get_int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    echoed = get_bool(body, "echo")
    if not echoed and body.get("max_tokens") == 0:
        raise invalid("max_tokens", "must be at least 1; 0 is allowed only with echo (scoring the prompt)")
    # Echo with logprobs scores the prompt tokens; max_tokens 0 is scoring alone.
    scoring = echoed and (top_logprobs is not None or body.get("max_tokens") == 0)
    request, sampling = generation_request(frontend, body, prompt, request_id=request_id,
                                           max_tokens_fields=("max_tokens",), logprobs=top_logprobs is not None,
                                           top_logprobs=top_logprobs or 0,
                                           prompt_logprobs=(top_logprobs or 0) if scoring else None,
                                           min_max_tokens=0 if echoed else 1)
    echo, first_token = "", None
    if echoed:
        echo = prompt.text or frontend.tokenizer.decode(prompt.ids)
        if top_logprobs is not None:
            first_token = frontend.tokenizer.decode([prompt.ids[0]])
    return CompletionCall(model, stream, include_usage, echo, first_token, request, sampling)


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
    logprobs = None
    if call.request.logprobs:
        logprobs = completion_logprobs(collected.prompt_logprobs + collected.logprobs, 0, call.first_token) \
            if call.first_token is not None else completion_logprobs(collected.logprobs, len(call.echo))
    choice = {"index": 0, "text": call.echo + collected.output.content, "logprobs": logprobs,
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
    # With echoed logprobs the echo chunk waits for the prompt's scores, which come first.
    scored: list = []
    owed = len(call.request.prompt_ids) - 1 if call.first_token is not None else 0
    if call.echo and not owed:
        logprobs = completion_logprobs([], 0, call.first_token) if call.first_token is not None else None
        await chunks.chunk(call.echo, logprobs=logprobs)
        offset = len(call.echo)
    async for piece in generation.pieces():
        scored.extend(piece.prompt_logprobs)
        if owed and len(scored) >= owed:
            await chunks.chunk(call.echo, logprobs=completion_logprobs(scored, 0, call.first_token))
            offset, owed = len(call.echo), 0
        if not (piece.delta or piece.logprobs):
            continue
        text = piece.delta.content
        logprobs = completion_logprobs(piece.logprobs, offset) if call.request.logprobs else None
        offset += len(text)
        await chunks.chunk(text, logprobs=logprobs)
    return await chunks.finish(generation.outcome, "", False)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
