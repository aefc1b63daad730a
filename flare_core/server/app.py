"""The aiohttp application: routes, API-key auth, ingress limit, errors in each API's format,
and one log line per request.

Middlewares run outermost first:
1. log + errors: every request gets a RequestRecord and one log line at completion (except
   /health and /metrics, which probes poll); ApiErrors
   and aiohttp's own HTTP errors become JSON in the format of the path's API family.
2. access: Host names and browser origins (403; CORS preflights answered), see access.
3. auth: when an API key is configured, `Authorization: Bearer <key>` or `x-api-key: <key>`
   (Anthropic clients) must match it (constant-time compare). /health and /metrics stay open.
4. ingress: while draining, or once the model worker has failed, every request is a 503.
   A POST body must be uncompressed JSON (415); it is then received whole: at most
   `max_body_bytes` (413), within `body_timeout_s` and above a minimum rate (408), within the
   upload slots, per client and in all (429; see uploads); shutdown ends the reads still
   waiting (503). Only then is the ingress reservation taken: past `ingress_limit(...)`
   requests in flight a 429. The reservation lasts until the response (streams included) is
   complete. The limit is twice what the engine admits (`max_concurrency + queue_capacity`),
   so a full engine answers generation requests with its own 503 while the other half bounds
   light routes. Clients that stall their uploads hold no reservation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from flare_core.config import ServerConfig
from flare_core.requests import WORKER_FAILED
from flare_core.server import (anthropic_messages, metrics, models, ollama, openai_chat, openai_completions,
                               openai_responses)
from flare_core.server.access import PREFLIGHT_MAX_AGE_S, PREFLIGHT_METHODS
from flare_core.server.errors import ApiError, error_response, flavor_of_path
from flare_core.server.request_log import RECORD, RequestRecord
from flare_core.server.sse import ClientGone
from flare_core.server.state import STATE, Engine, ServerState, add_post, body_encoding, is_json_body, read_api_key
from flare_core.server.uploads import TooLarge, TooSlow, client_of, is_small, read_body
from flare_core.server.validation import BODY

OPEN_PATHS = frozenset({"/health", "/metrics"})
# Statuses that refuse a request before it reaches the engine (counted in flare_requests_rejected).
_REJECTIONS = (401, 403, 408, 413, 429, 503)
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
        response = error_response(flavor, exc)
        if status in (408, 413):  # the rest of the body may still be on its way: never read it as a request
            response.force_close()
        return response
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
async def _access(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Host names and browser origins (see access), before the key check, on every path; CORS
    preflights of allowed origins are answered here (they carry no key)."""
    refusal = request.app[STATE].access.refusal(request.headers)
    if refusal is not None:
        header, message = refusal
        raise ApiError(403, message, param=header, code=f"{header.lower()}_not_allowed")
    origin = request.headers.get("Origin")
    if origin is not None and request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": PREFLIGHT_METHODS,
            "Access-Control-Allow-Headers": request.headers.get("Access-Control-Request-Headers", ""),
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S)})
    return await handler(request)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response to an allowed origin (streams too: this runs before headers are sent)
    names it; a refused origin never gets here with its own name (its 403 carries none)."""
    origin = request.headers.get("Origin")
    if origin is not None and request.app[STATE].access.origin_allowed(origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Vary"] = "Origin"


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path not in OPEN_PATHS and not request.app[STATE].authorized(request):
        raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'")
    return await handler(request)


@web.middleware
async def _ingress(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if request.path in OPEN_PATHS:
        return await handler(request)
    refuse_if_unavailable(state)
    if request.method == "POST":
        _refuse_body_form(request)
        request[BODY] = await _receive_body(request, state)
        refuse_if_unavailable(state)
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


def _refuse_body_form(request: web.Request) -> None:
    """415, before any of the body is read, for a compressed (or otherwise encoded) body — the APIs
    served take plain JSON, and inflating a client's upload is how a 1 MB request becomes 1 GiB of
    work — or one not declared JSON (what a page may send cross-site unasked, see access)."""
    encoding = body_encoding(request)
    if encoding is not None:
        raise ApiError(415, f"Content-Encoding {encoding[:40]!r} is not accepted: send the request body uncompressed "
                            f"(Content-Encoding identity, or none)", param="Content-Encoding")
    if not is_json_body(request):
        raise ApiError(415, f"Content-Type {request.headers.get('Content-Type', '(none)')[:60]!r} is not accepted: "
                            f"send the request body as JSON with Content-Type: application/json",
                       param="Content-Type")


def refuse_if_unavailable(state: ServerState) -> None:
    """503 once the model worker has failed or shutdown has begun."""
    if state.engine.failure is not None:
        raise ApiError(503, WORKER_FAILED)
    if state.draining:
        raise ApiError(503, "the server is shutting down and accepts no new requests")


async def _receive_body(request: web.Request, state: ServerState) -> bytes:
    """The whole body, within the size, time, rate and concurrent-upload limits (see uploads)."""
    config, limit = state.config, state.max_body_bytes
    too_large = ApiError(413, f"request body exceeds the server's limit of {limit} bytes (server.max_body_bytes "
                              f"in the config; by default derived from the core's context length)")
    if state.declares_too_large(request):
        raise too_large
    uploads, client, small = state.uploads, client_of(request), is_small(request)
    refusal = uploads.refusal(client, small)
    if refusal is not None:
        raise ApiError(429, refusal)
    uploads.take(client, small)
    state.engine.metrics.set_http_uploads(uploads.in_progress)
    read = asyncio.ensure_future(read_body(request, limit, config.body_min_bytes_per_s, config.body_grace_s))
    shutdown = asyncio.ensure_future(state.shutting_down.wait())
    try:
        done, _ = await asyncio.wait((read, shutdown), timeout=config.body_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
        if read in done:
            return read.result()
        if shutdown in done:
            raise ApiError(503, "the server is shutting down and accepts no new requests")
        raise ApiError(408, f"the request body did not arrive within {config.body_timeout_s:g} s "
                            f"(server.body_timeout_s in the config)")
    except TooSlow:
        raise ApiError(408, f"the request body arrived slower than {config.body_min_bytes_per_s} bytes/s after its "
                            f"first {config.body_grace_s:g} s (server.body_min_bytes_per_s, server.body_grace_s "
                            f"in the config)") from None
    except TooLarge:
        raise too_large from None
    except (HttpProcessingError, RequestPayloadError, ValueError) as exc:  # e.g. a malformed chunked body
        raise ApiError(400, f"the request body cannot be read: {exc}") from None
    finally:
        uploads.give_back(client, small)
        state.engine.metrics.set_http_uploads(uploads.in_progress)
        for task in (read, shutdown):
            task.cancel()
        await asyncio.gather(read, shutdown, return_exceptions=True)


# Routes clients call for embeddings. A core serves a generative model's next-token head; a
# pooled hidden state would be an embedding no model was trained to give, so none is served.
EMBEDDING_ROUTES = ("/v1/embeddings", "/api/embed", "/api/embeddings")


async def _no_embeddings(request: web.Request) -> web.Response:
    raise ApiError(404, f"{request.path}: embeddings are not served: this server runs generative models "
                        f"(chat, completions, messages), and a core has no embedding head", code="not_found")


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine.failure is not None:
        return web.json_response({"status": "failed", "cause": WORKER_FAILED}, status=503)
    if state.draining:
        return web.json_response({"status": "draining"}, status=503)
    return web.json_response({"status": "ok", "models": list(state.engine.info.served_names),
                              "active_requests": state.engine.active_requests()})


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """The request's id under both names clients read: `x-request-id` (OpenAI's SDK and most
    proxies) and `request-id` (Anthropic's SDK, `message._request_id`)."""
    record = request.get(RECORD)
    if record is not None:
        response.headers["x-request-id"] = response.headers["request-id"] = record.request_id


def ingress_limit(max_concurrency: int, queue_capacity: int) -> int:
    """HTTP requests held at once before 429: with equal limits a full engine would never answer
    its 503, because the ingress check runs first."""
    return 2 * (max_concurrency + queue_capacity)


def build_app(engine: Engine, config: ServerConfig) -> web.Application:
    """The server for `engine`; `config.api_key_file` is read here (ValueError if unreadable or empty).
    Its frontend pool is shut down with the app (`on_cleanup`)."""
    state = ServerState(engine=engine, config=config, api_key=read_api_key(config.api_key_file),
                        ingress_limit=ingress_limit(engine.info.max_concurrency, engine.info.queue_capacity),
                        frontend_pool=ThreadPoolExecutor(config.frontend_workers, thread_name_prefix="flare-frontend"))
    # client_max_size bounds bodies without a Content-Length too (chunked uploads).
    app = web.Application(client_max_size=state.max_body_bytes, middlewares=[_log_and_errors, _access, _auth, _ingress])
    app[STATE] = state

    async def close_pool(app: web.Application) -> None:
        state.frontend_pool.shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(close_pool)
    app.on_response_prepare.append(_add_request_id)
    app.on_response_prepare.append(_cors_headers)
    app.router.add_get("/health", _health)
    for path in EMBEDDING_ROUTES:
        add_post(app, path, _no_embeddings)
    for module in (metrics, models, openai_chat, openai_completions, openai_responses, anthropic_messages, ollama):
        module.add_routes(app)
    return app
