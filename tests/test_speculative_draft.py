"""Speculative decoding with a draft core (`--spec-method draft --spec-draft-core CORE2`): another
core with the same tokenizer decodes greedily ahead of each request, and its guesses are checked
in one round. SmolLM2's real weights: the same tokens and logprobs as plain decoding with the
served core itself as the draft (its greedy drafts kept) and with a different core (the same
weights exported in bfloat16); a draft of another vocabulary is refused at start, naming the
flag, and the flag goes with the method."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from flare_core.cli import open_verified_core
from flare_core.config import ConfigError, load_config
from flare_core.engine.drafting import DraftModel, draft_page_bytes
from flare_core.engine.load import load_core
from flare_core.engine.memory import plan_kv
from flare_core.plugins import load_registry
from flare_core.requests import GenerationRequest, SamplingParams
from openai import OpenAI
from flare_testing.server import ServerProcess
from flare_testing.engine import make_engine, run_requests
from test_speculative_serving import MODEL, REWRITE, ROOMY, _requests, rewrite_ids  # noqa: F401 - a fixture


def loaded(flare, core):
    config = load_config(flare.config_path)
    return load_core(open_verified_core(config, str(core), trust_publisher=True), load_registry(), torch.device("cpu"))


@pytest.fixture(scope="module")
def bf16_draft_core(session_flare, smollm2_gguf):
    return session_flare.export(smollm2_gguf, "--dtype", "bfloat16", "--max-concurrency", "4",
                                "--context-length", "2048", "--prefill-chunk-size", "256")


@pytest.fixture(scope="module")
def greedy_and_seeded(session_flare, smollm2_core, rewrite_ids):
    """Two requests (greedy with logprobs; seeded with penalties) and their outputs without speculation."""
    requests = [_requests(rewrite_ids)[i] for i in (0, 2)]
    return requests, asyncio.run(run_requests(make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY),
                                              requests))


@pytest.mark.parametrize("draft", ["itself", "bfloat16"])
def test_a_draft_core_changes_no_token(session_flare, smollm2_core, bf16_draft_core, greedy_and_seeded, draft):
    requests, reference = greedy_and_seeded
    draft_core = smollm2_core if draft == "itself" else bf16_draft_core
    engine = make_engine(session_flare, smollm2_core, frames=2, kv_pages=ROOMY, spec_method="draft",
                         spec_draft_tokens=4, spec_draft=loaded(session_flare, draft_core))
    results = asyncio.run(run_requests(engine, requests))
    for (tokens, logprobs, reason, usage), expected in zip(results, reference):
        assert tokens == expected[0] and reason == expected[2]
        assert [(lp[0], lp[2]) for lp in logprobs] == [(lp[0], lp[2]) for lp in expected[1]]
        assert all(abs(lp[1] - ref[1]) < 1e-3 for lp, ref in zip(logprobs, expected[1]))
    resources = engine.resources()
    assert resources.draft_rounds > 0 and resources.accepted_drafts > 0, resources
    if draft == "itself":  # the served model's own greedy guesses: kept but where sampling chose otherwise
        # (Most of them, whatever widths the rounds took: the width rule prices the draft's measured
        # time, so under load it narrows rounds to one draft.)
        assert resources.accepted_drafts * 2 >= resources.drafts, resources
    assert resources.live == 0 and resources.request_page_refs == 0 and resources.steps_in_flight == 0


POEM = [{"role": "user", "content": "Write a short poem about a lighthouse keeper and the sea."}]


def test_sampled_requests_draw_their_drafts_with_the_served_models_noise(session_flare, smollm2_core,
                                                                         smollm2_reference_tokenizer):
    """A sampled request's drafts are drawn with its sampling values and the noise its own tokens
    are drawn with (Gumbel coupling): with the served core as its own draft, a free-form answer at
    temperature 1 keeps nearly every draft, seeded or not (greedy guesses keep only those where
    the sample happens to be the most probable token), and the seeded answer is plain decoding's
    token for token."""
    prompt = tuple(smollm2_reference_tokenizer.apply_chat_template(POEM, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=False))
    seeded = GenerationRequest(prompt_ids=prompt, max_tokens=80, ignore_eos=True,
                               sampling=SamplingParams(temperature=1.0, top_p=0.95, seed=11))
    unseeded = GenerationRequest(prompt_ids=prompt, max_tokens=80, ignore_eos=True,
                                 sampling=SamplingParams(temperature=1.0))
    reference = asyncio.run(run_requests(make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY),
                                         [seeded]))[0]
    for request in (seeded, unseeded):
        engine = make_engine(session_flare, smollm2_core, frames=2, kv_pages=ROOMY, spec_method="draft",
                             spec_draft_tokens=4, spec_draft=loaded(session_flare, smollm2_core))
        tokens, _, reason, _ = asyncio.run(run_requests(engine, [request]))[0]
        assert len(tokens) == 80 and reason == "length"
        if request is seeded:
            assert tokens == reference[0]
        resources = engine.resources()
        print(f"seed {request.sampling.seed}: {resources.accepted_drafts} of {resources.drafts} drafts kept")
        assert resources.draft_rounds > 0 and resources.accepted_drafts >= 0.9 * resources.drafts, resources


def test_the_draft_core_computes_a_long_prompt_in_chunks(session_flare, smollm2_core, rewrite_ids, greedy_and_seeded):
    """The draft core computes what it has not seen in chunks of at most its prefill chunk size, as
    the served core would: after the prompt and any part of the served model's greedy answer, the
    draft core (the same weights) proposes the answer's next tokens; a proposal after a refused one
    computes only past the tokens the two share. (The core's chunks are 256 tokens, more than this
    prompt holds: the test takes 64, so that the first proposal computes two chunks and a part.)"""
    answer = list(greedy_and_seeded[1][0][0])
    core = loaded(session_flare, smollm2_core)
    draft = DraftModel(core, core, rows=1, longest=core.capacities.context_length + 4, pool_tokens=4096)
    assert draft.chunk_tokens == 256
    draft.chunk_tokens = 64
    assert 2 * 64 < len(rewrite_ids) + 40 < 3 * 64, len(rewrite_ids)
    for known in (40, 12, 41, len(answer) - 4):  # two chunks and a part, a rewind, one token on, far on
        tokens = [*rewrite_ids, *answer[:known]]
        assert draft.propose(tokens, 4, "r") == tuple(answer[known:known + 4]), known


def test_the_draft_pool_gives_the_least_recent_requests_pages_to_the_next(session_flare, smollm2_core, rewrite_ids,
                                                                           greedy_and_seeded):
    """A draft pool of one row's pages (5 of 64 tokens) and two requests: each proposal takes the
    pages it needs, the other request's row giving its pages back where none are free; a request
    whose row was taken computes its sequence again, and every proposal is still the served model's
    greedy answer."""
    answer = list(greedy_and_seeded[1][0][0])
    core = loaded(session_flare, smollm2_core)
    draft = DraftModel(core, core, rows=2, longest=260, pool_tokens=64)
    assert draft.num_pages == draft.pages_per_row == 5 and draft.rows.free_pages == 5
    for request, known, free in (("a", 40, 2), ("b", 12, 2), ("b", 13, 2), ("a", 41, 2), ("a", 69, 1)):
        tokens = [*rewrite_ids, *answer[:known]]  # 124 prompt tokens: 3 pages, 4 from 69 answer tokens on
        assert draft.propose(tokens, 4, request) == tuple(answer[known:known + 4]), (request, known)
        assert draft.rows.free_pages == free, (request, known)


def test_the_draft_pool_shares_the_kv_budget(session_flare, smollm2_core, bf16_draft_core):
    """A budget in bytes holds the served model's pages and the draft's records of as many tokens;
    the engine's draft pool holds as many tokens as its KV pool."""
    served, draft = loaded(session_flare, smollm2_core), loaded(session_flare, bf16_draft_core)
    args = (served.cache_scheme, served.capacities, 4, torch.device("cpu"), "0.9", "256M")
    alone = plan_kv(*args)
    shared = plan_kv(*args, draft_page_bytes=draft_page_bytes(draft, served.capacities.page_tokens))
    page = served.cache_scheme.page_bytes(64)
    assert draft_page_bytes(draft, 64) * 2 == page  # bfloat16 records of the same model: half the bytes
    assert alone.num_pages == (256 << 20) // page and shared.num_pages == (256 << 20) // (page + page // 2)
    engine = make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY, spec_method="draft",
                         spec_draft_tokens=4, spec_draft=draft)
    pages = engine.resources().pages
    assert pages < ROOMY and engine.core.scheduler.config.proposer.num_pages == max(pages, 33)  # 2052 tokens a row


def test_flare_run_with_a_draft_core(session_flare, smollm2_core, bf16_draft_core, smollm2_server, tmp_path):
    """`flare run --spec-method draft --spec-draft-core CORE2`: the same answer as a server without
    it, through the openai SDK; the start-up line reports the draft pool planned with the KV pool,
    and /metrics counts drafts checked and kept."""
    server = ServerProcess(session_flare.config_path, smollm2_core, tmp_path / "run.log", "--no-dashboard",
                           "--spec-method", "draft", "--spec-draft-core", str(bf16_draft_core),
                           "--spec-draft-tokens", "4").wait_ready()
    try:
        answers = []
        for url in (smollm2_server.url, server.url):
            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            reply = client.chat.completions.create(model=MODEL, messages=REWRITE, max_tokens=40, temperature=0)
            answers.append(reply.choices[0].message.content)
        assert answers[0] == answers[1] and answers[0]
        assert "draft_pool_mib=" in server.log()
        metrics = {line.split()[0]: float(line.split()[-1]) for line in server.get("/metrics").body.decode().splitlines()
                   if line.startswith(("flare_spec_proposed_tokens_total", "flare_spec_accepted_tokens_total"))}
        assert metrics["flare_spec_proposed_tokens_total"] >= metrics["flare_spec_accepted_tokens_total"] > 0, metrics
    finally:
        server.stop()


def test_a_draft_of_another_vocabulary_is_refused(session_flare, smollm2_core, qwen3_core):
    with pytest.raises(ValueError, match=r"--spec-draft-core .*tokenizer's vocabulary differs"):
        make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY, spec_method="draft", spec_draft_tokens=4,
                    spec_draft=loaded(session_flare, qwen3_core))


def test_the_draft_core_flag_goes_with_the_draft_method(session_flare, smollm2_core, tmp_path):
    with pytest.raises(ValueError, match=r"--spec-draft-core\) goes with --spec-method draft"):
        make_engine(session_flare, smollm2_core, frames=1, kv_pages=ROOMY, spec_method="prompt-lookup",
                    spec_draft_tokens=4, spec_draft=loaded(session_flare, smollm2_core))
    for flags in (["--spec-method", "draft"], ["--spec-draft-core", str(smollm2_core)]):
        run = subprocess.run([sys.executable, "-m", "flare_core.cli", "--config", str(session_flare.config_path),
                              "run", str(smollm2_core), "--device", "cpu", "--port", "0", "--no-dashboard", *flags],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode != 0 and "--spec-method draft needs --spec-draft-core" in run.stderr, run.stderr
    path = tmp_path / "config.toml"
    path.write_text('[server]\nspec_method = "draft"\n')
    with pytest.raises(ConfigError, match="server.spec_draft_core"):
        load_config(path)
    path.write_text(f'[server]\nspec_method = "draft"\nspec_draft_core = "{smollm2_core}"\n')
    assert load_config(path).server.spec_draft_core == str(smollm2_core)
