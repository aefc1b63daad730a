"""The engine with two steps in flight (what the CUDA path runs) against one at a time, on the
CPU reference executor: the same requests must produce the same tokens, logprobs and usage.

With two frames, step N+1 is issued before step N's tokens are read back: decode inputs come
from the device, seeded sampling counts steps that are still in flight, penalties count tokens
the host has not seen, and a request that stops or is cancelled still has a step in flight
whose tokens must be dropped and whose pages must come back at its fence.
"""

from __future__ import annotations

import asyncio

import pytest

from flare_testing.engine import make_engine, run_requests
from flare_core.requests import GenerationRequest, SamplingParams

REQUESTS = [
    GenerationRequest(prompt_ids=tuple(range(5, 40)), max_tokens=12, sampling=SamplingParams(temperature=0.0),
                      ignore_eos=True, logprobs=True, top_logprobs=2),
    GenerationRequest(prompt_ids=tuple(range(100, 300)), max_tokens=9, ignore_eos=True,
                      sampling=SamplingParams(temperature=0.9, top_p=0.9, seed=7)),
    GenerationRequest(prompt_ids=tuple(range(50, 53)), max_tokens=15, ignore_eos=True,
                      sampling=SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5,
                                              repetition_penalty=1.3)),
    GenerationRequest(prompt_ids=tuple(range(7, 80)), max_tokens=6, ignore_eos=True,
                      sampling=SamplingParams(temperature=1.0, top_k=5, seed=3), stop_token_ids=()),
    # Ends early on whatever it generates third (a per-request stop token): a step of it is in flight.
    GenerationRequest(prompt_ids=tuple(range(300, 340)), max_tokens=20, ignore_eos=True,
                      sampling=SamplingParams(temperature=0.0)),
]


@pytest.fixture(scope="module")
def reference(session_flare, qwen3_core):
    engine = make_engine(session_flare, qwen3_core, frames=1)
    return asyncio.run(run_requests(engine, REQUESTS))


def test_two_frames_match_one(session_flare, qwen3_core, reference):
    engine = make_engine(session_flare, qwen3_core, frames=2)
    results = asyncio.run(run_requests(engine, REQUESTS))
    assert results == reference
    assert engine.core.frames_in_flight == 2
    assert engine.executor_summary() == "eager reference (plain-torch paged attention), 2 steps in flight"
    resources = engine.resources()
    assert resources.live == 0 and resources.waiting == 0 and resources.steps_in_flight == 0


def test_two_frames_stop_token_and_cancel_release_everything(session_flare, qwen3_core, reference):
    # Request 4 stops on its third greedy token (found in the reference run); request 0 is
    # cancelled after its fourth token. Both have a later step in flight when they end.
    third = reference[4][0][2]
    stopping = GenerationRequest(prompt_ids=REQUESTS[4].prompt_ids, max_tokens=20, ignore_eos=True,
                                 stop_token_ids=(third,), sampling=SamplingParams(temperature=0.0))
    requests = [*REQUESTS[:4], stopping]
    engine = make_engine(session_flare, qwen3_core, frames=2)
    results = asyncio.run(run_requests(engine, requests, cancel_after={0: 4}))
    stop_tokens, _, stop_reason, stop_usage = results[4]
    assert stop_tokens == reference[4][0][:reference[4][0].index(third) + 1] and stop_reason == "stop"
    assert stop_usage.completion_tokens == len(stop_tokens)
    cancelled_tokens, _, cancel_reason, _ = results[0]
    assert cancel_reason == "cancelled" and cancelled_tokens == reference[0][0][:len(cancelled_tokens)]
    assert results[1:4] == reference[1:4]  # the others are untouched
    # No finished request kept a page, a reference on a shared page, or a state row.
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0
    assert resources.free_pages + resources.cached_pages == resources.pages
    assert resources.free_state_rows == resources.state_rows


def test_penalties_follow_a_request_that_is_preempted_into_another_slot(session_flare, qwen3_core):
    """Penalty histories live in the executor's rows of request slots. A request preempted for
    pages comes back in another slot (or the same one, after other requests used it): its
    history must come back with it, so its tokens match a run with room for everyone."""
    requests = [GenerationRequest(prompt_ids=tuple(range(5 + 40 * i, 105 + 40 * i)), max_tokens=250, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0, frequency_penalty=1.0,
                                                          repetition_penalty=1.2)) for i in range(4)]
    reference = asyncio.run(run_requests(make_engine(session_flare, qwen3_core, frames=2), requests))
    tight = make_engine(session_flare, qwen3_core, frames=2, kv_pages=16)  # one full context: 4 x 350 tokens need 24
    results = asyncio.run(run_requests(tight, requests))
    assert tight.resources().preemptions > 0
    assert [r[0] for r in results] == [r[0] for r in reference]
