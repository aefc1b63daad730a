"""The engine: one model thread owns the scheduler and the executor; the asyncio event loop of
the HTTP server talks to it through a bounded inbox and per-request event queues.

Only the model thread touches the scheduler, the executor and per-request output state. The
event loop submits and cancels through the inbox; events come back with
`loop.call_soon_threadsafe`. Request handles carry state row + generation, so output for a reused
state row never reaches the state row's previous request.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import structlog
import torch

from flare_core.executor import Executor
from flare_core.frontend import Frontend
from flare_core.frontend.grammar import GrammarMatcher
from flare_core.ops.sampling import LogitBias, PenaltyState, SampleOutput, StepSampling
from flare_core.runtime.memory import KvPlan
from flare_core.runtime.metrics import RuntimeMetrics
from flare_core.runtime.output import OutputProcessor
from flare_core.runtime.types import (AdmissionError, EngineInfo, GenerationEvent, GenerationRequest, SamplingParams,
                                     Usage, check_request)
from flare_core.scheduler import RequestHandle, Resources, Scheduler, StepPlan, StepResult

if TYPE_CHECKING:  # the dashboard sits above the runtime; only its type is needed here
    from flare_core.dashboard.telemetry import Telemetry

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


@dataclass(eq=False)
class _Live:
    """Model-thread state of one request: its output processing and accounting."""

    request: GenerationRequest
    stream: RequestStream
    output: OutputProcessor | None  # None for a request refused or cancelled before admission
    submitted: float
    penalties: PenaltyState | None = None  # bound to the executor's history row of the state row that samples next
    cached_tokens: int | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False
    penalty_handle: RequestHandle | None = None  # the state row `penalties` is bound to
    matcher: GrammarMatcher | None = None  # the request's place in its grammar (structured output)

    @property
    def generated(self) -> int:
        return 0 if self.output is None else self.output.generated


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


def _deliver_all(batch: list[tuple[RequestStream, GenerationEvent]]) -> None:
    for stream, event in batch:
        stream._deliver(event)


@dataclass(eq=False)
class _Frame:
    """One issued step whose results the host has not read yet."""

    plan: StepPlan
    issued: float  # perf_counter() at launch
    output: SampleOutput | None = None  # host tensors; filled once `done` and `copied` have passed
    started: torch.cuda.Event | None = None  # CUDA only: bracket the step on the device's clock
    done: torch.cuda.Event | None = None
    copied: torch.cuda.Event | None = None  # the output's copy to the host, where it has its own stream
    tokens: list[int] | None = None  # the sampled tokens, once the host has waited for them
    duration: float = 0.0  # the step's time (on the device's clock on CUDA), once waited for
    matchers_advanced: bool = False  # its tokens have advanced their requests' grammar matchers


class Engine:
    """Runs requests on one model thread; `build_engine` (flare_core.runtime.build) assembles it."""

    def __init__(self, *, info: EngineInfo, frontend: Frontend, scheduler: Scheduler, executor: Executor,
                 kv: KvPlan, vocab_size: int, core_stop_ids: frozenset[int], frames_in_flight: int,
                 telemetry: Telemetry | None = None):
        if frames_in_flight not in (1, 2):
            raise ValueError(f"frames_in_flight must be 1 or 2, got {frames_in_flight}")
        self.info = info
        # All the HTTP layer reads of the core besides `info`: its text side.
        self.frontend = frontend
        self.kv = kv
        self.executor = executor
        # Steps issued ahead of the one whose results are read: with 2, the host plans, launches
        # and later post-processes one step while the device runs the other.
        self.frames_in_flight = frames_in_flight
        # Fed from the model thread only when the dashboard is on; None keeps the step path to one `if`.
        self.telemetry = telemetry
        self.metrics = RuntimeMetrics()
        self._scheduler = scheduler
        self._cuda = executor.device.type == "cuda"
        self._vocab = vocab_size
        self._core_stop_ids = core_stop_ids
        self._resources = scheduler.resources()  # the model thread publishes a fresh one after each change

        self._inbox: queue.Queue = queue.Queue(maxsize=4 * (info.max_concurrency + info.queue_capacity) + 16)
        self._live: dict[str, _Live] = {}
        self._accepted = 0  # submitted and not finished: bounded by max_concurrency + queue_capacity
        self._accepted_lock = threading.Lock()
        self._draining = False
        # Why the model worker stopped, once a step has failed; then every request is refused.
        self.failure: str | None = None
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox: list[tuple[RequestStream, GenerationEvent]] = []  # model thread: events not yet handed over
        self._prefix_seen = (0, 0, 0)
        # Model thread: submits waiting for their leader's prompt to be prefilled, by leader id.
        self._parked: dict[str, list[_Submit]] = {}
        self._thread = threading.Thread(target=self._run, name="flare-model", daemon=True)

    def executor_summary(self) -> str:
        """One line for the startup log: how steps run, and what was compiled and captured."""
        depth = self.frames_in_flight
        return f"{self.executor.summary()}, {depth} step{'s' if depth > 1 else ''} in flight"

    # ---- event-loop side -----------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._update_gauges()

    def submit(self, request: GenerationRequest, leader: RequestStream | None = None) -> RequestStream:
        """Call from the event loop thread (the loop that consumes the returned stream). A request
        with a `leader` (another choice of the same prompt, `n` > 1) is admitted now but scheduled
        once the leader's prompt has been prefilled (its first token sampled): it then restores the
        prompt from the prefix cache rather than computing it again."""
        self._loop = asyncio.get_running_loop()
        if self.failure is not None:
            raise AdmissionError(f"the model worker failed ({self.failure}); the server is exiting", status=503)
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

    async def aclose(self) -> None:
        """Cancel what is left, stop the model thread and wait for it."""
        self._draining = True
        self._post(_Stop())
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    def _post(self, message: _Submit | _Cancel | _Stop) -> None:
        self._inbox.put(message)

    def _emit(self, live: _Live, event: GenerationEvent) -> None:
        self._outbox.append((live.stream, event))

    def _send_events(self) -> None:
        """Hand the events gathered since the last flush to the event loop in one call: each
        call_soon_threadsafe wakes the loop through a socket write, once per step instead of once
        per token."""
        if self._outbox:
            batch, self._outbox = self._outbox, []
            assert self._loop is not None
            self._loop.call_soon_threadsafe(_deliver_all, batch)

    # ---- model thread ----------------------------------------------------------------------

    def _run(self) -> None:
        frames: deque[_Frame] = deque()  # issued steps, oldest first, whose results are unread
        try:
            while True:
                if not self._drain_inbox(block=self._scheduler.is_idle()):
                    while frames:  # a stop: settle the issued steps so that their fences pass
                        self._consume(frames.popleft())
                    break
                plan = self._scheduler.schedule() if len(frames) < self.frames_in_flight else None
                if plan is not None:
                    frames.append(self._launch(plan, frames))
                if frames and (plan is None or len(frames) >= self.frames_in_flight):
                    self._consume(frames.popleft())
                elif plan is None and not self._scheduler.is_idle():
                    # Work exists but nothing can run: requests wait for pages held by the cache
                    # or for resources in flight. Block for the next message rather than spin.
                    if not self._drain_inbox(block=True):
                        break
        except Exception as exc:  # a failed step fails every request; the server then exits
            log.exception("model worker failed")
            self.failure = f"{type(exc).__name__}: {exc}"
            for live in list(self._live.values()):
                self._finish(live, "error", error=f"execution failed: {self.failure}")
        finally:
            self._cancel_all()
            self._send_events()
        if self.failure is not None:
            for callback in self._failure_callbacks:
                callback(self.failure)

    def _drain_inbox(self, block: bool) -> bool:
        """Handle pending messages; False when asked to stop."""
        while True:
            if block:
                self._send_events()  # nothing else would deliver them while this thread waits
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if isinstance(message, _Stop):
                return False
            if isinstance(message, _Submit):
                self._admit(message)
            elif isinstance(message, _Cancel):
                live = self._live.get(message.request_id) or self._unpark(message.request_id)
                if live is not None:
                    self._finish(live, "cancelled")
            # A cancel that leaves the scheduler idle is followed by no step that would refresh them.
            self._update_gauges()

    def _admit(self, message: _Submit) -> None:
        request_id, request, stream, submitted = message.request_id, message.request, message.stream, message.submitted
        leader = self._live.get(message.leader) if message.leader is not None else None
        if leader is not None and leader.generated == 0:
            self._parked.setdefault(leader.stream.request_id, []).append(message)
            return
        if stream.cancelled:  # cancelled while parked, its cancel read after it was released
            live = self._live[request_id] = _Live(request, stream, None, submitted)
            self._finish(live, "cancelled")
            return
        try:
            # The server validated the request; checked again here so that one that got past it
            # fails alone rather than inside a step it shares with others.
            check_request(request, self._vocab)
            output = OutputProcessor(request, self.frontend.tokenizer, self._core_stop_ids)
            matcher = GrammarMatcher(request.grammar) if request.grammar is not None else None
            live = _Live(request, stream, output, submitted, matcher=matcher)
            self._scheduler.submit(request_id, request.prompt_ids, max(request.max_tokens, 1),
                                   message_ends=tuple(m for m in request.message_ends
                                                      if 0 < m <= len(request.prompt_ids)),
                                   score_prompt=request.prompt_logprobs is not None)
        except Exception as exc:  # noqa: BLE001 - whatever the request holds, only the request fails
            log.warning("request refused by the runtime", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
            live = _Live(request, stream, None, submitted)
            self._live[request_id] = live
            self._finish(live, "error", error=f"invalid request: {type(exc).__name__}: {exc}")
            return
        self._live[request_id] = live
        if self.telemetry is not None:
            self.telemetry.request_queued(request_id, len(request.prompt_ids))

    def _release_parked(self, leader_id: str) -> None:
        """Admit the requests that waited for `leader_id`'s prefill (through the inbox: this may
        run in the middle of a step)."""
        for message in self._parked.pop(leader_id, ()):
            self._inbox.put(replace(message, leader=None))

    def _unpark(self, request_id: str) -> _Live | None:
        """A parked request taken out of waiting (cancelled before admission), as a live one to finish."""
        for messages in self._parked.values():
            for message in messages:
                if message.request_id == request_id:
                    messages.remove(message)
                    live = self._live[request_id] = _Live(message.request, message.stream, None, message.submitted)
                    return live
        return None

    def _launch(self, plan: StepPlan, frames: deque[_Frame]) -> _Frame:
        """Issue `plan` and its sampling. Sampled tokens stay on the device as the next decode
        inputs; their host copies are read in `_consume`. Nothing here waits for the device, except
        where a row has a grammar: its mask needs the tokens of the steps in `frames` (still in
        flight), which are waited for once this step's forward is enqueued (see `_token_masks`)."""
        samples = plan.samples
        frame = _Frame(plan, time.perf_counter())
        if self._cuda:
            frame.started = torch.cuda.Event(enable_timing=True)
            frame.started.record()
        sampling = None
        lives = [self._live.get(h.request_id) for h in samples]
        if samples:
            # The scheduler holds each request's confirmed output tokens and counts its samples
            # planned so far, this plan's included: seeded sampling continues its stream from there.
            states = [self._scheduler.request(h.request_id) for h in samples]
            for handle, live, state in zip(samples, lives, states):
                if live is not None and live.request.sampling.penalised and live.penalty_handle != handle:
                    # The executor's history row of this state row becomes this request's (again,
                    # after a preemption moved it), before the step that samples its next token.
                    live.penalties = self.executor.penalties.start(handle.state_row, live.request.prompt_ids,
                                                                   state.outputs)
                    live.penalty_handle = handle
            sampling = StepSampling(
                params=[live.request.sampling if live else SamplingParams(temperature=0.0) for live in lives],
                steps=[state.num_planned_samples - 1 for state in states],
                penalties=[live.penalties if live else None for live in lives],
                logprobs=any(live and live.request.logprobs for live in lives),
                top_logprobs=max((live.request.top_logprobs for live in lives if live and live.request.logprobs),
                                 default=0),
                masks=functools.partial(self._token_masks, lives, frames) if any(
                    live is not None and live.matcher is not None for live in lives) else None,
                logit_bias=self._logit_bias(lives))
        output = self.executor.step(plan, sampling)
        if output is not None:
            frame.output, frame.copied = self.executor.to_host(output)
        if self._cuda:
            frame.done = torch.cuda.Event(enable_timing=True)
            frame.done.record()
        return frame

    def _token_masks(self, lives: list[_Live | None], frames: deque[_Frame]) -> torch.Tensor:
        """The bitmasks of the tokens each sampling row may take (int32 [rows, words]; all bits
        set for rows without a grammar). The executor calls this once the step's forward is
        enqueued: a matcher must first see the token its request sampled in the step still in
        flight, so that step's tokens are waited for here, while the device runs this step's
        forward (rather than the request sitting out every other step). The rest of reading that
        step (`_consume`: output processing, events) waits until this step is issued."""
        for frame in frames:
            self._advance_matchers(frame)
        masks = torch.full((len(lives), self.frontend.grammars.words), -1, dtype=torch.int32, pin_memory=self._cuda)
        for row, live in enumerate(lives):
            # A request that ended in the step just read samples once more, for nothing.
            if live is not None and live.matcher is not None and not live.finished:
                live.matcher.fill(masks, row)
        return masks

    @staticmethod
    def _logit_bias(lives: list[_Live | None]) -> LogitBias | None:
        """The step's logit biases by sampling row, or None when no row has any."""
        entries = [(row, token, value) for row, live in enumerate(lives) if live is not None
                   for token, value in live.request.logit_bias]
        return LogitBias(*zip(*entries)) if entries else None

    def _wait(self, frame: _Frame) -> list[int]:
        """Wait for `frame`'s results on the host; its sampled tokens."""
        if frame.tokens is None:
            if frame.copied is not None:
                frame.copied.synchronize()
            if frame.done is not None:
                frame.done.synchronize()
                frame.duration = frame.started.elapsed_time(frame.done) / 1000.0  # device time of this step
            else:
                frame.duration = time.perf_counter() - frame.issued
            frame.tokens = frame.output.token_ids.tolist() if frame.output is not None else []
        return frame.tokens

    def _advance_matchers(self, frame: _Frame) -> None:
        """Advance the grammar matchers of `frame`'s running requests by the tokens it sampled
        (once). A token its grammar refuses ends that request alone."""
        if frame.matchers_advanced:
            return
        frame.matchers_advanced = True
        for handle, token in zip(frame.plan.samples, self._wait(frame)):
            live = self._live.get(handle.request_id)
            if live is not None and live.matcher is not None and not live.finished and not live.matcher.accept(token):
                log.error("token sampled against its grammar", request_id=handle.request_id, token=token)
                self._finish(live, "error", error=f"output processing failed: token {token} was sampled "
                                                  "against the request's grammar")

    def _consume(self, frame: _Frame) -> None:
        """Read back the oldest issued step: confirm it with the scheduler, then stream its tokens."""
        plan, samples = frame.plan, frame.plan.samples
        token_list, duration = self._wait(frame), frame.duration
        self._advance_matchers(frame)
        output = frame.output
        self._note_first_work(plan)
        confirmed = self._scheduler.complete(plan, StepResult(token_list, duration))
        prefill_tokens = sum(chunk.end - chunk.start for chunk in plan.prefills)
        self.metrics.step_completed(plan.kind.value, len(plan.decodes) + prefill_tokens)
        if self.telemetry is not None:
            self.telemetry.record_step(plan.kind.value, plan.capacity, duration, prefill_tokens=prefill_tokens,
                                       sampled=[s.handle.request_id for s in confirmed],
                                       **self._page_counts())
        for scores in output.prompt_scores if output is not None else ():
            live = self._live.get(scores.request_id)
            if live is not None and not live.finished:
                self._on_prompt_scores(live, scores)
        index_of = {h: i for i, h in enumerate(samples)}
        now = time.monotonic()
        for sampled in confirmed:
            live = self._live.get(sampled.handle.request_id)
            if live is None or live.finished:
                continue
            row = index_of[sampled.handle]
            try:
                self._on_token(live, sampled.token, row, output, now)
            except Exception as exc:  # noqa: BLE001 - its output processing failed: that request alone ends
                log.exception("request output failed", request_id=sampled.handle.request_id)
                self._finish(live, "error", error=f"output processing failed: {type(exc).__name__}: {exc}")
        self._send_events()
        self._sync_prefix_metrics()
        self._update_gauges()

    def _note_first_work(self, plan: StepPlan) -> None:
        """Cached prompt tokens of a request: restored by an exact hit, or where its first chunk starts."""
        for restore in plan.restores:
            live = self._live.get(restore.handle.request_id)
            if live is not None and live.cached_tokens is None and restore.logits_row is not None:
                live.cached_tokens = len(live.request.prompt_ids)
                if self.telemetry is not None:
                    self.telemetry.request_started(restore.handle.request_id, live.cached_tokens)
        for chunk in plan.prefills:
            live = self._live.get(chunk.handle.request_id)
            if live is not None and live.cached_tokens is None:
                live.cached_tokens = chunk.start
                if self.telemetry is not None:
                    self.telemetry.request_started(chunk.handle.request_id, live.cached_tokens)

    def _on_prompt_scores(self, live: _Live, scores) -> None:
        event = live.output.prompt_scores(scores.start, scores.logprobs.tolist(), scores.top_ids.tolist(),
                                          scores.top_logprobs.tolist())
        if event is not None:
            self._emit(live, event)

    def _on_token(self, live: _Live, token: int, row: int, output, now: float) -> None:
        logprob, top = None, ()
        if live.request.logprobs and output is not None and output.logprobs is not None:
            logprob = float(output.logprobs[row])
            n = live.request.top_logprobs
            if n:
                top = tuple(zip(output.top_ids[row, :n].tolist(), output.top_logprobs[row, :n].tolist()))
        event, finish = live.output.token(token, logprob, top)
        if live.output.generated == 1:
            self._release_parked(live.stream.request_id)
        if event is not None:
            if live.first_token_at is None:
                live.first_token_at = now
                self.metrics.observe_ttft(now - live.submitted)
            else:
                self.metrics.observe_itl(now - live.last_token_at)
            live.last_token_at = now
            self._emit(live, event)
        if finish is not None:
            self._finish(live, finish.reason, stop=finish.stop)
        elif live.matcher is not None and live.matcher.terminated:
            # The grammar is complete and took a stop token (one the request ignores, with ignore_eos).
            self._finish(live, "stop", stop=token)

    def _finish(self, live: _Live, reason: str, stop: str | int | None = None, error: str | None = None) -> None:
        if live.finished:
            return
        live.finished = True
        request_id = live.stream.request_id
        self._release_parked(request_id)
        try:
            self._scheduler.finish(request_id, reason)
        except KeyError:
            pass  # never reached the scheduler (rejected at submit)
        self._live.pop(request_id, None)
        if self.telemetry is not None:
            self.telemetry.request_finished(request_id, reason, **self._page_counts())
        cached = live.cached_tokens or 0
        usage = Usage(len(live.request.prompt_ids), live.generated, cached)
        self._emit(live, GenerationEvent(finish_reason=reason, stop=stop, usage=usage, error=error))
        self.metrics.request_finished(reason, usage.prompt_tokens, usage.completion_tokens, cached)
        with self._accepted_lock:
            self._accepted -= 1
        elapsed = time.monotonic() - live.submitted
        ttft = None if live.first_token_at is None else round(live.first_token_at - live.submitted, 4)
        log.info("request finished", request_id=request_id, finish_reason=reason,
                 prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 cached_tokens=cached, ttft_s=ttft, total_s=round(elapsed, 4))

    def _cancel_all(self) -> None:
        for live in list(self._live.values()):
            self._finish(live, "cancelled")
        while True:  # requests that were still in the inbox when the worker stopped
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, _Submit):
                live = _Live(message.request, message.stream, None, message.submitted)
                self._live[message.stream.request_id] = live
                self._finish(live, "cancelled" if self.failure is None else "error", error=self.failure)

    def _sync_prefix_metrics(self) -> None:
        prefix = self._scheduler.prefix
        if prefix is None:
            return
        stats = prefix.stats
        lookups, hits, reused = stats.lookups, stats.hits, stats.reused_tokens
        seen_lookups, seen_hits, seen_reused = self._prefix_seen
        new_hits = hits - seen_hits
        for i in range(new_hits):
            self.metrics.prefix_lookup(True, reused - seen_reused if i == 0 else 0)
        for _ in range(lookups - seen_lookups - new_hits):
            self.metrics.prefix_lookup(False, 0)
        self._prefix_seen = (lookups, hits, reused)

    def _update_gauges(self) -> None:
        self._resources = resources = self._scheduler.resources()
        self.metrics.set_slots(resources.live, self.info.max_concurrency - resources.live)
        self.metrics.set_free_pages(resources.free_pages)
        self.metrics.set_waiting(resources.waiting)

    def _page_counts(self) -> dict[str, int]:
        resources = self._scheduler.resources()
        return {"total_pages": resources.pages, "free_pages": resources.free_pages,
                "cached_pages": resources.cached_pages}

    def resources(self) -> Resources:
        """What requests and the prefix cache held after the model thread's last step or message
        (any thread may read it; it is replaced, never changed)."""
        return self._resources
