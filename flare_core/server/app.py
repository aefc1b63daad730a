"""The aiohttp application: routes, API-key auth, ingress limit, errors in each API's format,
and one log line per request.

Middlewares run outermost first:
1. log + errors: every request gets a RequestRecord and one log line at completion (except
   /health and /metrics, which probes poll); ApiErrors
   and aiohttp's own HTTP errors become JSON in the format of the path's API family.
2. auth: when an API key is configured, `Authorization: Bearer <key>` or `x-api-key: <key>`
   (Anthropic clients) must match it (constant-time compare). /health and /metrics stay open.
3. ingress: while draining every request is a 503; past `ingress_limit(...)` requests in
   flight a 429 — both decided before any body is read. The reservation lasts until the
   response (streams included) is complete. The limit is twice what the engine admits
   (`max_concurrency + queue_capacity`), so a full engine answers generation requests with
   its own 503 while the other half bounds requests reading bodies or asking light routes.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from flare_core.config import ServerConfig
from flare_core.server import (
    anthropic_messages,
    metrics,
    models,
    ollama,
    openai_chat,
    openai_completions,
    openai_responses,
)
from flare_core.server.errors import ApiError, error_response, flavor_of_path
from flare_core.server.request_log import RECORD, RequestRecord
from flare_core.server.sse import ClientGone
from flare_core.server.state import STATE, Engine, ServerState, read_api_key

OPEN_PATHS = frozenset({"/health", "/metrics"})
# Statuses that refuse a request before it reaches the engine (counted in flare_requests_rejected).
_REJECTIONS = (401, 413, 429, 503)
# Status logged for a request whose client went away before its response was complete (nginx's).
CLIENT_CLOSED = 499

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_log = structlog.get_logger("flare.server")


@web.middleware
async def _log_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    record = RequestRecord(route=request.path)
    request[RECORD] = record
    flavor = flavor_of_path(request.path)
    status, error = 500, None
    try:
        response = await handler(request)
        status = response.status
        return response
    except ApiError as exc:
        status, error = exc.status, exc.message
        if status in _REJECTIONS:
            request.app[STATE].engine.metrics.request_rejected(status)
        return error_response(flavor, exc)
    except web.HTTPException as exc:  # aiohttp's routing: unknown path, wrong method
        status = exc.status
        message = f"{request.method} {request.path}: {exc.reason}"
        error = message
        return error_response(flavor, ApiError(exc.status, message, code=exc.reason.lower().replace(" ", "_")))
    except ClientGone as exc:
        status = CLIENT_CLOSED
        return exc.response
    except asyncio.CancelledError:
        status = CLIENT_CLOSED
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        _log.exception("request_failed", request_id=record.request_id, route=record.route)
        return error_response(flavor, ApiError(500, f"internal server error ({type(exc).__name__}); "
                                                    f"see the server log, request id {record.request_id}"))
    finally:
        if request.path not in OPEN_PATHS:  # probes and scrapes would drown the request log
            record.log(status, error)


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    api_key = request.app[STATE].api_key
    if api_key is None or request.path in OPEN_PATHS:
        return await handler(request)
    presented = request.headers.get("x-api-key")
    authorization = request.headers.get("Authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        presented = token.strip()
    if presented is None or not hmac.compare_digest(presented.encode("utf-8"), api_key.encode("utf-8")):
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    return await handler(request)


@web.middleware
async def _ingress(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if request.path in OPEN_PATHS:
        return await handler(request)
    if state.draining:
        raise ApiError(503, "the server is shutting down and accepts no new requests")
    if state.in_flight >= state.ingress_limit:
        info = state.engine.info
        raise ApiError(429, f"the server already holds {state.in_flight} requests, its limit (twice "
                            f"max_concurrency {info.max_concurrency} + queue_capacity {info.queue_capacity}); "
                            f"retry later")
    state.reserve()
    try:
        return await handler(request)
    finally:
        state.release()


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok", "models": list(state.engine.info.served_names),
                              "active_requests": state.engine.active_requests()})


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    record = request.get(RECORD)
    if record is not None:
        response.headers["x-request-id"] = record.request_id


def ingress_limit(max_concurrency: int, queue_capacity: int) -> int:
    """HTTP requests held at once before 429: with equal limits a full engine would never answer
    its 503, because the ingress check runs first."""
    return 2 * (max_concurrency + queue_capacity)


def build_app(engine: Engine, config: ServerConfig) -> web.Application:
    """The server for `engine`; `config.api_key_file` is read here (ValueError if unreadable or empty)."""
    state = ServerState(engine=engine, config=config, api_key=read_api_key(config.api_key_file),
                        ingress_limit=ingress_limit(engine.info.max_concurrency, engine.info.queue_capacity))
    # client_max_size bounds bodies without a Content-Length too (chunked uploads).
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_log_and_errors, _auth, _ingress])
    app[STATE] = state
    app.on_response_prepare.append(_add_request_id)
    app.router.add_get("/health", _health)
    for module in (metrics, models, openai_chat, openai_completions, openai_responses, anthropic_messages, ollama):
        module.add_routes(app)
    return app
