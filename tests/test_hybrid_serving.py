"""A hybrid recurrent model (Qwen3-Next: Gated DeltaNet state rows + paged attention) exported and
served on the CPU:

* by the engine: a request sharing an earlier one's messages restores that request's state
  snapshot at the message boundary (cached tokens > 0) and generates exactly what a fresh engine
  generates for it without any cache; nothing stays held afterwards;
* by `flare run` through the openai SDK: turn 2 of a chat restores turn 1's snapshot (the real
  Qwen3 template's marks) and answers as a server without a prefix cache does."""

from __future__ import annotations

import asyncio

import pytest

from conftest import write_checkpoint
from server_process import WEATHER_TURN, second_turn_restores_the_first, with_and_without_prefix_cache
from flare_core.requests import GenerationRequest, SamplingParams
from test_engine_frames import make_engine

SHARED = tuple(range(1000, 1077))  # the messages both requests start with (77 tokens: mid-page)
FIRST = GenerationRequest(prompt_ids=SHARED + tuple(range(2000, 2030)), max_tokens=8, message_ends=(len(SHARED),),
                          ignore_eos=True, sampling=SamplingParams(temperature=0.0))
SECOND = GenerationRequest(prompt_ids=SHARED + tuple(range(3000, 3050)), max_tokens=8, message_ends=(len(SHARED),),
                           ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=5))


@pytest.fixture(scope="module")
def qwen3_next_core(session_flare, tmp_path_factory):
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(vocab_size=151936, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=2048,
                             bos_token_id=151643, eos_token_id=151645)
    checkpoint = write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-next"), config)
    return session_flare.export(checkpoint, "--dtype", "float32", "--max-concurrency", "4", "--context-length", "1024",
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


def test_a_request_sharing_messages_restores_the_state_snapshot_exactly(session_flare, qwen3_next_core):
    engine = make_engine(session_flare, qwen3_next_core, frames=1)
    (first, first_usage), (second, second_usage) = asyncio.run(one_by_one(engine, [FIRST, SECOND]))
    assert first_usage.cached_tokens == 0 and second_usage.cached_tokens == len(SHARED)
    [(alone, alone_usage)] = asyncio.run(one_by_one(make_engine(session_flare, qwen3_next_core, frames=1), [SECOND]))
    assert alone_usage.cached_tokens == 0
    assert second == alone and len(second) == 8
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0 and resources.steps_in_flight == 0


@pytest.fixture(scope="module")
def chat_servers(tmp_path_factory, session_flare, qwen3_next_core):
    root = tmp_path_factory.mktemp("hybrid-servers")
    with with_and_without_prefix_cache(session_flare.config_path, qwen3_next_core, root, "next") as clients:
        yield clients


def test_turn_two_of_a_chat_restores_turn_one_and_answers_as_without_cache(chat_servers):
    cached, uncached = chat_servers
    second_turn_restores_the_first(cached, uncached, "next", WEATHER_TURN, "And for Zermatt in the afternoon?")
