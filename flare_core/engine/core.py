"""The engine core: requests in, one step at a time, events out. Synchronous and single-threaded;
`flare_core.engine.service.Engine` runs it on a thread behind an async interface.

`step()` is the whole loop body: plan the next step while fewer than `frames_in_flight` are
issued (the scheduler), launch it with its sampling (the executor), and read back the oldest
issued step once the pipeline is full or nothing new could be planned: the scheduler confirms
its tokens, each token goes through its request's output processing, and the events and
statistics gathered come back as one `Activity`. With two frames in flight the host plans and
launches step N+1 while the device runs step N; sampled tokens stay on the device as the next
decode inputs. `_finish` is the one place a request ends.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import structlog
import torch

from flare_core.engine.drafting import drawn_alike
from flare_core.engine.frames import Frame, step_sampling
from flare_core.engine.live import LiveRequest
from flare_core.engine.masks import refused_by_grammars, token_masks
from flare_core.engine.stats import Activity, Finished, HostTimes, StepStats
from flare_core.executor import Executor
from flare_core.frontend import Tokenizer
from flare_core.requests import GenerationEvent, GenerationRequest, Usage
from flare_core.scheduler import Resources, Scheduler, StepPlan, StepResult

log = structlog.get_logger("flare.engine")


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, *, tokenizer: Tokenizer,
                 core_stop_ids: frozenset[int], vocab_size: int, mask_words: int, frames_in_flight: int):
        """`mask_words`: int32 words of a grammar's token bitmask row. `frames_in_flight`: steps
        issued ahead of the one whose results are read (1, or 2 to overlap host and device)."""
        if frames_in_flight not in (1, 2):
            raise ValueError(f"frames_in_flight must be 1 or 2, got {frames_in_flight}")
        self.scheduler = scheduler
        self.executor = executor
        self.frames_in_flight = frames_in_flight
        self._tokenizer, self._core_stop_ids, self._vocab = tokenizer, core_stop_ids, vocab_size
        self._mask_words = mask_words
        self._cuda = executor.device.type == "cuda"
        self._live: dict[str, LiveRequest] = {}
        self._frames: deque[Frame] = deque()  # issued steps, oldest first, whose results are unread
        self._activity = Activity()

    # ---- requests ------------------------------------------------------------------------

    def add(self, request_id: str, request: GenerationRequest, submitted: float | None = None,
            group: str | None = None) -> None:
        """Queue a request (`submitted`: when the client's request was accepted, time.monotonic();
        `group`: the id of the first choice of its client request). Requests share a service price
        with the other requests of their client address, or without one, with their group.
        One the runtime cannot serve ends at once with an error event, alone."""
        submitted = time.monotonic() if submitted is None else submitted
        try:
            request, draw = drawn_alike(request, self.scheduler.config.proposer)
            live = LiveRequest.admit(request_id, request, submitted, self._tokenizer, self._core_stop_ids,
                                     self._vocab)
            self.scheduler.submit(request_id, request.prompt_ids, max(request.max_tokens, 1),
                                  message_ends=tuple(m for m in request.message_ends
                                                     if 0 < m <= len(request.prompt_ids)),
                                  score_prompt=request.prompt_logprobs is not None, group=request.client or group,
                                  client=request.client, draw=draw)
        except Exception as exc:  # noqa: BLE001 - whatever the request holds, only the request fails
            log.warning("request refused by the runtime", request_id=request_id, error=f"{type(exc).__name__}: {exc}")
            self.refuse(request_id, request, "error", error=f"invalid request: {type(exc).__name__}: {exc}")
            return
        self._live[request_id] = live
        self._activity.queued.append((request_id, len(request.prompt_ids)))

    def refuse(self, request_id: str, request: GenerationRequest, reason: str, error: str | None = None) -> None:
        """End a request the core never ran (refused, or cancelled before it was added)."""
        self._report_finish(request_id, reason, Usage(len(request.prompt_ids), 0, 0), error=error)

    def abort(self, request_id: str, reason: str = "cancelled", error: str | None = None) -> bool:
        """End a live request now (its state row and pages return at its fence); False if unknown."""
        live = self._live.get(request_id)
        if live is None:
            return False
        self._finish(live, reason, error=error)
        return True

    def abort_all(self, error: str | None = None) -> None:
        """End every live request: cancelled, or with `error` (a failed step)."""
        for live in list(self._live.values()):
            self._finish(live, "cancelled" if error is None else "error",
                         error=None if error is None else f"execution failed: {error}")

    def generated(self, request_id: str) -> int | None:
        """Output tokens a live request has taken so far; None if it is not live."""
        live = self._live.get(request_id)
        return None if live is None else live.generated

    def is_idle(self) -> bool:
        return self.scheduler.is_idle()

    def resources(self) -> Resources:
        return self.scheduler.resources()

    # ---- steps ---------------------------------------------------------------------------

    def step(self) -> Activity:
        """Plan and launch the next step if fewer than `frames_in_flight` are issued, then read
        back the oldest one if the pipeline is full or nothing new was planned. Returns what
        happened since the last report; `Activity.progressed` is False when nothing could run
        (requests wait for pages or state rows held by steps in flight or the cache)."""
        started = time.perf_counter()
        plan = self.scheduler.schedule() if len(self._frames) < self.frames_in_flight else None
        if plan is not None:
            self._frames.append(self._launch(plan, time.perf_counter() - started))
            self._activity.issued += 1
        if self._frames and (plan is None or len(self._frames) >= self.frames_in_flight):
            self._consume(self._frames.popleft())
        return self.take()

    def settle(self) -> Activity:
        """Read back every issued step (so that their fences pass)."""
        while self._frames:
            self._consume(self._frames.popleft())
        return self.take()

    def take(self) -> Activity:
        """What happened since the last report, with the resources held now."""
        activity, self._activity = self._activity, Activity()
        activity.resources = self.scheduler.resources()
        activity.prefix = self.scheduler.kv.prefix_stats
        return activity

    def _launch(self, plan: StepPlan, schedule_s: float) -> Frame:
        """Issue `plan` and its sampling. Nothing here waits for the device, except where a row
        has a grammar: its mask needs the tokens of the steps in flight (`_token_masks`)."""
        started = time.perf_counter()
        in_flight = tuple(self._frames)
        waited = sum(frame.waited_s for frame in in_flight)
        lives = [self._live.get(h.request_id) for h in plan.samples]
        masks = None
        if any(live is not None and live.matcher is not None for live in lives):
            masks = lambda: self._token_masks(plan, lives, in_flight)  # noqa: E731 - called once the forward is enqueued
        frame = Frame.launch(self.executor, plan, step_sampling(plan, lives, self.scheduler, self.executor, masks),
                             self._cuda)
        blocked = sum(f.waited_s for f in in_flight) - waited  # counted as the waits of those frames
        frame.host = HostTimes(schedule_s=schedule_s, launch_s=time.perf_counter() - started - blocked)
        return frame

    def _token_masks(self, plan: StepPlan, lives: list[LiveRequest | None],
                     in_flight: tuple[Frame, ...]) -> torch.Tensor:
        """The step's token bitmasks (flare_core.engine.masks), once the matchers have seen the
        tokens of the steps in flight: those are waited for here, while the device runs this
        step's forward (rather than the request sitting out every other step)."""
        for frame in in_flight:
            self._advance_matchers(frame)
        return token_masks(plan, lives, self._mask_words, self._cuda)

    def _advance_matchers(self, frame: Frame) -> None:
        """Advance the grammar matchers of `frame`'s requests by its tokens (once); a token its
        grammar refuses ends that request alone."""
        if not frame.matchers_advanced:
            frame.matchers_advanced = True
            for live, token in refused_by_grammars(frame.plan, frame.wait(), self._live):
                log.error("token sampled against its grammar", request_id=live.request_id, token=token)
                self._finish(live, "error", error=f"output processing failed: token {token} was sampled "
                                                  "against the request's grammar")

    def _consume(self, frame: Frame) -> None:
        """Read back the oldest issued step: confirm it with the scheduler, then stream its tokens."""
        started, waited = time.perf_counter(), frame.waited_s
        plan, output = frame.plan, frame.output
        tokens = frame.wait()
        self._advance_matchers(frame)
        self._note_first_work(plan)
        confirmed = self.scheduler.complete(plan, StepResult(tokens, frame.duration))
        for scores in output.prompt_scores if output is not None else ():
            live = self._live.get(scores.request_id)
            event = live.prompt_scores(scores) if live is not None and not live.finished else None
            if event is not None:
                self._activity.events.append((live.request_id, event))
        now = time.monotonic()
        sampled = []
        for token in confirmed:
            live = self._live.get(token.handle.request_id)
            if live is None or live.finished:
                continue
            sampled.append(live.request_id)
            try:
                self._take_token(live, token.token, token.row, output, now)
            except Exception as exc:  # noqa: BLE001 - its output processing failed: that request alone ends
                log.exception("request output failed", request_id=live.request_id)
                self._finish(live, "error", error=f"output processing failed: {type(exc).__name__}: {exc}")
        read_s = time.perf_counter() - started - (frame.waited_s - waited)
        self._activity.steps.append(StepStats(
            plan.kind.value, plan.capacity, frame.duration, plan.fed_tokens, plan.prompt_tokens,
            tuple(sampled), HostTimes(frame.host.schedule_s, frame.host.launch_s, read_s, frame.waited_s)))

    def _note_first_work(self, plan: StepPlan) -> None:
        """Cached prompt tokens of a request: restored by an exact hit, or where its first chunk starts."""
        firsts = [(r.handle.request_id, None) for r in plan.restores if r.logits_row is not None]
        for request_id, start in firsts + [(c.handle.request_id, c.start) for c in plan.prefills]:
            live = self._live.get(request_id)
            if live is not None and live.cached_tokens is None:
                live.cached_tokens = len(live.request.prompt_ids) if start is None else start
                self._activity.started.append((request_id, live.cached_tokens))

    def _take_token(self, live: LiveRequest, token: int, row: int, output, now: float) -> None:
        event, finish = live.token(token, row, output)
        if live.generated == 1:
            self._activity.prefilled.append(live.request_id)
        if event is not None:
            if live.first_token_at is None:
                event = dataclasses.replace(event, cached_tokens=live.cached_tokens or 0)
                live.first_token_at = now
                self._activity.first_token_s.append(now - live.submitted)
            else:
                self._activity.token_gaps_s.append(now - live.last_token_at)
            live.last_token_at = now
            self._activity.events.append((live.request_id, event))
        if finish is not None:
            self._finish(live, finish.reason, stop=finish.stop)

    def _finish(self, live: LiveRequest, reason: str, stop: str | int | None = None, error: str | None = None) -> None:
        """End `live` (once): the scheduler stops it (its state row and pages return at its
        fence) and its last event carries the finish reason and usage."""
        if live.finished:
            return
        live.finished = True
        self.scheduler.finish(live.request_id, reason)
        del self._live[live.request_id]
        usage = Usage(len(live.request.prompt_ids), live.generated, live.cached_tokens or 0)
        self._report_finish(live.request_id, reason, usage, stop=stop, error=error)
        ttft = None if live.first_token_at is None else round(live.first_token_at - live.submitted, 4)
        log.info("request finished", request_id=live.request_id, finish_reason=reason,
                 prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                 cached_tokens=usage.cached_tokens, ttft_s=ttft, total_s=round(time.monotonic() - live.submitted, 4))

    def _report_finish(self, request_id: str, reason: str, usage: Usage, stop: str | int | None = None,
                       error: str | None = None) -> None:
        self._activity.finished.append(Finished(request_id, reason, usage))
        self._activity.events.append((request_id, GenerationEvent(finish_reason=reason, stop=stop, usage=usage,
                                                                  error=error)))
