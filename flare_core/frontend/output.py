"""One request's output processing: sampled token ids in, GenerationEvents out.

Text is detokenized incrementally (never a split UTF-8 character), stop strings are matched
across token boundaries and withheld from the text, stop tokens and max_tokens end the request,
and logprobs get their tokens' text. Prompt scores (prompt logprobs) are emitted once per
position, also when a preempted request computes its prompt again. Nothing here touches the
scheduler, the executor or the event loop: the engine feeds it and delivers what it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flare_core.frontend import IncrementalDetokenizer, Tokenizer
from flare_core.frontend.stops import StopMatcher
from flare_core.requests import GenerationEvent, GenerationRequest, TokenLogprob


@dataclass(frozen=True)
class Finish:
    """How a request ended: "stop" (with the stop string or token id) or "length"."""

    reason: str
    stop: str | int | None = None


class OutputProcessor:
    def __init__(self, request: GenerationRequest, tokenizer: Tokenizer, core_stop_ids: frozenset[int]):
        self.request = request
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=request.skip_special_tokens)
        self._stops = StopMatcher(request.stop_strings)  # raises on stop strings it cannot serve
        self._stop_ids = frozenset(request.stop_token_ids) | (frozenset() if request.ignore_eos else core_stop_ids)
        self.generated = 0  # output tokens taken so far
        self._scored_to = 0  # prompt positions up to here have had their logprobs emitted

    def token(self, token: int, logprob: float | None = None,
              top: Sequence[tuple[int, float]] = ()) -> tuple[GenerationEvent | None, Finish | None]:
        """Take the next sampled token (with its logprob and the top alternatives when the
        request asked for them): the event to deliver, and how the request ends if it does."""
        if self.request.max_tokens == 0:  # scoring only: the token after the prompt is not output
            return None, Finish("length")
        self.generated += 1
        logprobs = ()
        if logprob is not None:
            logprobs = (self._logprob(token, logprob, top),)
        if token in self._stop_ids:
            # The detokenizer's held text must reach the stop matcher before the matcher releases
            # its own held text: together they can complete a stop string.
            return GenerationEvent(text=self._flush_text(), token_ids=(token,), logprobs=logprobs), \
                Finish("stop", token)
        result = self._stops.feed(self._detokenizer.push(token))
        if result.stop is not None:
            return GenerationEvent(text=result.text, token_ids=(token,), logprobs=logprobs), Finish("stop", result.stop)
        if self.generated >= self.request.max_tokens:
            tail = self._stops.feed(self._detokenizer.flush())
            text = result.text + tail.text + (self._stops.flush() if tail.stop is None else "")
            finish = Finish("length") if tail.stop is None else Finish("stop", tail.stop)
            return GenerationEvent(text=text, token_ids=(token,), logprobs=logprobs), finish
        return GenerationEvent(text=result.text, token_ids=(token,), logprobs=logprobs), None

    def prompt_scores(self, start: int, logprobs: Sequence[float], top_ids: Sequence[Sequence[int]],
                      top_logprobs: Sequence[Sequence[float]]) -> GenerationEvent | None:
        """Logprobs of the prompt tokens at start + 1, start + 2, ... (with alternatives, best
        first); positions emitted before are skipped. None when nothing is new."""
        prompt, n = self.request.prompt_ids, self.request.prompt_logprobs or 0
        emitted = tuple(
            self._logprob(prompt[start + 1 + i], logprobs[i], tuple(zip(top_ids[i][:n], top_logprobs[i][:n])))
            for i in range(max(self._scored_to - start, 0), len(logprobs)))
        if not emitted:
            return None
        self._scored_to = start + len(logprobs)
        return GenerationEvent(prompt_logprobs=emitted)

    def _logprob(self, token: int, logprob: float, top: Sequence[tuple[int, float]]) -> TokenLogprob:
        decode = self._tokenizer.decode
        return TokenLogprob(token, decode([token]), logprob, tuple((t, decode([t]), v) for t, v in top))

    def _flush_text(self) -> str:
        """Text the detokenizer still held when a stop token ended the request."""
        tail = self._stops.feed(self._detokenizer.flush())
        return tail.text + (self._stops.flush() if tail.stop is None else "")
