"""Speculative decoding with prompt-lookup drafts, served: SmolLM2's real weights give the same
tokens and logprobs with it as without it — greedy, seeded sampling (coupled verification), with
stops, budgets, penalties, a grammar and a tight page pool, with one or two steps in flight — while
its decode rows keep two and more drafts per round on a copy-heavy prompt."""

from __future__ import annotations

import asyncio

import pytest
from openai import OpenAI

from flare_core.requests import GenerationRequest, SamplingParams
from flare_testing.server import ServerProcess
from flare_testing.engine import make_engine, run_requests
from test_speculative import PARAGRAPH

MODEL = "smollm2-135m-instruct.q4_1"
REWRITE = [{"role": "user", "content": "Rewrite this paragraph exactly, changing only 'lighthouse' to 'beacon':\n\n"
            + PARAGRAPH}]
SPECULATION = dict(spec_method="prompt-lookup", spec_draft_tokens=4)
ROOMY = 64  # pages of 64 tokens (SmolLM2's float32 page is 2.8 MiB): every request's whole context at once


@pytest.fixture(scope="module")
def rewrite_ids(smollm2_reference_tokenizer) -> tuple[int, ...]:
    return tuple(smollm2_reference_tokenizer.apply_chat_template(REWRITE, add_generation_prompt=True, tokenize=True,
                                                                 return_dict=False))


def _requests(prompt: tuple[int, ...], stop_at: int | None = None) -> list[GenerationRequest]:
    greedy = SamplingParams(temperature=0.0)
    return [
        GenerationRequest(prompt_ids=prompt, max_tokens=90, sampling=greedy, logprobs=True, top_logprobs=2),
        GenerationRequest(prompt_ids=prompt, max_tokens=90, sampling=SamplingParams(temperature=0.8, seed=5)),
        # Penalties: each drafted position's history counts the drafts before it.
        GenerationRequest(prompt_ids=prompt, max_tokens=60, sampling=SamplingParams(
            temperature=0.7, seed=2, frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.05)),
        GenerationRequest(prompt_ids=prompt, max_tokens=7, sampling=greedy),  # a budget inside a round
        GenerationRequest(prompt_ids=prompt, max_tokens=90, sampling=greedy,
                          stop_token_ids=() if stop_at is None else (stop_at,)),
    ]


@pytest.fixture(scope="module")
def plain_outputs(session_flare, smollm2_core, rewrite_ids):
    """(outputs of `_requests` without speculation, the stop token the last request was given)."""
    plain = make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY)
    reference = asyncio.run(run_requests(plain, _requests(rewrite_ids)))
    stop_at = reference[0][0][30]  # a token the greedy answer writes, likely inside a round of kept drafts
    reference[4] = asyncio.run(run_requests(make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY),
                                            _requests(rewrite_ids, stop_at)[4:]))[0]
    return reference, stop_at


@pytest.mark.parametrize("frames", [1, 2])
def test_speculation_changes_no_token(session_flare, smollm2_core, rewrite_ids, plain_outputs, frames):
    reference, stop_at = plain_outputs
    engine = make_engine(session_flare, smollm2_core, frames=frames, kv_pages=ROOMY, **SPECULATION)
    results = asyncio.run(run_requests(engine, _requests(rewrite_ids, stop_at)))
    for (tokens, logprobs, reason, usage), expected in zip(results, reference):
        assert tokens == expected[0] and reason == expected[2]
        assert usage.completion_tokens == expected[3].completion_tokens
        # Logprobs as computed in other batches (a row of drafts beside others): equal to float error.
        assert [(lp[0], lp[2]) for lp in logprobs] == [(lp[0], lp[2]) for lp in expected[1]]
        assert all(abs(lp[1] - ref[1]) < 1e-3 for lp, ref in zip(logprobs, expected[1]))
    assert results[4][2] == "stop" and len(results[4][0]) < 90
    if frames == 1:  # the penalised request alone: it speculates, and its drafts are kept
        alone = make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY, **SPECULATION)
        assert asyncio.run(run_requests(alone, _requests(rewrite_ids)[2:3]))[0][0] == reference[2][0]
        assert alone.resources().accepted_drafts > 0, alone.resources()
    resources = engine.resources()
    assert resources.draft_rounds > 0 and resources.accepted_drafts >= resources.draft_rounds, resources
    assert resources.live == 0 and resources.request_page_refs == 0 and resources.steps_in_flight == 0
    assert resources.free_pages + resources.cached_pages == resources.pages


def test_speculation_under_a_grammar(session_flare, smollm2_core, smollm2_reference_tokenizer):
    """A JSON-schema answer that quotes the prompt's paragraph: each drafted row is masked by the
    grammar's place after the drafts before it, the matcher advances by the kept tokens only, and
    the output equals the one without speculation (greedy and seeded), drafts kept."""
    from flare_core.frontend.grammar import GrammarKind, GrammarSpec

    ask = [{"role": "user", "content": "Put this paragraph, word for word, in the field text of a JSON "
                                       "object:\n\n" + PARAGRAPH}]
    prompt = tuple(smollm2_reference_tokenizer.apply_chat_template(ask, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=False))
    schema = '{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}'
    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, schema, "test")

    def requests(engine):
        grammar = engine.frontend.grammars.compile(spec)
        return [GenerationRequest(prompt_ids=prompt, max_tokens=120, grammar=grammar, sampling=sampling)
                for sampling in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=9))]

    plain = make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY)
    reference = asyncio.run(run_requests(plain, requests(plain)))
    # Two steps in flight: the matchers also advance while the next step's masks are made.
    engine = make_engine(session_flare, smollm2_core, frames=2, kv_pages=ROOMY, **SPECULATION)
    results = asyncio.run(run_requests(engine, requests(engine)))
    assert [r[0] for r in results] == [r[0] for r in reference]
    assert [r[2] for r in results] == [r[2] for r in reference]
    greedy = smollm2_reference_tokenizer.decode(results[0][0])
    assert greedy.startswith('{"text": "') and "keeper climbed" in greedy, greedy
    assert engine.resources().accepted_drafts > 0, engine.resources()


def test_a_tight_page_pool_preempts_and_still_changes_no_token(session_flare, qwen3_core):
    """Four requests of 350 tokens (the tiny random Qwen3, whose outputs repeat) in a pool of 16
    pages (they need 24): requests are preempted and come back, drafts take free pages only, and
    the tokens equal those of a roomy run without speculation."""
    requests = [GenerationRequest(prompt_ids=tuple(range(5 + 40 * i, 105 + 40 * i)), max_tokens=250, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0)) for i in range(4)]
    reference = asyncio.run(run_requests(make_engine(session_flare, qwen3_core, frames=1), requests))
    tight = make_engine(session_flare, qwen3_core, frames=2, kv_pages=16, **SPECULATION)
    results = asyncio.run(run_requests(tight, requests))
    assert [r[0] for r in results] == [r[0] for r in reference]
    resources = tight.resources()
    assert resources.preemptions > 0 and resources.accepted_drafts > 0, resources
    assert resources.free_pages + resources.cached_pages == resources.pages


def test_flare_run_speculates_and_counts_its_drafts(session_flare, smollm2_core, smollm2_server, tmp_path):
    """`flare run --spec-method prompt-lookup`: the same answer as a server without it, through the
    openai SDK, and /metrics counts the drafts checked and kept (about 2.5 kept per round here)."""
    server = ServerProcess(session_flare.config_path, smollm2_core, tmp_path / "run.log", "--no-dashboard",
                           "--spec-method", "prompt-lookup", "--spec-draft-tokens", "4").wait_ready()
    try:
        answers = []
        for url in (smollm2_server.url, server.url):
            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            reply = client.chat.completions.create(model=MODEL, messages=REWRITE, max_tokens=100, temperature=0,
                                                   logprobs=True)
            answers.append([(t.token, t.logprob) for t in reply.choices[0].logprobs.content])
        assert [t for t, _ in answers[0]] == [t for t, _ in answers[1]] and len(answers[0]) > 60
        assert all(abs(a - b) < 1e-3 for (_, a), (_, b) in zip(*answers))
        metrics: dict[str, float] = {}
        for line in server.get("/metrics").body.decode().splitlines():  # rounds: one series per width
            if line.startswith("flare_spec_") and line.split("{")[0].split()[0].endswith("_total"):
                name = line.split("{")[0].split()[0]
                metrics[name] = metrics.get(name, 0.0) + float(line.split()[-1])
        widths = [line for line in server.get("/metrics").body.decode().splitlines()
                  if line.startswith("flare_spec_rounds_total{width=")]
        assert widths and all(1 <= int(line.split('"')[1]) <= 4 for line in widths), widths
        rounds, kept = metrics["flare_spec_rounds_total"], metrics["flare_spec_accepted_tokens_total"]
        assert rounds > 0 and metrics["flare_spec_proposed_tokens_total"] >= kept
        assert kept / rounds >= 2.0, metrics
    finally:
        server.stop()
