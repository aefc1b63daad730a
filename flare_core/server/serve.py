"""Running the server until SIGTERM / Ctrl-C, then shutting down gracefully.

Shutdown: stop admission (new requests get 503, /health reports draining, bodies still
arriving are refused), give active responses `shutdown_grace_s` to finish, cancel what is left
(each such response still ends in its protocol's way of saying it was cut short), close the
listener and connections, stop the engine. A second signal skips the rest of the grace period.

A failed model worker ends the server the same way, without the grace period: the engine has
already ended every request with an error; once their responses are written (or after the
cancel wait) the server stops and `serve` raises WorkerFailed, so `flare run` exits with status 1
and a supervisor can restart it.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from flare_core.config import ServerConfig
from flare_core.server.app import build_app
from flare_core.server.state import STATE, Engine, ServerState

# After cancelling, how long handlers get to write their final events before connections close.
_CANCELLED_END_S = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)

_log = structlog.get_logger("flare.server")


# How long aiohttp waits for handlers when the runner closes; drain has already ended them.
_RUNNER_SHUTDOWN_S = 2.0


# An event-loop error that repeats — asyncio's "socket.accept() out of system resource" once the
# process is out of descriptors comes back about a thousand times a second, each with its
# traceback — is logged once in full, then at most once per this many seconds with the count.
LOOP_ERROR_INTERVAL_S = 10.0


class LoopErrorLog:
    """The event loop's exception handler: each kind of error (message and exception type) is
    logged with its traceback the first time, then at most once per `interval_s`, one line
    carrying how many times it came since."""

    def __init__(self, interval_s: float = LOOP_ERROR_INTERVAL_S, clock: Callable[[], float] = time.monotonic):
        self._interval_s = interval_s
        self._clock = clock
        self._logged_at: dict[tuple[str, str], float] = {}
        self._since: Counter[tuple[str, str]] = Counter()

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        kind = (str(context.get("message", "")), type(error).__name__ if error is not None else "")
        now, logged_at = self._clock(), self._logged_at.get(kind)
        if logged_at is not None and now - logged_at < self._interval_s:
            self._since[kind] += 1
            return
        self._logged_at[kind] = now
        _log.error("event_loop_error", message=kind[0], error=None if error is None else f"{kind[1]}: {error}",
                   repeated_since_last=self._since.pop(kind, 0),
                   exc_info=error if logged_at is None and error is not None else None)


class ServeError(RuntimeError):
    """The server could not start (e.g. the address is in use)."""


class WorkerFailed(RuntimeError):
    """The model worker failed while serving; the server has stopped. The message is the cause."""


async def serve_async(engine: Engine, config: ServerConfig, *,
                      on_listening: Callable[[str], None] | None = None,
                      while_serving: Callable[[str], Awaitable[None]] | None = None) -> None:
    """Serve `engine` on `config.host:config.port` until SIGINT/SIGTERM, then drain and return.
    Must run on the main thread (signal handlers). `on_listening(url)` runs once the port is bound;
    `while_serving(url)` then runs as a task (e.g. the dashboard) until the engine has stopped,
    when it is cancelled. The engine is closed (`aclose`) on every way out; start-up failures
    raise ServeError."""
    asyncio.get_running_loop().set_exception_handler(LoopErrorLog())
    companion: asyncio.Task | None = None
    failure: str | None = None
    try:
        try:
            app = build_app(engine, config)
        except ValueError as exc:  # an unreadable or empty api_key_file
            raise ServeError(str(exc)) from exc
        state = app[STATE]
        # handler_cancellation: a client that disconnects cancels its handler, hence its engine request.
        # keepalive_timeout: aiohttp closes a connection whose request head is incomplete this long
        # after it opened or after its last response (idle and slow-header connections alike).
        # auto_decompress off: aiohttp would inflate a compressed body on the event loop as it arrives,
        # before any handler (the API key check included) runs; bodies are refused compressed instead
        # (app._ingress: a Content-Encoding is a 415).
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, auto_decompress=False,
                               keepalive_timeout=config.idle_timeout_s, shutdown_timeout=_RUNNER_SHUTDOWN_S)
        await runner.setup()
        try:
            site = web.TCPSite(runner, config.host, config.port)
            try:
                await site.start()
            except OSError as exc:
                raise ServeError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from exc
            host, port = runner.addresses[0][:2]  # the bound port, also when config.port is 0
            url = f"http://{host}:{port}"
            _log.info("listening", url=url, models=list(engine.info.served_names),
                      ingress_limit=state.ingress_limit, api_key=state.api_key is not None)
            if on_listening is not None:
                on_listening(url)
            if while_serving is not None:
                companion = asyncio.create_task(while_serving(url))
            failure = await _until_signal_then_drain(state, config.shutdown_grace_s)
        finally:
            await runner.cleanup()
    finally:
        try:
            await engine.aclose()
        finally:
            if companion is not None:
                companion.cancel()
                await asyncio.gather(companion, return_exceptions=True)
    if failure is not None:
        _log.error("stopped after the model worker failed", cause=failure)
        raise WorkerFailed(failure)
    _log.info("stopped")


async def _until_signal_then_drain(state: ServerState, grace_s: float) -> str | None:
    """Serve until a signal (then drain; None) or a failure of the model worker (then end the
    open responses; the cause)."""
    loop = asyncio.get_running_loop()
    first, second, failed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (second if first.is_set() else first).set()

    for sig in _SIGNALS:
        loop.add_signal_handler(sig, on_signal)
    state.engine.on_failure(lambda cause: loop.call_soon_threadsafe(failed.set))
    try:
        await _first_of([first.wait(), failed.wait()], None)
        if failed.is_set():
            await drain(state, 0.0, hurry=second)
            return state.engine.failure
        await drain(state, grace_s, hurry=second)
        return None
    finally:
        for sig in _SIGNALS:
            loop.remove_signal_handler(sig)


async def drain(state: ServerState, grace_s: float, hurry: asyncio.Event | None = None) -> None:
    """Stop admission, wait up to `grace_s` for active responses, then cancel the rest and wait
    for their handlers to write their final events."""
    state.shutting_down.set()
    state.engine.begin_drain()
    _log.info("draining", active_responses=state.in_flight, grace_s=grace_s)
    waits = [state.idle.wait()] + ([hurry.wait()] if hurry is not None else [])
    if not await _first_of(waits, grace_s) or not state.idle.is_set():
        cancelled = list(state.streams)
        for stream in cancelled:
            stream.cancel()
        _log.info("cancelled_after_grace", requests=len(cancelled))
        if not await _first_of([state.idle.wait()], _CANCELLED_END_S):
            _log.warning("responses_still_open", active_responses=state.in_flight)


async def _first_of(waits: list, timeout: float | None) -> bool:
    """Whether any of the awaitables finished within `timeout` seconds (None: no limit; the rest
    are cancelled)."""
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    return bool(done)


def serve(engine: Engine, config: ServerConfig, *, on_listening: Callable[[str], None] | None = None,
          while_serving: Callable[[str], Awaitable[None]] | None = None) -> None:
    """`flare run`'s server: runs the event loop until a signal has drained the server."""
    asyncio.run(serve_async(engine, config, on_listening=on_listening, while_serving=while_serving))
