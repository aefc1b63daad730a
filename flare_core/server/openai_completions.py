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
from flare_core.requests import TokenLogprob
from flare_core.server.generation import Call, Framing, Outcome, Piece, answer, read_call, unfinished_error
from flare_core.server.openai_common import (ChoiceChunks, choice_builders, combine_choices, completion_logprobs,
                                             finish_reason, generation_request, object_head, read_choices, read_head,
                                             usage_json)
from flare_core.server.prompts import Prompt, text_prompt, token_prompt
from flare_core.server.request_log import RECORD
from flare_core.server.sampling import OPENAI_SAMPLING_FIELDS
from flare_core.server.spec import (OPENAI_CHOICE_FIELDS, OPENAI_STOP_FIELDS, TOP_LOGPROBS_LIMIT, Field, RequestSpec,
                                    Use, sampling_fields)
from flare_core.server.state import ServerState, add_post
from flare_core.server.structured import (GUIDED_FIELDS, RESPONSE_FORMAT_FIELD, constrained, guided_spec, one_spec,
                                          openai_response_format)
from flare_core.server.validation import invalid, is_integers, json_type


# "max_tokens: integer or null. Optional. Defaults to 16" (OpenAI API reference, Completions,
# https://platform.openai.com/docs/api-reference/completions/create). A client that sends none
# gets a short completion, not the whole context (a 4,092-token generation timed out the SDK).
DEFAULT_MAX_TOKENS = 16

SPEC = RequestSpec("POST /v1/completions", (
    Field("model", "string", "a served model name; absent: the first"),
    Field("prompt", "any", "one prompt, as text or token ids (a batch of one is accepted)", required=True,
          shape="string or array"),
    Field("stream", "boolean", "stream chunks as server-sent events"),
    Field("stream_options", "object", "include_usage: a usage chunk ends the stream"),
    Field("max_tokens", "integer", "at most this many output tokens, at least 1 (0 only with echo: scoring the "
          f"prompt); absent: {DEFAULT_MAX_TOKENS}, OpenAI's default for this route (or the context's room if less)"),
    *sampling_fields(OPENAI_SAMPLING_FIELDS),
    *OPENAI_STOP_FIELDS,
    *OPENAI_CHOICE_FIELDS,
    Field("logprobs", "integer", "logprobs of the output tokens with this many alternatives",
          **TOP_LOGPROBS_LIMIT),
    Field("echo", "boolean", "put the prompt before the output (with logprobs: the prompt's logprobs too)"),
    Field("suffix", "string", "is not supported by this server", use=Use.REFUSED),
    RESPONSE_FORMAT_FIELD,
    *GUIDED_FIELDS,
))


@dataclass(frozen=True, kw_only=True)
class CompletionCall(Call):
    include_usage: bool  # a usage chunk ends the stream
    echo: str  # prompt text to put before the completion ("" without echo)
    first_token: str | None  # with echoed logprobs: the prompt's first token, which has none


def read_prompt(frontend: Frontend, value: Any) -> Prompt:
    """A prompt given as a string or as token ids; a batch of one is accepted (n=1 only)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return text_prompt(frontend, value)
    if isinstance(value, list) and is_integers(value):
        return token_prompt(frontend, value, "prompt")
    if value is None:
        raise invalid("prompt", "is required")
    if isinstance(value, list):
        raise invalid("prompt", "must be one prompt (a string or an array of token ids); batches are not supported")
    raise invalid("prompt", f"must be a string or an array of token ids, got {json_type(value)}")


def parse_completion_request(state: ServerState, body: dict[str, Any], request_id: str) -> CompletionCall:
    frontend = state.frontend
    head = read_head(state, SPEC, body)
    values = head.values
    prompt = read_prompt(frontend, values["prompt"])
    grammar = one_spec(openai_response_format(values["response_format"]), guided_spec(body))
    top_logprobs = values["logprobs"]
    echoed = values["echo"]
    if not echoed and body.get("max_tokens") == 0:
        raise invalid("max_tokens", "must be at least 1; 0 is allowed only with echo (scoring the prompt)")
    # Echo with logprobs scores the prompt tokens; max_tokens 0 is scoring alone.
    scoring = echoed and (top_logprobs is not None or body.get("max_tokens") == 0)
    request, sampling = generation_request(frontend, body, prompt, request_id=request_id,
                                           max_tokens_fields=("max_tokens",), logprobs=top_logprobs is not None,
                                           top_logprobs=top_logprobs or 0,
                                           prompt_logprobs=(top_logprobs or 0) if scoring else None,
                                           min_max_tokens=0 if echoed else 1, logit_bias=True,
                                           default_max_tokens=DEFAULT_MAX_TOKENS)
    # A raw prompt opens no reasoning block a grammar would wait for.
    request = constrained(frontend, request, grammar, None)
    echo, first_token = "", None
    if echoed:
        echo = prompt.text or frontend.tokenizer.decode(prompt.ids)
        if top_logprobs is not None:
            first_token = frontend.tokenizer.decode([prompt.ids[0]])
    return CompletionCall(head.model, head.stream, prompt, request, sampling, choices=read_choices(state, values["n"]),
                          include_usage=head.include_usage, echo=echo, first_token=first_token)


class CompletionBuilder:
    """Choice `index` of a legacy completion: its chunks through `chunks` while it streams, a
    text_completion object of this choice at the end. Logprob text offsets count characters of
    the whole text, echoed prompt included; with echoed logprobs the echo waits for the prompt's
    scores, which come first."""

    def __init__(self, call: CompletionCall, completion_id: str, created: int, chunks: ChoiceChunks,
                 index: int = 0):
        self._call = call
        self._head = object_head(completion_id, "text_completion", created, call.model)
        self._chunks = chunks
        self._index = index
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._scored: list[TokenLogprob] = []
        self._offset = 0
        self._owed = len(call.request.prompt_ids) - 1 if call.first_token is not None else 0

    async def start(self) -> None:
        call = self._call
        if call.echo and not self._owed:
            logprobs = completion_logprobs([], 0, call.first_token) if call.first_token is not None else None
            await self._chunks.chunk(call.echo, index=self._index, logprobs=logprobs)
            self._offset = len(call.echo)

    async def add(self, piece: Piece) -> None:
        call = self._call
        self._scored.extend(piece.prompt_logprobs)
        self._logprobs.extend(piece.logprobs)
        self._text.append(piece.delta.content)
        if self._owed and len(self._scored) >= self._owed:
            await self._chunks.chunk(call.echo, index=self._index,
                                     logprobs=completion_logprobs(self._scored, 0, call.first_token))
            self._offset, self._owed = len(call.echo), 0
        if not (piece.delta or piece.logprobs):
            return
        text = piece.delta.content
        logprobs = completion_logprobs(piece.logprobs, self._offset) if call.request.logprobs else None
        self._offset += len(text)
        await self._chunks.chunk(text, index=self._index, logprobs=logprobs)

    async def finish(self, outcome: Outcome) -> dict[str, Any]:
        await self._chunks.finish(outcome, "", False, index=self._index)
        if unfinished_error(outcome) is not None:  # reported on the stream; nothing else is answered
            return {}
        call, logprobs = self._call, None
        if call.request.logprobs:
            logprobs = completion_logprobs(self._scored + self._logprobs, 0, call.first_token) \
                if call.first_token is not None else completion_logprobs(self._logprobs, len(call.echo))
        choice = {"index": self._index, "text": call.echo + "".join(self._text), "logprobs": logprobs,
                  "finish_reason": finish_reason(outcome.finish_reason, False), "stop_reason": outcome.stop}
        return {**self._head, "choices": [choice], "usage": usage_json(outcome.usage)}


async def completions(request: web.Request) -> web.StreamResponse:
    call = await read_call(request, parse_completion_request)
    completion_id, created = f"cmpl-{request[RECORD].request_id}", int(time.time())
    # A raw prompt: no chat template opened anything, so no parser reads the output.
    return await answer(request, call, lambda sink: choice_builders(CompletionBuilder, call, completion_id, created,
                                                                    sink, "text_completion", "text"),
                        framing=Framing.SSE, parsed=False, combine=combine_choices)


def add_routes(app: web.Application) -> None:
    add_post(app, "/v1/completions", completions)
