"""A hybrid recurrent model (Qwen3-Next: Gated DeltaNet state rows + paged attention) exported and
served on the CPU:

* by the engine: a request sharing an earlier one's messages restores that request's state
  snapshot at the message boundary (cached tokens > 0) and generates exactly what a fresh engine
  generates for it without any cache; nothing stays held afterwards;
* by `flare run` through the openai SDK: turn 2 of a chat restores turn 1's snapshot (the real
  Qwen3 template's marks) and answers as a server without a prefix cache does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from flare_testing.engine import make_engine, run_requests
from flare_testing.qwen import tiny_qwen3_next_config, write_checkpoint
from flare_testing.server import (Flare, WEATHER_TURN, second_turn_restores_the_first, with_and_without_prefix_cache,
                                  write_config)
from flare_core.requests import GenerationRequest, SamplingParams

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"  # the suites' shared tokenizers and templates
SHARED = tuple(range(1000, 1077))  # the messages both requests start with (77 tokens: mid-page)
FIRST = GenerationRequest(prompt_ids=SHARED + tuple(range(2000, 2030)), max_tokens=8, message_ends=(len(SHARED),),
                          ignore_eos=True, sampling=SamplingParams(temperature=0.0))
SECOND = GenerationRequest(prompt_ids=SHARED + tuple(range(3000, 3050)), max_tokens=8, message_ends=(len(SHARED),),
                           ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=5))


@pytest.fixture(scope="module")
def flare(tmp_path_factory) -> Flare:
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module")
def qwen3_next_core(flare, tmp_path_factory):
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-next"), tiny_qwen3_next_config(), FIXTURES)
    return flare.export(checkpoint, "--dtype", "float32", "--max-concurrency", "4", "--context-length", "1024",
                                "--prefill-chunk-size", "128")


async def one_by_one(engine, requests):
    """Each request run to its end before the next is submitted: (tokens, usage) per request."""
    engine.start()
    try:
        results = []
        for request in requests:
            tokens, last = [], None
            async for event in engine.submit(request):
                tokens.extend(event.token_ids)
                last = event
            results.append((tokens, last.usage))
        return results
    finally:
        await engine.aclose()


def test_a_request_sharing_messages_restores_the_state_snapshot_exactly(flare, qwen3_next_core):
    engine = make_engine(flare, qwen3_next_core, frames=1)
    (first, first_usage), (second, second_usage) = asyncio.run(one_by_one(engine, [FIRST, SECOND]))
    assert first_usage.cached_tokens == 0 and second_usage.cached_tokens == len(SHARED)
    [(alone, alone_usage)] = asyncio.run(one_by_one(make_engine(flare, qwen3_next_core, frames=1), [SECOND]))
    assert alone_usage.cached_tokens == 0
    assert second == alone and len(second) == 8
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0 and resources.steps_in_flight == 0


@pytest.fixture(scope="module")
def chat_servers(tmp_path_factory, flare, qwen3_next_core):
    root = tmp_path_factory.mktemp("hybrid-servers")
    with with_and_without_prefix_cache(flare.config_path, qwen3_next_core, root, "next") as clients:
        yield clients


def test_turn_two_of_a_chat_restores_turn_one_and_answers_as_without_cache(chat_servers):
    cached, uncached = chat_servers
    second_turn_restores_the_first(cached, uncached, "next", WEATHER_TURN, "And for Zermatt in the afternoon?")


@pytest.mark.parametrize("frames", [1, 2], ids=["one-step", "two-steps-in-flight"])
def test_speculative_decoding_over_continuation_state_changes_no_token(flare, qwen3_next_core, frames):
    """Prompt lookup over a hybrid core served by the engine, one step at a time and with two in
    flight (as on CUDA: a request waits for its round to settle before it rewinds or decodes on):
    `build_engine` has the executor keep each state row before a round and the scheduler rewind
    after a partly refused one. A logit bias keeps the random model's output to three tokens, so
    its n-grams recur and rounds are proposed where the measured step costs let them pay (how
    many depends on the machine's load: the recipes' rollback tests check every rewound row's
    logits against the reference). Greedy with logprobs, and seeded with penalties: the same
    tokens and logprobs as without speculation, and every row and page back. The memory plan
    counts the rows' copies."""
    bias = ((1001, 30.0), (1002, 30.0), (1003, 30.0))
    prompt = tuple(range(1000, 1040))
    requests = [GenerationRequest(prompt_ids=prompt, max_tokens=32, ignore_eos=True, logprobs=True, top_logprobs=2,
                                  logit_bias=bias, sampling=SamplingParams(temperature=0.0)),
                GenerationRequest(prompt_ids=prompt[7:], max_tokens=32, ignore_eos=True, logit_bias=bias,
                                  sampling=SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.5))]
    plain_engine = make_engine(flare, qwen3_next_core, frames=1)
    plain = asyncio.run(run_requests(plain_engine, requests))
    engine = make_engine(flare, qwen3_next_core, frames=frames, spec_method="prompt-lookup",
                         spec_draft_tokens=4)
    assert engine.core.scheduler.speculation.rewinds and engine.core.executor.state.round_saves
    # The memory plan counted the copies: 4 live rows, 8 snapshot rows, 4 + 1 saved rows.
    assert (plain_engine.kv.state_rows, engine.kv.state_rows) == (4 + 8, 4 + 8 + 5)
    drafted = asyncio.run(run_requests(engine, requests))
    for (tokens, logprobs, reason, _), expected in zip(drafted, plain):
        assert tokens == expected[0] and reason == expected[2] and len(tokens) == 32
        assert [(lp[0], lp[2]) for lp in logprobs] == [(lp[0], lp[2]) for lp in expected[1]]
        assert all(abs(lp[1] - ref[1]) < 1e-3 for lp, ref in zip(logprobs, expected[1]))
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0 and resources.free_state_rows == 4
