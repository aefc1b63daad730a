"""Structured output on the model thread: the token bitmasks a step's rows sample under, and the
grammar matchers advanced by the tokens a step sampled.

A decode with drafts (speculative decoding) masks its row i by the grammar's place after its
first i drafts, on a fork of its matcher; past a draft the grammar refuses, its rows are left
open, since their samples are dropped anyway (the sample before that draft, masked, differs
from it). Its matcher then advances by the tokens the step keeps only."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from flare_core.engine.live import LiveRequest
from flare_core.frontend.grammar import GrammarMatcher
from flare_core.scheduler import RequestHandle, StepPlan, dropped_rows


def token_masks(plan: StepPlan, lives: Sequence[LiveRequest | None], words: int, pin: bool) -> torch.Tensor:
    """int32 [rows, words]: the tokens each of `plan`'s sample rows may take (`lives[i]`: row i's
    request; all bits set for rows without a grammar)."""
    masks = torch.full((len(lives), words), -1, dtype=torch.int32, pin_memory=pin)
    drafts_of = plan.drafts_of
    drafted: dict[RequestHandle, tuple[GrammarMatcher | None, int]] = {}  # fork (None: refused), rows done
    for row, (handle, live) in enumerate(zip(plan.samples, lives)):
        # A request that ended in the step just read samples once more, for nothing.
        if live is None or live.matcher is None or live.finished:
            continue
        if handle not in drafts_of:
            live.matcher.fill(masks, row)
            continue
        fork, position = drafted.get(handle, (live.matcher.forked(), 0))
        if fork is not None and position > 0 and not fork.accept(drafts_of[handle][position - 1]):
            fork = None
        if fork is not None:
            fork.fill(masks, row)
        drafted[handle] = (fork, position + 1)
    return masks


def refused_by_grammars(plan: StepPlan, tokens: Sequence[int],
                        live: Mapping[str, LiveRequest]) -> Iterator[tuple[LiveRequest, int]]:
    """Advance the matchers of `plan`'s live requests by the tokens it sampled (`tokens`, in
    plan.samples order; of a decode with drafts, those kept); yields each request whose grammar
    refuses its token, with that token."""
    dropped = dropped_rows(plan, tokens)
    for row, (handle, token) in enumerate(zip(plan.samples, tokens)):
        request = live.get(handle.request_id)
        if row in dropped or request is None or request.matcher is None or request.finished:
            continue
        if not request.matcher.accept(token):
            yield request, token
