"""Grammar-constrained decoding (structured output) in the engine, on the CPU reference executor
with a random-weight Qwen3 core and the real Qwen3 tokenizer: outputs follow their grammars for
greedy, seeded, penalised and windowed sampling, with one and two steps in flight; requests
without a grammar that share the batches are unchanged; a grammar that waits for the end of
reasoning leaves the output free until then; masks reach the sampler as the grammar says.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import pytest
import torch

from flare_core.executor.sampling import Sampler
from flare_core.frontend.grammar import GrammarKind, GrammarMatcher, GrammarSpec
from flare_core.kernels.token_masks import apply_token_masks
from flare_core.requests import MASK_BITS
from flare_core.requests import GenerationRequest, SamplingParams
from flare_testing.engine import make_engine, run_requests

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 2, 3]},
                                           "tag": {"type": "string", "enum": ["red", "green"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
SAMPLINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=11),
             SamplingParams(temperature=0.8, top_k=20, seed=5),
             SamplingParams(temperature=0.7, top_p=0.9, seed=3, frequency_penalty=1.0, repetition_penalty=1.3)]
FREE = [GenerationRequest(prompt_ids=tuple(range(40, 90)), max_tokens=10, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0)),
        GenerationRequest(prompt_ids=tuple(range(500, 530)), max_tokens=12, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.9, seed=9))]


def grammar_requests(engine, spec: GrammarSpec, max_tokens: int = 60) -> list[GenerationRequest]:
    grammar = engine.frontend.grammars.compile(spec)
    return [GenerationRequest(prompt_ids=tuple(range(200 + 7 * i, 260 + 7 * i)), max_tokens=max_tokens,
                              sampling=sampling, grammar=grammar) for i, sampling in enumerate(SAMPLINGS)]


def text_of(engine, tokens: list[int]) -> str:
    return engine.frontend.tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("frames", [1, 2])
def test_json_schema_outputs_are_instances_and_free_requests_are_unchanged(session_flare, qwen3_core, frames):
    engine = make_engine(session_flare, qwen3_core, frames=frames)
    constrained = grammar_requests(engine, GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), "test"))
    results = asyncio.run(run_requests(engine, [*constrained, *FREE]))
    for tokens, _, reason, usage in results[:len(constrained)]:
        value = json.loads(text_of(engine, tokens))  # a stop token ends it once the object is complete
        assert value["ok"] in (True, False) and value["n"] in (1, 2, 3) and value["tag"] in ("red", "green")
        assert set(value) == {"ok", "n", "tag"} and reason == "stop" and usage.completion_tokens == len(tokens)
    alone = asyncio.run(run_requests(make_engine(session_flare, qwen3_core, frames=frames), FREE))
    assert results[len(constrained):] == alone
    resources = engine.resources()
    assert resources.live == 0 and resources.request_page_refs == 0 and resources.steps_in_flight == 0


def test_two_frames_match_one_under_grammars(session_flare, qwen3_core):
    """Seeded and penalised sampling under a grammar give the same tokens whether or not the
    engine keeps a second step in flight."""
    runs = []
    for frames in (1, 2):
        engine = make_engine(session_flare, qwen3_core, frames=frames)
        spec = GrammarSpec(GrammarKind.REGEX, r"(alpha|beta|gamma)-[0-9]{2,4}( [a-z]{1,6}){1,3}\.", "test")
        runs.append(asyncio.run(run_requests(engine, [*grammar_requests(engine, spec), *FREE])))
    assert runs[0] == runs[1]
    for tokens, _, reason, _ in runs[0][:len(SAMPLINGS)]:
        assert re.fullmatch(r"(alpha|beta|gamma)-[0-9]{2,4}( [a-z]{1,6}){1,3}\.", text_of(engine, tokens))
        assert reason == "stop"


def test_a_grammar_request_samples_in_every_step_with_two_in_flight(session_flare, qwen3_core):
    """Its mask is filled once the step's forward is enqueued, after the step in flight is read,
    so a request with a grammar decodes in every step next to one without, not every other."""
    engine = make_engine(session_flare, qwen3_core, frames=2)
    [constrained] = grammar_requests(engine, GrammarSpec(GrammarKind.REGEX, r"[a-z]{40}", "test"))[:1]
    sampled_by_step = []
    step = engine.core.executor.step

    def recording_step(plan, sampling):
        sampled_by_step.append({handle.request_id for handle in plan.samples})
        return step(plan, sampling)

    engine.core.executor.step = recording_step
    free = dataclasses.replace(FREE[0], max_tokens=60)
    [(tokens, _, reason, _), _] = asyncio.run(run_requests(engine, [constrained, free]))
    assert re.fullmatch(r"[a-z]{40}", text_of(engine, tokens)) and reason == "stop"
    steps = [i for i, ids in enumerate(sampled_by_step) if "req-0" in ids]
    # The step planned while its last one was in flight samples it once more, for nothing.
    assert len(steps) - len(tokens) in (0, 1) and steps == list(range(steps[0], steps[0] + len(steps)))


def test_choice_ebnf_and_json_object(session_flare, qwen3_core):
    engine = make_engine(session_flare, qwen3_core, frames=2)
    choices = ("Paris", "Lyon", "Marseille")
    requests = [*grammar_requests(engine, GrammarSpec(GrammarKind.CHOICE, choices, "test")),
                *grammar_requests(engine, GrammarSpec(GrammarKind.EBNF, 'root ::= "yes" | "no" | "maybe " [0-9]',
                                                      "test")),
                *grammar_requests(engine, GrammarSpec(GrammarKind.JSON_OBJECT, "", "test"), max_tokens=200)]
    results = asyncio.run(run_requests(engine, requests))
    texts = [text_of(engine, r[0]) for r in results]
    assert all(t in choices for t in texts[:4]), texts[:4]
    assert all(re.fullmatch(r"yes|no|maybe [0-9]", t) for t in texts[4:8]), texts[4:8]
    for text, result in zip(texts[8:], results[8:]):  # a random model may run out of tokens inside the object
        assert text.startswith("{") and (result[2] == "length" or isinstance(json.loads(text), dict)), text


def test_grammar_after_reasoning_leaves_the_reasoning_free(session_flare, qwen3_core):
    """With `starts_after` the output is unconstrained until that token; from the next one on it
    follows the grammar. The random model never writes `</think>` on its own, so here the
    closing token is one the free output produces: its first greedy token."""
    engine = make_engine(session_flare, qwen3_core, frames=2)
    free = GenerationRequest(prompt_ids=tuple(range(200, 260)), max_tokens=3, ignore_eos=True,
                             sampling=SamplingParams(temperature=0.0))
    [(free_tokens, *_)] = asyncio.run(run_requests(engine, [free]))
    grammar = engine.frontend.grammars.compile(GrammarSpec(GrammarKind.CHOICE, ("red", "green"), "test"),
                                               starts_after=free_tokens[0])
    engine = make_engine(session_flare, qwen3_core, frames=2)
    [(tokens, _, reason, _)] = asyncio.run(run_requests(engine, [dataclasses.replace(free, max_tokens=20,
                                                                                      grammar=grammar)]))
    assert tokens[0] == free_tokens[0] and text_of(engine, tokens[1:]) in ("red", "green") and reason == "stop"


def test_masks_bind_every_sampling_mode():
    vocab = 100
    torch.manual_seed(0)
    logits = torch.randn(4, vocab) * 3
    allowed = [{5, 17, 99}, {0}, set(range(32, 64)), {63, 64}]
    masks = torch.zeros(4, (vocab + MASK_BITS - 1) // MASK_BITS, dtype=torch.int32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            word, bit = divmod(token, MASK_BITS)
            masks[row, word] |= torch.tensor(1 << bit).to(torch.int32)  # bit 31 wraps to the sign bit
    masked = apply_token_masks(logits.clone(), masks)
    assert [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in masked] == allowed
    sampler = Sampler(seed=1)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=2.0, top_k=3, seed=4), SamplingParams(temperature=1.0, top_p=0.5)]
    for _ in range(20):
        tokens = sampler.sample(logits, params, [0, 1, 2, 3], masks=masks, logprobs=True).token_ids.tolist()
        assert all(token in allowed[row] for row, token in enumerate(tokens)), tokens


def test_matcher_waits_for_its_start_token(session_flare, qwen3_core):
    engine = make_engine(session_flare, qwen3_core, frames=1)
    grammars = engine.frontend.grammars
    matcher = GrammarMatcher(grammars.compile(GrammarSpec(GrammarKind.CHOICE, ("ab",), "test"), starts_after=7))
    masks = torch.zeros(1, grammars.words, dtype=torch.int32)
    matcher.fill(masks, 0)
    assert (masks == -1).all() and matcher.accept(123) and not matcher.active
    assert matcher.accept(7) and matcher.active
    matcher.fill(masks, 0)
    allowed = apply_token_masks(torch.zeros(1, grammars.vocab_size), masks).isfinite().nonzero()[:, 1].tolist()
    tokenizer = engine.frontend.tokenizer
    assert allowed and all("ab".startswith(tokenizer.decode([t])) for t in allowed)
    assert not matcher.accept(tokenizer.encode("zz")[0])


def test_logit_bias_forces_and_bans_tokens(session_flare, qwen3_core):
    """OpenAI's logit_bias: +100 makes a token all but certain, -100 bans it in effect; with one
    and two steps in flight, next to requests without a bias, which are unchanged."""
    base = GenerationRequest(prompt_ids=tuple(range(200, 260)), max_tokens=8, ignore_eos=True,
                             sampling=SamplingParams(temperature=0.0))
    results = []
    for frames in (1, 2):
        engine = make_engine(session_flare, qwen3_core, frames=frames)
        [(free, *_)] = asyncio.run(run_requests(engine, [base]))
        engine = make_engine(session_flare, qwen3_core, frames=frames)
        forced = dataclasses.replace(base, logit_bias=((1234, 100.0),),
                                     sampling=SamplingParams(temperature=1.0, seed=2))
        banned = dataclasses.replace(base, logit_bias=tuple((token, -100.0) for token in set(free)))
        results.append(asyncio.run(run_requests(engine, [forced, banned, *FREE])))
        assert results[-1][0][0] == [1234] * 8
        assert not set(results[-1][1][0]) & set(free) and len(results[-1][1][0]) == 8
    assert results[0] == results[1]
    assert results[0][2:] == asyncio.run(run_requests(make_engine(session_flare, qwen3_core, frames=2), FREE))


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(session_flare, qwen3_core):
    """The stop token a complete grammar allows ends the request; with ignore_eos the request
    would otherwise go on against a grammar that allows nothing more."""
    engine = make_engine(session_flare, qwen3_core, frames=2)
    [request] = grammar_requests(engine, GrammarSpec(GrammarKind.CHOICE, ("north", "south"), "test"))[:1]
    results = asyncio.run(run_requests(engine, [dataclasses.replace(request, ignore_eos=True)]))
    [(tokens, _, reason, usage)] = results
    assert text_of(engine, tokens) in ("north", "south") and reason == "stop"
    assert engine.frontend.tokenizer.decode(tokens[-1:]) in ("<|im_end|>", "<|endoftext|>")
    assert engine.resources().live == 0


def test_constrain_maps_sampling_rows_onto_logits_rows():
    """The graph path's logits have a row per graph slot; sampling row i sits at rows[i]. Leading
    rows (decode steps) and rows apart (prompt chunks) mask the same tokens; unmapped rows keep all."""
    from flare_core.executor.sampling import LogitBias, constrain

    vocab, words = 70, 3
    masks = torch.zeros(2, words, dtype=torch.int32)
    masks[0, 0], masks[1, 2] = 1 << 3, 1 << 1  # row 0 allows token 3, row 1 token 65
    for rows in ([0, 1], [1, 3]):
        logits = constrain(torch.zeros(4, vocab), masks, LogitBias([1], [7], [2.0]), rows)
        allowed = [logits[r].isfinite().nonzero().flatten().tolist() for r in range(4)]
        assert allowed[rows[0]] == [3] and allowed[rows[1]] == [65]
        assert all(allowed[r] == list(range(vocab)) for r in range(4) if r not in rows)
        assert logits[rows[1], 7] == float("-inf")  # biased, then masked out
    assert logits[3, 65] == 0.0
