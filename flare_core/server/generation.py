"""One request's generation as the protocol adapters see it: submitted to the engine, its text
run through the recipe's reasoning/tool parsers, ended by an outcome (finish reason + usage).

Used as an async context manager: leaving the context before the final event (client gone,
handler cancelled, shutdown) cancels the engine request, which frees its slot.
"""

from __future__ import annotations

import enum
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

import structlog
from aiohttp import web

from flare_core.frontend import Frontend
from flare_core.frontend.parsers import OutputParser, ParsedDelta, prompt_opens_reasoning
from flare_core.runtime.types import AdmissionError, GenerationRequest, TokenLogprob, Usage
from flare_core.server.errors import ApiError
from flare_core.server.prompts import Prompt
from flare_core.server.request_log import RECORD, RequestRecord
from flare_core.server.sampling import Sampling
from flare_core.server.sse import EventStream
from flare_core.server.state import STATE, RequestStream, ServerState
from flare_core.server.validation import json_body


_log = structlog.get_logger("flare.server")


@dataclass(frozen=True)
class Piece:
    """Newly parsed output and the logprobs of the tokens that produced it."""

    delta: ParsedDelta
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # requests that score their prompt


@dataclass(frozen=True)
class Call:
    """A generation request a route has validated: what its handler needs to answer it. Routes
    with more to carry (stream options, echoed settings) subclass it."""

    model: str  # the served name the response reports
    stream: bool
    prompt: Prompt
    request: GenerationRequest
    sampling: Sampling
    parse_tools: bool = False


@dataclass(frozen=True)
class Outcome:
    finish_reason: str  # the runtime's: "stop", "length", "cancelled", "error"
    usage: Usage
    stop: str | int | None = None
    error: str | None = None


def execution_error(message: str | None) -> ApiError:
    """A generation that failed while running: the engine's message, or a generic one."""
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


def output_parser(frontend: Frontend, prompt_text: str | None, tools: bool) -> OutputParser:
    """The recipe's parsers for one chat-style request: reasoning always (when the recipe names
    one), tool calls only when the request offered tools. `prompt_text` tells the reasoning
    parser whether the template already opened a reasoning block."""
    reasoning = None
    if frontend.reasoning_parser is not None:
        opened = prompt_text is not None and prompt_opens_reasoning(prompt_text)
        reasoning = frontend.reasoning_parser.factory(starts_in_reasoning=opened)
    tool = frontend.tool_parser.factory() if tools and frontend.tool_parser is not None else None
    return OutputParser(reasoning=reasoning, tool=tool)


class Generation:
    def __init__(self, state: ServerState, record: RequestRecord, request: GenerationRequest,
                 parser: OutputParser | None = None):
        self._state = state
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
            self._stream = self._state.engine.submit(self._request)
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
        async for event in self._stream:
            if event.token_ids and self._record.ttft_s is None:
                self._record.ttft_s = time.monotonic() - self._submitted_at
            try:
                delta = self._parser.feed(event.text) if event.text else ParsedDelta()
                if event.finish_reason is not None:
                    delta = delta + self._parser.finish()
            except Exception as exc:  # noqa: BLE001 - a parser fault ends this response alone
                _log.exception("output parsing failed", request_id=self._record.request_id)
                self._stream.cancel()
                self._fail(f"output parsing failed: {type(exc).__name__}: {exc}", event.usage)
                return
            if event.finish_reason is not None:
                usage = event.usage or Usage(self.prompt_tokens, 0, 0)
                self.outcome = Outcome(event.finish_reason, usage, event.stop, event.error)
                self._record.finish_reason = event.finish_reason
                self._record.record_usage(usage)
            if delta or event.logprobs or event.prompt_logprobs:
                yield Piece(delta, event.logprobs, event.prompt_logprobs)
            if self.outcome is not None:
                return
        # The runtime always ends a stream with a final event; reaching here is a runtime fault.
        self._fail("the request stream ended early")

    def _fail(self, error: str, usage: Usage | None = None) -> None:
        self.outcome = Outcome("error", usage or Usage(self.prompt_tokens, 0, 0), error=error)
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


async def answer(request: web.Request, call: Call, new_builder: Callable[[EventSink], OutputBuilder], *,
                 framing: Framing = Framing.NAMED_SSE, parsed: bool = True) -> web.StreamResponse:
    """Run `call` and answer it through its route's builder. With `parsed`, the output goes
    through the core's reasoning parser and (when the call asked for it) its tool parser."""
    state, record = request.app[STATE], request[RECORD]
    record.model, record.stream = call.model, call.stream
    parser = output_parser(state.frontend, call.prompt.text, call.parse_tools) if parsed else None
    generation = Generation(state, record, call.request, parser)
    async with generation:
        return await builder_response(request, generation, new_builder, stream=call.stream,
                                      headers=call.sampling.headers(), framing=framing)


async def builder_response(request: web.Request, generation: Generation,
                           new_builder: Callable[[EventSink], OutputBuilder], *, stream: bool,
                           headers: dict[str, str], framing: Framing = Framing.NAMED_SSE) -> web.StreamResponse:
    """Every generating endpoint answers through here: with its builder's final object, or by
    streaming the builder's events in `framing`. Both paths run the same builder, so they agree
    by construction; an execution error (500) or a shutdown (503) is answered before anything is
    sent, and the builder's own to report once streaming."""
    if not stream:
        builder = new_builder(no_events)
        await builder.start()
        async for piece in generation.pieces():
            await builder.add(piece)
        error = unfinished_error(generation.outcome)
        if error is not None:
            raise error
        return web.json_response(await builder.finish(generation.outcome), headers=headers)
    ndjson = framing is Framing.NDJSON
    content_type = "application/x-ndjson" if ndjson else "text/event-stream"
    events = EventStream(request, headers=headers, content_type=content_type)
    await events.open()

    async def send(event: dict[str, Any] | str) -> None:
        if ndjson:
            await events.line(event)
        else:
            await events.event(event, event=event["type"] if framing is Framing.NAMED_SSE else None)

    builder = new_builder(send)
    await builder.start()
    async for piece in generation.pieces():
        await builder.add(piece)
    await builder.finish(generation.outcome)
    await events.close()
    return events.response
