"""One request's generation as the protocol adapters see it: submitted to the engine, its text
run through the recipe's reasoning/tool parsers, ended by an outcome (finish reason + usage).

Used as an async context manager: leaving the context before the final event (client gone,
handler cancelled, shutdown) cancels the engine request, which frees its slot.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import structlog
from aiohttp import web

from flare_core.frontend import Frontend
from flare_core.frontend.parsers import OutputParser, ParsedDelta, prompt_opens_reasoning
from flare_core.requests import AdmissionError, GenerationRequest, TokenLogprob, Usage
from flare_core.server.errors import ApiError
from flare_core.server.prompts import Prompt
from flare_core.server.request_log import RECORD, RequestRecord
from flare_core.server.sampling import Sampling
from flare_core.server.sse import EventStream
from flare_core.server.uploads import client_of
from flare_core.server.state import STATE, RequestStream, ServerState
from flare_core.server.validation import json_body


_log = structlog.get_logger("flare.server")


@dataclass(frozen=True)
class Piece:
    """Newly parsed output and the logprobs of the tokens that produced it."""

    delta: ParsedDelta
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # requests that score their prompt
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (known from the first token on)


@dataclass(frozen=True)
class Call:
    """A generation request a route has validated: what its handler needs to answer it. Routes
    with more to carry (stream options, echoed settings) subclass it."""

    model: str  # the served name the response reports
    stream: bool
    prompt: Prompt
    request: GenerationRequest
    sampling: Sampling
    # The request's tools (OpenAI's function shape) whose calls are parsed out of the output;
    # empty: no tool-call parsing.
    tools: tuple[Mapping[str, Any], ...] = ()
    choices: int = 1  # independent outputs of the prompt (OpenAI's `n`)


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # the runtime's: "stop", "length", "cancelled", "error"
    usage: Usage
    stop: str | int | None = None
    # Of a failed generation, what its client is told: the request id under which the server log
    # holds the cause. Never the cause itself (it can name internals: source paths, allocator state).
    error: str | None = None


def choice_requests(request: GenerationRequest, choices: int) -> list[GenerationRequest]:
    """The requests of `choices` outputs of one prompt: choice i > 0 has its own request id and,
    when seeded, seed + i (as vLLM derives them; wrapping within 64 bits), so that seeded choices
    differ yet repeat."""
    seed = request.sampling.seed

    def choice_seed(i: int) -> int | None:
        return None if seed is None else (seed + i + 2**63) % 2**64 - 2**63

    return [request] + [replace(request, request_id=f"{request.request_id}.{i}",
                                sampling=replace(request.sampling, seed=choice_seed(i)))
                        for i in range(1, choices)]


def choices_usage(outcomes: Sequence[Outcome]) -> Usage:
    """Usage of a request with several choices: its prompt once (with the first choice's cache
    reuse: the others restore what it computed), every choice's output."""
    first = outcomes[0].usage
    return Usage(first.prompt_tokens, sum(o.usage.completion_tokens for o in outcomes), first.cached_tokens)


def execution_error(message: str | None) -> ApiError:
    """A generation that failed while running (its outcome's `error`, which names no internals)."""
    return ApiError(500, f"generation failed: {message or 'execution error'}")


# A response cut short by shutdown is never passed off as complete: non-streaming requests get
# this 503 (SDKs retry it), streams end with their protocol's error event carrying its message.
INTERRUPTED = ApiError(503, "the server shut down before this response was complete; retry the request",
                       code="server_shutdown")


def unfinished_error(outcome: Outcome) -> ApiError | None:
    """The error a non-streaming response answers for an outcome that is not a complete
    generation (execution failure, shutdown), or None."""
    if outcome.finish_reason == "error":
        return execution_error(outcome.error)
    if outcome.finish_reason == "cancelled":
        return INTERRUPTED
    return None


def output_parser(frontend: Frontend, prompt_text: str | None,
                  tools: Sequence[Mapping[str, Any]] = ()) -> OutputParser:
    """The recipe's parsers for one chat-style request: reasoning always (when the recipe names
    one), tool calls only when the request's `tools` are parsed for (handed to a parser that
    types argument values by their schemas). `prompt_text` tells the reasoning parser whether the
    template already opened a reasoning block."""
    reasoning = None
    if frontend.reasoning_parser is not None:
        opened = prompt_text is not None and prompt_opens_reasoning(prompt_text)
        reasoning = frontend.reasoning_parser.factory(starts_in_reasoning=opened)
    tool = None
    if tools and frontend.tool_parser is not None:
        parser = frontend.tool_parser
        tool = parser.factory(tools=tuple(tools)) if parser.reads_tools else parser.factory()
    return OutputParser(reasoning=reasoning, tool=tool)


def openai_call_id(written: str | None) -> str:
    """A tool call's id in OpenAI's form: the one the model wrote (Kimi K2's `functions.NAME:0`,
    which its template shows back to it), else `call_` and 24 hex digits."""
    return written or "call_" + secrets.token_hex(12)


def anthropic_call_id(written: str | None) -> str:
    """A tool_use block's id in Anthropic's form: `toolu_` and the model's id or 24 hex digits."""
    return "toolu_" + (written or secrets.token_hex(12))


# A protocol's tool call ids: from the id the model wrote (None: it wrote none).
CallIds = Callable[[str | None], str]


def with_call_ids(delta: ParsedDelta, call_ids: CallIds) -> ParsedDelta:
    """`delta` with each call's first piece (the one that names it) given its id in the
    protocol's form."""
    if not any(call.name is not None for call in delta.tool_calls):
        return delta
    return replace(delta, tool_calls=tuple(replace(call, id=call_ids(call.id)) if call.name is not None else call
                                           for call in delta.tool_calls))


class Generation:
    def __init__(self, state: ServerState, record: RequestRecord, request: GenerationRequest,
                 parser: OutputParser | None = None, leader: Generation | None = None,
                 call_ids: CallIds = openai_call_id):
        self._state = state
        self._call_ids = call_ids  # parsers report the ids models write; the protocol mints the rest
        self._leader = leader  # another choice of the same prompt, entered first: this one reuses its prefill
        self._record = record
        self._parser = parser or OutputParser()
        # Parsers read their markers (<think>, DeepSeek's and Kimi's tool-call tokens) as text, and
        # some tokenizers flag them special: keep special tokens in the text the parsers see.
        self._request = replace(request, skip_special_tokens=False) if self._parser.active else request
        self._stream: RequestStream | None = None
        self._submitted_at = 0.0
        self.outcome: Outcome | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self._request.prompt_ids)

    async def __aenter__(self) -> Generation:
        try:
            self._stream = self._state.engine.submit(self._request,
                                                     leader=self._leader._stream if self._leader else None)
        except AdmissionError as exc:
            raise ApiError(exc.status, str(exc)) from exc
        self._submitted_at = time.monotonic()
        self._state.streams.add(self._stream)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        assert self._stream is not None
        if self.outcome is None:
            self._stream.cancel()
        self._state.streams.discard(self._stream)

    async def pieces(self) -> AsyncIterator[Piece]:
        """Parsed output as it is generated; `outcome` is set once this ends."""
        assert self._stream is not None, "use Generation as an async context manager"
        cached_tokens = 0  # prompt tokens read from the prefix cache: on the first token's event, and the last's
        async for event in self._stream:
            if event.cached_tokens is not None:
                cached_tokens = event.cached_tokens
            if event.token_ids and self._record.ttft_s is None:
                self._record.ttft_s = time.monotonic() - self._submitted_at
            try:
                delta = self._parser.feed(event.text) if event.text else ParsedDelta()
                if event.finish_reason is not None:
                    delta = delta + self._parser.finish()
            except Exception as exc:  # noqa: BLE001 - a parser fault ends this response alone
                self._stream.cancel()
                self._fail(f"output parsing failed: {type(exc).__name__}: {exc}", event.usage, traceback=True)
                return
            if event.finish_reason is not None:
                usage = event.usage or Usage(self.prompt_tokens, 0, 0)
                cached_tokens = usage.cached_tokens
                if event.finish_reason == "error":
                    self._fail(event.error or "execution error", usage)
                else:
                    self.outcome = Outcome(event.finish_reason, usage, event.stop)
                    self._record.finish_reason = event.finish_reason
                self._record.record_usage(usage)
            delta = with_call_ids(delta, self._call_ids)
            if delta or event.logprobs or event.prompt_logprobs:
                yield Piece(delta, event.logprobs, event.prompt_logprobs, cached_tokens)
            if self.outcome is not None:
                return
        # The runtime always ends a stream with a final event; reaching here is a runtime fault.
        self._fail("the request stream ended early")

    def _fail(self, cause: str, usage: Usage | None = None, traceback: bool = False) -> None:
        """End as failed: `cause` goes to the server log under the request id (with the traceback
        of the exception being handled, when asked), the id alone to the client."""
        request_id = self._record.request_id
        _log.error("generation_failed", request_id=request_id, cause=cause, exc_info=traceback)
        self.outcome = Outcome("error", usage or Usage(self.prompt_tokens, 0, 0),
                               error=f"the server log has the cause under request id {request_id}")
        self._record.finish_reason = "error"


EventSink = Callable[[dict[str, Any] | str], Awaitable[None]]


async def no_events(event: dict[str, Any] | str) -> None:
    return None


class Framing(enum.Enum):
    """How a protocol writes its stream events."""

    NAMED_SSE = "named_sse"  # OpenAI Responses, Anthropic Messages: `event: <type>` + data
    SSE = "sse"              # OpenAI (chat) completions: data lines, a "[DONE]" string last
    NDJSON = "ndjson"        # Ollama: one JSON object per line


class OutputBuilder(Protocol):
    """Turns pieces into a protocol's response: stream events go to the sink it was made with,
    and `finish` returns the whole response object (what a non-streaming request answers). On a
    stream, `finish` also reports an execution error or a shutdown in the protocol's own way."""

    async def start(self) -> None: ...

    async def add(self, piece: Piece) -> None: ...

    async def finish(self, outcome: Outcome) -> dict[str, Any]: ...


CallT = TypeVar("CallT", bound=Call)


async def read_call(request: web.Request, parse: Callable[[ServerState, dict[str, Any], str], CallT]) -> CallT:
    """The route's Call: its body parsed and validated by `parse` on the frontend pool."""
    state, request_id = request.app[STATE], request[RECORD].request_id
    return await state.prepare(lambda: parse(state, json_body(request), request_id))


# A route's builders, one per choice, writing stream events to the sink given.
NewBuilders = Callable[[EventSink], Sequence[OutputBuilder]]
# One response object of several choices' objects and outcomes (routes that take `n`).
Combine = Callable[[Sequence[dict[str, Any]], Sequence[Outcome]], dict[str, Any]]


async def answer(request: web.Request, call: Call, new_builders: NewBuilders, *,
                 framing: Framing = Framing.NAMED_SSE, parsed: bool = True,
                 combine: Combine | None = None, call_ids: CallIds = openai_call_id) -> web.StreamResponse:
    """Run `call` and answer it through its route's builders. With `parsed`, the output goes
    through the core's reasoning parser and (when the call asked for it) its tool parser; tool
    calls get ids in the protocol's form (`call_ids`). A call
    of several choices runs one generation each: the first is submitted first and the others
    wait for its prefill (see Engine.submit); `combine` makes their one response object."""
    state, record = request.app[STATE], request[RECORD]
    record.model, record.stream = call.model, call.stream
    async with AsyncExitStack() as entered:
        generations: list[Generation] = []
        for choice in choice_requests(replace(call.request, client=client_of(request)), call.choices):
            parser = output_parser(state.frontend, call.prompt.text, call.tools) if parsed else None
            generation = Generation(state, record, choice, parser, leader=generations[0] if generations else None,
                                    call_ids=call_ids)
            generations.append(await entered.enter_async_context(generation))
        response = await builder_response(request, generations, new_builders, stream=call.stream,
                                          headers=call.sampling.headers(), framing=framing, combine=combine)
        if len(generations) > 1 and all(g.outcome is not None for g in generations):
            record.record_usage(choices_usage([g.outcome for g in generations]))
        return response


class _Unfinished(Exception):
    """A choice ended without completing (execution error, shutdown): the others stop."""


async def _run_choices(generations: Sequence[Generation], builders: Sequence[OutputBuilder], *,
                       finish: bool) -> None:
    """Feed each generation's pieces to its builder (with `finish`, then finish it), the choices
    concurrently; a choice that ends unfinished stops the others."""
    async def run(generation: Generation, builder: OutputBuilder) -> None:
        await builder.start()
        async for piece in generation.pieces():
            await builder.add(piece)
        if finish:
            await builder.finish(generation.outcome)
        if unfinished_error(generation.outcome) is not None:
            raise _Unfinished

    if len(generations) == 1:
        try:
            await run(generations[0], builders[0])
        except _Unfinished:
            pass
        return
    try:
        async with asyncio.TaskGroup() as group:
            for generation, builder in zip(generations, builders):
                group.create_task(run(generation, builder))
    except BaseExceptionGroup as failures:  # a failure other than an unfinished choice goes on as itself
        others = [e for e in failures.exceptions if not isinstance(e, _Unfinished)]
        if others:
            raise others[0]


async def builder_response(request: web.Request, generations: Sequence[Generation], new_builders: NewBuilders, *,
                           stream: bool, headers: dict[str, str], framing: Framing = Framing.NAMED_SSE,
                           combine: Combine | None = None) -> web.StreamResponse:
    """Every generating endpoint answers through here: with its builders' final object, or by
    streaming the builders' events in `framing`. Both paths run the same builders, so they agree
    by construction; an execution error (500) or a shutdown (503) is answered before anything is
    sent, and the builders' own to report once streaming."""
    if not stream:
        builders = new_builders(no_events)
        await _run_choices(generations, builders, finish=False)
        for generation in generations:  # choices stopped by another's failure have no outcome
            error = unfinished_error(generation.outcome) if generation.outcome is not None else None
            if error is not None:
                raise error
        objects = [await b.finish(g.outcome) for b, g in zip(builders, generations)]
        if len(objects) == 1:
            return web.json_response(objects[0], headers=headers)
        assert combine is not None, "a route that takes several choices combines them"
        return web.json_response(combine(objects, [g.outcome for g in generations]), headers=headers)
    ndjson = framing is Framing.NDJSON
    content_type = "application/x-ndjson" if ndjson else "text/event-stream"
    events = EventStream(request, headers=headers, content_type=content_type)
    await events.open()

    writing = asyncio.Lock()  # choices write concurrently; each event goes out whole

    async def send(event: dict[str, Any] | str) -> None:
        async with writing:
            if ndjson:
                await events.line(event)
            else:
                await events.event(event, event=event["type"] if framing is Framing.NAMED_SSE else None)

    await _run_choices(generations, new_builders(send), finish=True)
    await events.close()
    return events.response
