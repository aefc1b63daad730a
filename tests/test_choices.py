"""Several choices of one prompt (OpenAI's `n`) in the engine, on the CPU reference executor with a
random-weight Qwen3 core: a later choice waits for the first one's prefill and restores the
prompt from the prefix cache, samples as it would alone, and a choice cancelled while it waits
is finished and frees nothing it never held."""

from __future__ import annotations

import asyncio
import dataclasses

from flare_core.requests import GenerationRequest, SamplingParams
from flare_testing.engine import make_engine, run_requests

# A flat distribution (this random model's logits are peaked), so that seeds tell choices apart.
LEADER = GenerationRequest(prompt_ids=tuple(range(300, 420)), max_tokens=10, ignore_eos=True,
                           sampling=SamplingParams(temperature=50.0, seed=40), request_id="choice")


async def collect(stream):
    tokens, last = [], None
    async for event in stream:
        tokens.extend(event.token_ids)
        last = event
    return tokens, last.finish_reason, last.usage


async def run_choices(engine, requests, cancel_waiting: bool = False):
    engine.start()
    try:
        leader = engine.submit(requests[0])
        others = [engine.submit(r, leader=leader) for r in requests[1:]]
        if cancel_waiting:
            for stream in others:
                stream.cancel()
        return await asyncio.gather(*(collect(s) for s in [leader, *others]))
    finally:
        await engine.aclose()


def test_later_choices_reuse_the_first_ones_prefill(session_flare, qwen3_core):
    engine = make_engine(session_flare, qwen3_core, frames=2)
    choices = [LEADER] + [dataclasses.replace(LEADER, request_id=f"choice.{i}",
                                              sampling=dataclasses.replace(LEADER.sampling, seed=40 + i))
                          for i in (1, 2)]
    results = asyncio.run(run_choices(engine, choices))
    prompt = len(LEADER.prompt_ids)
    assert results[0][2].cached_tokens == 0
    # Each later choice restored the whole prompt and sampled its first token from stored logits.
    assert [usage.cached_tokens for _, _, usage in results[1:]] == [prompt, prompt]
    assert all(reason == "length" and len(tokens) == 10 for tokens, reason, _ in results)
    # Alone, each choice gives the same tokens: restoring changes nothing it samples.
    alone = [asyncio.run(run_requests(make_engine(session_flare, qwen3_core, frames=2), [choice]))[0][0]
             for choice in choices]
    assert [tokens for tokens, _, _ in results] == alone
    assert len({tuple(tokens) for tokens in alone}) == 3  # seeds 40, 41, 42 differ
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0


def test_a_choice_cancelled_while_waiting_for_the_prefill(session_flare, qwen3_core):
    engine = make_engine(session_flare, qwen3_core, frames=2)
    waiting = dataclasses.replace(LEADER, request_id="choice.1")
    [(tokens, reason, _), (others, other_reason, usage)] = asyncio.run(run_choices(engine, [LEADER, waiting],
                                                                                  cancel_waiting=True))
    assert reason == "length" and len(tokens) == 10
    assert other_reason == "cancelled" and others == [] and usage.completion_tokens == 0
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0 and engine.active_requests() == 0


def test_a_choice_cancelled_before_it_is_admitted_is_not_run(session_flare, qwen3_core):
    """The leader and its choice, both cancelled before the model thread reads anything (all
    messages posted before it starts, so it reads them in order): both end cancelled with no
    token, and nothing stays held or parked."""
    engine = make_engine(session_flare, qwen3_core, frames=2)

    async def cancelled_pair():
        leader = engine.submit(LEADER)
        leader.cancel()
        waiting = engine.submit(dataclasses.replace(LEADER, request_id="choice.1"), leader=leader)
        waiting.cancel()
        engine.start()
        try:
            return await asyncio.gather(collect(leader), collect(waiting))
        finally:
            await engine.aclose()

    [(tokens, reason, _), (others, other_reason, usage)] = asyncio.run(cancelled_pair())
    assert (tokens, reason) == ([], "cancelled")
    assert (others, other_reason, usage.completion_tokens) == ([], "cancelled", 0)
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0 and engine.active_requests() == 0