"""The engine as the HTTP server sees it: an `EngineCore` run on one model thread, and the
asyncio side of it (per-request event streams, admission limits, several choices of one prompt,
failure, shutdown).

Only the model thread touches the engine core. The event loop submits and cancels through a
bounded inbox of typed messages; each `Activity` the core reports is published from the model
thread: its events go to their streams through one `loop.call_soon_threadsafe` per step, its
statistics to `/metrics` and the dashboard, its resources to `resources()`. Request handles carry
state row + generation, so output for a reused state row never reaches its previous request.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import structlog

from flare_core.engine.core import EngineCore
from flare_core.engine.memory import KvPlan
from flare_core.observability.metrics import RuntimeMetrics
from flare_core.engine.stats import Activity
from flare_core.engine.tables import TableStore
from flare_core.frontend import Frontend
from flare_core.requests import WORKER_FAILED, AdmissionError, EngineInfo, GenerationEvent, GenerationRequest
from flare_core.scheduler import Resources

if TYPE_CHECKING:  # the dashboard sits above the engine; only its type is needed here
    from flare_core.observability.telemetry import Telemetry

log = structlog.get_logger("flare.engine")


class RequestStream:
    """Async iterator of one request's GenerationEvents; the last one has finish_reason + usage."""

    def __init__(self, engine: Engine, request_id: str):
        self._engine = engine
        self.request_id = request_id
        self._queue: asyncio.Queue[GenerationEvent] = asyncio.Queue()
        self._done = False
        self._cancelled = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> GenerationEvent:
        if self._done:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.finish_reason is not None:
            self._done = True
        return event

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        if not self._cancelled and not self._done:
            self._cancelled = True
            self._engine._post(_Cancel(self.request_id))

    def _deliver(self, event: GenerationEvent) -> None:
        self._queue.put_nowait(event)


@dataclass(frozen=True)
class _Submit:
    request_id: str
    request: GenerationRequest
    stream: RequestStream
    submitted: float
    leader: str | None = None  # a request with the same prompt, whose prefill this one waits for


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _Fail:
    cause: str


class DependencyFailed(RuntimeError):
    """Something the model worker depends on outside its thread died (a tensor-parallel rank)."""


def _deliver_all(batch: list[tuple[RequestStream, GenerationEvent]]) -> None:
    for stream, event in batch:
        stream._deliver(event)


class Engine:
    """Runs an EngineCore on one model thread; `build_engine` (flare_core.engine.build) assembles it."""

    def __init__(self, core: EngineCore, *, info: EngineInfo, frontend: Frontend, kv: KvPlan,
                 telemetry: Telemetry | None = None, tables: Mapping[str, TableStore] | None = None):
        self.core = core
        self.info = info
        # All the HTTP layer reads of the core besides `info`: its text side.
        self.frontend = frontend
        self.kv = kv
        # Fed from the model thread only when the dashboard is on.
        self.telemetry = telemetry
        self.metrics = RuntimeMetrics(tables)  # the embedding tables' counters, read at each scrape
        self._resources = core.resources()  # the model thread publishes a fresh one after each change
        self._inbox: queue.Queue = queue.Queue(maxsize=4 * (info.max_concurrency + info.queue_capacity) + 16)
        self._streams: dict[str, RequestStream] = {}  # model thread: requests the core has, or parked ones
        self._accepted = 0  # submitted and not finished: bounded by max_concurrency + queue_capacity
        self._accepted_lock = threading.Lock()
        self._draining = False
        # Why the model worker stopped, once a step has failed; then every request is refused.
        self.failure: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Model thread: submits waiting for their leader's prompt to be prefilled, by leader id.
        self._parked: dict[str, list[_Submit]] = {}
        self._thread = threading.Thread(target=self._run, name="flare-model", daemon=True)

    def executor_summary(self) -> str:
        """One line for the startup log: how steps run, and what was compiled and captured."""
        depth = self.core.frames_in_flight
        return f"{self.core.executor.summary()}, {depth} step{'s' if depth > 1 else ''} in flight"

    # ---- event-loop side -----------------------------------------------------------------

    def start(self) -> None:
        self.metrics.record(self.core.take())  # the gauges' starting values, before the thread owns the core
        self._thread.start()

    def submit(self, request: GenerationRequest, leader: RequestStream | None = None) -> RequestStream:
        """Call from the event loop thread (the loop that consumes the returned stream). A request
        with a `leader` (another choice of the same prompt, `n` > 1) is admitted now but scheduled
        once the leader's prompt has been prefilled (its first token sampled): it then restores the
        prompt from the prefix cache rather than computing it again."""
        self._loop = asyncio.get_running_loop()
        if self.failure is not None:
            raise AdmissionError(WORKER_FAILED, status=503)
        if self._draining:
            raise AdmissionError("the server is shutting down and admits no new requests", status=503)
        limit = self.info.max_concurrency + self.info.queue_capacity
        prompt_len = len(request.prompt_ids)
        if prompt_len < 1:
            raise ValueError("the prompt is empty: at least one token is needed")
        # A scoring request (max_tokens 0) still samples the token after its prompt, unused.
        if prompt_len + max(request.max_tokens, 1) > self.info.context_length:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({max(request.max_tokens, 1)}) exceeds the "
                             f"context length {self.info.context_length}")
        with self._accepted_lock:
            if self._accepted >= limit:
                raise AdmissionError(f"admission is full: {self._accepted} requests are running or queued "
                                     f"(max_concurrency {self.info.max_concurrency} + queue_capacity "
                                     f"{self.info.queue_capacity})", status=503)
            self._accepted += 1
        request_id = request.request_id or f"req-{next(self._ids)}"
        stream = RequestStream(self, request_id)
        self.metrics.request_admitted()
        self._post(_Submit(request_id, request, stream, time.monotonic(),
                           leader=leader.request_id if leader is not None else None))
        return stream

    def begin_drain(self) -> None:
        self._draining = True

    def active_requests(self) -> int:
        return self._accepted

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(cause)` once the model worker has failed; it runs on the model thread
        (use loop.call_soon_threadsafe to reach an event loop). Registered after a failure, it
        runs at once."""
        self._failure_callbacks.append(callback)
        if self.failure is not None:
            callback(self.failure)

    def fail(self, cause: str) -> None:
        """From any thread: the model worker fails with `cause`, as if its step had raised (every
        request answered with an error, the failure callbacks called: the server exits 1), even
        while it is idle."""
        self._post(_Fail(cause))

    async def aclose(self) -> None:
        """Cancel what is left, stop the model thread and wait for it."""
        self._draining = True
        self._post(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def resources(self) -> Resources:
        """What requests and the prefix cache held after the model thread's last step or message
        (any thread may read it; it is replaced, never changed)."""
        return self._resources

    def _post(self, message: _Submit | _Cancel | _Stop | _Fail) -> None:
        self._inbox.put(message)

    # ---- model thread ----------------------------------------------------------------------

    def _run(self) -> None:
        core = self.core
        try:
            while self._handle_messages(block=core.is_idle()):
                activity = core.step()
                self._publish(activity)
                # Work exists but nothing can run: requests wait for pages held by the cache or
                # for resources in flight. Block for the next message rather than spin.
                if not activity.progressed and not core.is_idle() and not self._handle_messages(block=True):
                    break
            self._publish(core.settle())  # a stop: settle the issued steps so that their fences pass
        except Exception as exc:  # a failed step fails every request; the server then exits
            log.exception("model worker failed")
            self.failure = f"{type(exc).__name__}: {exc}"
            core.abort_all(error=self.failure)
        finally:
            core.abort_all()
            self._refuse_unread()
            self._publish(core.take())
        if self.failure is not None:
            for callback in self._failure_callbacks:
                callback(self.failure)

    def _handle_messages(self, block: bool) -> bool:
        """Handle pending messages (waiting for one if `block`); False when asked to stop."""
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(message, _Stop):
                return False
            if isinstance(message, _Fail):
                raise DependencyFailed(message.cause)
            if isinstance(message, _Submit):
                self._admit(message)
            elif isinstance(message, _Cancel) and not self.core.abort(message.request_id):
                self._unpark(message.request_id)
            # A message that leaves the core idle is followed by no step that would report it.
            self._publish(self.core.take())

    def _admit(self, message: _Submit) -> None:
        self._streams[message.request_id] = message.stream
        leader = message.leader
        if leader is not None and self.core.generated(leader) == 0:
            self._parked.setdefault(leader, []).append(message)
        else:
            self._add(message)

    def _add(self, message: _Submit) -> None:
        if message.stream.cancelled:  # its cancel message, still in the inbox, then finds nothing to do
            self.core.refuse(message.request_id, message.request, "cancelled")
        else:
            self.core.add(message.request_id, message.request, message.submitted, group=message.leader)

    def _release_parked(self, leader: str) -> bool:
        """Admit the requests that waited for `leader`'s prefill, now: a choice cancelled while it
        waited ends without running. Whether any waited."""
        released = self._parked.pop(leader, ())
        for message in released:
            self._add(message)
        return bool(released)

    def _unpark(self, request_id: str) -> None:
        """A parked request cancelled before admission ends, having held nothing."""
        for messages in self._parked.values():
            for message in messages:
                if message.request_id == request_id:
                    messages.remove(message)
                    self.core.refuse(request_id, message.request, "cancelled")
                    return

    def _refuse_unread(self) -> None:
        """End the requests still parked or in the inbox when the worker stopped."""
        pending = [m for messages in self._parked.values() for m in messages]
        self._parked.clear()
        while True:
            try:
                pending.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for message in pending:
            if isinstance(message, _Submit):
                self._streams[message.request_id] = message.stream
                self.core.refuse(message.request_id, message.request,
                                 "cancelled" if self.failure is None else "error", error=self.failure)

    def _publish(self, activity: Activity) -> None:
        """Hand `activity`'s events to the event loop in one call (each call_soon_threadsafe wakes
        the loop through a socket write: once per step instead of once per token), and record it.
        Requests it releases from parking report at once (a refused one ends here, even when
        nothing else runs)."""
        released = [self._release_parked(request_id) for request_id in activity.prefilled]
        batch = [(self._streams[request_id], event) for request_id, event in activity.events]
        for finished in activity.finished:
            released.append(self._release_parked(finished.request_id))
            del self._streams[finished.request_id]
            with self._accepted_lock:
                self._accepted -= 1
        if batch:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_deliver_all, batch)
        self.metrics.record(activity)
        if self.telemetry is not None:
            self.telemetry.record(activity)
        if activity.resources is not None:
            self._resources = activity.resources
        if any(released):
            self._publish(self.core.take())
