"""What the HTTP server holds for its lifetime: the engine, limits, and the live ingress bookkeeping."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from aiohttp import HttpVersion11, web

from flare_core.config import ServerConfig
from flare_core.server.access import Access
from flare_core.server.uploads import Uploads, upload_limit
from flare_core.frontend import Frontend
from flare_core.observability.metrics import RuntimeMetrics
from flare_core.requests import EngineInfo, GenerationEvent, GenerationRequest


class RequestStream(Protocol):
    def __aiter__(self) -> AsyncIterator[GenerationEvent]: ...
    async def __anext__(self) -> GenerationEvent: ...
    def cancel(self) -> None: ...


class Engine(Protocol):
    """The part of `flare_core.engine.service.Engine` the server uses."""

    info: EngineInfo
    frontend: Frontend  # tokenizer, chat template, sampling policy, parsers, template defaults
    metrics: RuntimeMetrics

    # Set once the model worker has failed (the cause); the server then refuses work and exits.
    failure: str | None

    def submit(self, request: GenerationRequest) -> RequestStream: ...
    def begin_drain(self) -> None: ...
    def active_requests(self) -> int: ...
    def on_failure(self, callback: Callable[[str], None]) -> None: ...
    async def aclose(self) -> None: ...


T = TypeVar("T")


@dataclass
class ServerState:
    engine: Engine
    config: ServerConfig
    api_key: str | None
    # Requests that may hold an ingress reservation at once: each has its whole body and is being
    # prepared, waiting for a slot, or streaming; more is refused with 429.
    ingress_limit: int
    in_flight: int = 0
    # Set when shutdown begins: admission stops and body reads still waiting for bytes end at once
    # with a 503.
    shutting_down: asyncio.Event = field(default_factory=asyncio.Event)
    # Engine streams of responses still being written, so shutdown can end them cleanly.
    streams: set[RequestStream] = field(default_factory=set)
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    frontend_pool: ThreadPoolExecutor | None = None
    # Derived: the largest body accepted (`ServerConfig.body_limit` of the core's context) and
    # how many bodies may arrive at once.
    max_body_bytes: int = field(init=False)
    # Requests whose body is still arriving, bounded on their own (see uploads): clients that
    # stall their uploads cannot take the reservations generation requests need.
    uploads: Uploads = field(init=False)
    access: Access = field(init=False)  # host names and browser origins served

    def __post_init__(self) -> None:
        self.idle.set()
        self.max_body_bytes = self.config.body_limit(self.engine.info.context_length)
        limit = upload_limit(self.ingress_limit)
        self.uploads = Uploads(limit, self.config.uploads_per_client or max(limit // 4, 1))
        self.access = Access.of(self.config.host, self.config.allowed_hosts, self.config.allowed_origins)

    @property
    def frontend(self) -> Frontend:
        return self.engine.frontend

    @property
    def draining(self) -> bool:
        return self.shutting_down.is_set()

    async def prepare(self, work: Callable[[], T]) -> T:
        """Run `work` (parsing, template rendering, tokenization) on the frontend pool, so a large
        prompt never stalls the event loop; without a pool (unit tests) it runs inline."""
        if self.frontend_pool is None:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self.frontend_pool, work)

    def reserve(self) -> None:
        self.in_flight += 1
        self.idle.clear()
        self.engine.metrics.set_http_in_flight(self.in_flight)

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()
        self.engine.metrics.set_http_in_flight(self.in_flight)

    @property
    def default_model(self) -> str:
        return self.engine.info.served_names[0]

    def declares_too_large(self, request: web.Request) -> bool:
        """Whether `request`'s Content-Length is over the body limit (known before the body is read)."""
        return request.content_length is not None and request.content_length > self.max_body_bytes

    def reads_body(self, request: web.Request) -> bool:
        """Whether the middlewares go on to read `request`'s body: an allowed host and origin, the
        key presented, a JSON body without Content-Encoding, within the size limit."""
        return (self.access.refusal(request.headers) is None and self.authorized(request)
                and is_json_body(request) and body_encoding(request) is None and not self.declares_too_large(request))

    def authorized(self, request: web.Request) -> bool:
        """Whether `request` presents the API key (`Authorization: Bearer` or `x-api-key`), or none is set."""
        if self.api_key is None:
            return True
        presented = request.headers.get("x-api-key")
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            presented = token.strip()
        # Header bytes that are not UTF-8 arrive as surrogate escapes; they simply do not match.
        return presented is not None and hmac.compare_digest(presented.encode("utf-8", "surrogateescape"),
                                                             self.api_key.encode("utf-8"))


STATE = web.AppKey("flare_state", ServerState)


def is_json_body(request: web.Request) -> bool:
    """Whether `request` declares its body as JSON: `Content-Type: application/json` (any charset
    parameter). A missing type, text/plain and form types are what browsers send cross-site
    without asking first (see access)."""
    return request.content_type == "application/json"


def body_encoding(request: web.Request) -> str | None:
    """The Content-Encoding `request` declares for its body, None for none or identity (the only
    form bodies are taken in: the server never inflates an upload)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    return None if encoding in ("", "identity") else encoding


async def expect_continue(request: web.Request) -> None:
    """`Expect: 100-continue`: the interim "100 Continue" only for a body the server will read
    (ServerState.reads_body); otherwise nothing, and the middleware's final answer (403, 401,
    415, 413) comes instead, before the client sends the body."""
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect[:60]}")
    if request.version != HttpVersion11 or not request.app[STATE].reads_body(request):
        return
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the interim response is not part of the response's size


def add_post(app: web.Application, path: str, handler: Callable) -> None:
    """A POST route of the API, answering `Expect: 100-continue` as `expect_continue` says."""
    app.router.add_post(path, handler, expect_handler=expect_continue)


def read_api_key(path: Path | None) -> str | None:
    """The bearer token clients must present, from `server.api_key_file` (None: no auth)."""
    if path is None:
        return None
    try:
        key = Path(path).expanduser().read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"server.api_key_file {path}: cannot read it ({exc.strerror})") from exc
    if not key:
        raise ValueError(f"server.api_key_file {path} is empty; write the API key into it or leave the setting out")
    return key
