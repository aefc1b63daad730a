"""Draft tokens for speculative decoding: what a proposer guesses a request's next tokens are, to be
checked in one step by the target model (flare_core.executor.verification).

A proposer reads the tokens a request holds (prompt, then output) and proposes up to `width` tokens
to follow them; an empty proposal means "decode one token as usual". It is told which request asks
(a proposer that keeps state per request, such as a draft model's cache, keys it by that); its
proposals are guesses only, checked by coupled sampling, so every output stays exactly plain
decoding's. A proposer that `samples` draws each draft for a sampled request as the served model
will draw its token there (`draw`: the request's sampling values and seed; `step`: the tokens it
generated before the first draft), so that the two agree wherever their distributions do (see
flare_core.engine.drafting). `PromptLookup` needs no weights: it finds the longest recent n-gram
that ends the sequence earlier in it and proposes what followed there, which pays off where the
output copies its input (edits of a given text or code, quotes, structured rewrites).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from flare_core.contract import Proposer
from flare_core.requests import SamplingParams

__all__ = ["PromptLookup", "Proposer", "replay"]


@dataclass(frozen=True)
class PromptLookup:
    """N-gram lookup over the request's own tokens: the sequence's last n tokens, for n from
    `max_ngram` down to `min_ngram`, searched for in the tokens before them; at the longest n that
    occurs, the latest occurrence's continuation is proposed (the latest: in an edited copy, the
    place the output is copying now is usually the most recent one)."""

    max_ngram: int = 4
    min_ngram: int = 2
    samples: ClassVar[bool] = False  # it copies tokens the request holds

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"PromptLookup needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def seconds(self, width: int) -> float:
        return 0.0  # a search in the host's memory, microseconds beside any step

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw: SamplingParams | None = None,
                step: int = 0) -> tuple[int, ...]:
        if width <= 0 or len(tokens) <= self.min_ngram:
            return ()
        # Token ids as 4-byte words, so that bytes.rfind runs the search in C; a hit at an offset that
        # is not a multiple of 4 straddles two tokens and is skipped.
        words = array("i", tokens).tobytes()
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            suffix = words[-4 * n:]
            end = len(words) - 4  # an occurrence must end before the sequence's last token
            while True:
                found = words.rfind(suffix, 0, end)
                if found < 0:
                    break
                if found % 4 == 0:
                    start = found // 4 + n
                    return tuple(tokens[start:start + width])
                end = found + 4 * n - 1
        return ()


def replay(proposer: Proposer, prompt: Sequence[int], output: Sequence[int], width: int) -> list[int]:
    """The drafts greedy verification keeps in each round of decoding `output` after `prompt`
    with `proposer` proposing up to `width` tokens per round: a round keeps the proposal's prefix
    that `output` continues with and adds the target's own next token."""
    tokens, kept, position = list(prompt), [], 0
    while position < len(output):
        proposal = proposer.propose(tokens, min(width, len(output) - position - 1))
        run = 0
        while run < len(proposal) and proposal[run] == output[position + run]:
            run += 1
        kept.append(run)
        tokens.extend(output[position:position + run + 1])
        position += run + 1
    return kept
