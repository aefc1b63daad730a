"""A request as the engine core holds it while it runs: its output processing, its place in its
grammar, its penalty history binding and its timings. Only the engine core's thread touches it."""

from __future__ import annotations

from dataclasses import dataclass

from flare_core.executor.sampling import PenaltyState, PromptScores, SampleOutput
from flare_core.frontend import Tokenizer
from flare_core.frontend.grammar import GrammarMatcher
from flare_core.frontend.output import Finish, OutputProcessor
from flare_core.requests import GenerationEvent, GenerationRequest, check_request
from flare_core.scheduler import RequestHandle


@dataclass(eq=False)
class LiveRequest:
    request_id: str
    request: GenerationRequest
    output: OutputProcessor
    submitted: float  # time.monotonic() when the client's request was accepted
    matcher: GrammarMatcher | None = None  # the request's place in its grammar (structured output)
    penalties: PenaltyState | None = None  # bound to the history row of the state row that samples next
    penalty_handle: RequestHandle | None = None  # the state row `penalties` is bound to
    cached_tokens: int | None = None  # prompt tokens reused from the prefix cache, once its first work ran
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished: bool = False

    @classmethod
    def admit(cls, request_id: str, request: GenerationRequest, submitted: float, tokenizer: Tokenizer,
              core_stop_ids: frozenset[int], vocab_size: int) -> LiveRequest:
        """The request's state; ValueError naming what of it the runtime cannot serve (the server
        validated it: checked again so that one that got past it fails alone, not in a step it
        shares with others)."""
        check_request(request, vocab_size)
        output = OutputProcessor(request, tokenizer, core_stop_ids)
        matcher = GrammarMatcher(request.grammar) if request.grammar is not None else None
        return cls(request_id, request, output, submitted, matcher)

    @property
    def generated(self) -> int:
        return self.output.generated

    def token(self, token: int, row: int, output: SampleOutput | None) -> tuple[GenerationEvent | None, Finish | None]:
        """Take the token sampled for this request at `row` of a step's `output`: the event to
        deliver and how the request ends, if it does."""
        logprob, top = None, ()
        if self.request.logprobs and output is not None and output.logprobs is not None:
            logprob = float(output.logprobs[row])
            n = self.request.top_logprobs
            if n:
                top = tuple(zip(output.top_ids[row, :n].tolist(), output.top_logprobs[row, :n].tolist()))
        event, finish = self.output.token(token, logprob, top)
        if finish is None and self.matcher is not None and self.matcher.terminated:
            # The grammar is complete and took a stop token (one the request ignores, with ignore_eos).
            finish = Finish("stop", token)
        return event, finish

    def prompt_scores(self, scores: PromptScores) -> GenerationEvent | None:
        return self.output.prompt_scores(scores.start, scores.logprobs.tolist(), scores.top_ids.tolist(),
                                         scores.top_logprobs.tolist())
