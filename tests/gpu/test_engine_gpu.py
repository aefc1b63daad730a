"""The engine on the CUDA executor (decode graphs, FlashInfer prefill, torch.compile) with two
steps in flight vs one at a time (opt in: FLARE_TEST_GPU=1): same tokens, a stop token and a
cancel while a step is in flight, and every page back once the prefix cache is emptied.

The core is a small Qwen3 checkpoint (FlashInfer's head_dim 128; the CPU tests' 16 has no
kernel) exported in bf16. Token equality between
the two runs holds because both run the same kernels on the same batches: with random weights
whose embeddings have std 1, greedy margins are far wider than bf16 noise.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from test_engine_frames import REQUESTS
from flare_testing.engine import make_engine, run_requests

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]


EXPORT = ("--dtype", "bfloat16", "--max-concurrency", "8", "--context-length", "1024", "--prefill-chunk-size", "128")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import write_checkpoint
    from flare_testing.qwen import tiny_qwen3_config

    return write_checkpoint(tmp_path_factory.mktemp("qwen3-head128"),
                            tiny_qwen3_config(hidden_size=256, intermediate_size=512, head_dim=128))


@pytest.fixture(scope="module")
def bf16_core(session_flare, checkpoint):
    return session_flare.export(checkpoint, *EXPORT)


@pytest.mark.parametrize("compile_model", [False, True], ids=["captured", "compiled"])
def test_two_frames_on_cuda(session_flare, bf16_core, compile_model):
    one = make_engine(session_flare, bf16_core, 1, "cuda", compile_model)
    reference = asyncio.run(run_requests(one, REQUESTS))
    two = make_engine(session_flare, bf16_core, 2, "cuda", compile_model)
    assert two.core.frames_in_flight == 2 and two.core.executor.graphs.decode_graphs
    summary = two.executor_summary()
    assert summary.startswith("CUDA graphs for decode batches [1, 2, 4] and prompt chunks (with decode rows beside "
                              "them) of [64, 128] tokens")
    assert summary.endswith("2 steps in flight")
    assert asyncio.run(run_requests(two, REQUESTS)) == reference

    third = reference[4][0][2]
    stopping = REQUESTS[4].__class__(prompt_ids=REQUESTS[4].prompt_ids, max_tokens=20, ignore_eos=True,
                                     stop_token_ids=(third,), sampling=REQUESTS[4].sampling)
    engine = make_engine(session_flare, bf16_core, 2, "cuda", compile_model)
    results = asyncio.run(run_requests(engine, [*REQUESTS[:4], stopping], cancel_after={0: 4}))
    assert results[4][2] == "stop" and results[4][0] == reference[4][0][:reference[4][0].index(third) + 1]
    assert results[0][2] == "cancelled" and results[0][0] == reference[0][0][:len(results[0][0])]
    assert results[1:4] == reference[1:4]
    resources = engine.resources()
    assert resources.request_page_refs == 0 and resources.free_pages + resources.cached_pages == resources.pages
    replays = sum(g.replays for g in engine.core.executor.graphs.decode_graphs.values())
    assert replays > 0
    assert sum(g.replays for g in engine.core.executor.graphs.prefill_graphs.values()) > 0


def test_fp8_kv_core_on_cuda(session_flare, checkpoint, bf16_core):
    """A core exported with `--kv-dtype fp8_e4m3` is served on CUDA (compiled layers, decode and
    prompt-chunk graphs over FP8 pages): twice the pages of the bf16-page core in the same KV
    budget, the same tokens with two steps in flight as with one, every page back at the end."""
    fp8_core = session_flare.export(checkpoint, *EXPORT, "--kv-dtype", "fp8_e4m3")
    one = make_engine(session_flare, fp8_core, 1, "cuda", True)
    assert one.core.executor.storage["k"][0].dtype == torch.float8_e4m3fn
    reference = asyncio.run(run_requests(one, REQUESTS))
    two = make_engine(session_flare, fp8_core, 2, "cuda", True)
    bf16_pages = make_engine(session_flare, bf16_core, 1, "cuda", False).resources().pages
    assert two.resources().pages in (2 * bf16_pages, 2 * bf16_pages + 1)  # the same 64M budget, half-size pages
    assert asyncio.run(run_requests(two, REQUESTS)) == reference
    assert [len(tokens) for tokens, *_ in reference] == [r.max_tokens for r in REQUESTS]
    resources = two.resources()
    assert resources.request_page_refs == 0 and resources.free_pages + resources.cached_pages == resources.pages
    assert sum(g.replays for g in two.core.executor.graphs.decode_graphs.values()) > 0
    assert sum(g.replays for g in two.core.executor.graphs.prefill_graphs.values()) > 0


def test_steps_never_wait_for_the_device(session_flare, bf16_core):
    """With two steps in flight the host must never block on the device inside a step (an
    implicit sync, e.g. indexing with a host list or a blocking copy, would make the host wait
    for the step just launched and serialise host and GPU work). torch flags such operations in
    its sync debug mode; only the engine's explicit wait for a finished step is allowed."""
    import warnings

    engine = make_engine(session_flare, bf16_core, 2, "cuda", False)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(run_requests(engine, REQUESTS))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    print("\n".join(syncs[:10]))
    assert not syncs, f"{len(syncs)} synchronising operations during steps, first: {syncs[:3]}"


def test_grammars_on_cuda(session_flare, bf16_core):
    """Grammar masks and logit biases on the graph path (decode and prefill graphs, the eager
    fallback for mixed steps): outputs follow their grammars with one and two steps in flight,
    alike; a +100 bias lifts its token above all but the model's favourite (this random model's
    logits reach ~260, so a bias cannot force a token here); requests with neither in the same batches
    give the tokens they give alone; no step waits for the device."""
    import dataclasses
    import json
    import warnings

    from test_structured_output import SCHEMA, grammar_requests, text_of

    from flare_core.frontend.grammar import GrammarKind, GrammarSpec

    spec = GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA), "test")
    reference = asyncio.run(run_requests(make_engine(session_flare, bf16_core, 1, "cuda", False), REQUESTS))
    runs = []
    for frames in (1, 2):
        engine = make_engine(session_flare, bf16_core, frames, "cuda", False)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                forced = dataclasses.replace(REQUESTS[0], prompt_ids=tuple(range(600, 640)), max_tokens=4,
                                             logit_bias=((1234, 100.0),))
                runs.append(asyncio.run(run_requests(engine, [*grammar_requests(engine, spec), forced, *REQUESTS])))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
        assert not syncs, syncs[:3]
        assert sum(g.replays for g in engine.core.executor.graphs.decode_graphs.values()) > 0
    assert runs[0] == runs[1]
    constrained, [forced_result] = runs[0][:-len(REQUESTS) - 1], runs[0][-len(REQUESTS) - 1:-len(REQUESTS)]
    [_, _, first_top] = forced_result[1][0]
    assert 1234 in first_top, first_top  # unbiased, its logit is ~2 and its rank in the thousands
    for tokens, _, reason, _ in constrained:
        value = json.loads(text_of(engine, tokens))
        assert set(value) == {"ok", "n", "tag"} and reason == "stop"
    assert runs[0][-len(REQUESTS):] == reference


@pytest.mark.parametrize("compile_model", [False, True], ids=["captured", "compiled"])
def test_speculation_on_cuda(session_flare, bf16_core, compile_model):
    """Prompt-lookup speculation on the CUDA executor: rounds replay the speculative graphs
    (each decode row with its drafts, a logits row and a sample at every token) beside the
    captured decode and prefill steps; greedy tokens, penalised greedy tokens and seeded samples
    equal a run without it (the random model's outputs repeat, so drafts are kept)."""
    from flare_core.requests import SamplingParams

    samplings = [REQUESTS[0].sampling] * 3 + [
        SamplingParams(temperature=0.0, frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.05),
        SamplingParams(temperature=0.8, top_k=5, seed=11)]
    requests = [REQUESTS[0].__class__(prompt_ids=tuple(range(5 + 40 * i, 105 + 40 * i)) * 2, max_tokens=120,
                                      ignore_eos=True, sampling=sampling) for i, sampling in enumerate(samplings)]
    reference = asyncio.run(run_requests(make_engine(session_flare, bf16_core, 2, "cuda", compile_model), requests))
    engine = make_engine(session_flare, bf16_core, 2, "cuda", compile_model, spec_method="prompt-lookup",
                         spec_draft_tokens=4)
    graphs = engine.core.executor.graphs
    assert sorted(graphs.speculative_graphs) == [8, 16, 32]  # 4 rows of 1 + 4 tokens fit in 32
    assert "speculative rounds of [8, 16, 32] tokens" in engine.executor_summary()
    results = asyncio.run(run_requests(engine, requests))
    for index, (got, want) in enumerate(zip(results, reference)):
        assert got[0] == want[0], f"request {index} ({samplings[index]}) differs"
    resources = engine.resources()
    assert resources.draft_rounds > 0 and resources.accepted_drafts > 0, resources
    assert sum(g.replays for g in graphs.speculative_graphs.values()) > 0
    assert resources.request_page_refs == 0 and resources.free_pages + resources.cached_pages == resources.pages


def test_draft_core_on_cuda(session_flare, bf16_core):
    """`--spec-method draft` on CUDA, the served core as its own draft: each draft token replays the
    draft core's captured one-row decode graph (its prompts computed eagerly in chunks); greedy
    tokens and a seeded sample equal a run without speculation, drafts are kept, every page back.
    (On the CPU the same requests keep 113 of 113 drafts in 30 rounds.)"""
    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.engine.load import load_core
    from flare_core.plugins import load_registry
    from flare_core.requests import SamplingParams

    samplings = [REQUESTS[0].sampling] * 2 + [SamplingParams(temperature=0.8, top_k=5, seed=11)]
    requests = [REQUESTS[0].__class__(prompt_ids=tuple(range(5 + 40 * i, 305 + 40 * i)), max_tokens=60,
                                      ignore_eos=True, sampling=sampling) for i, sampling in enumerate(samplings)]
    reference = asyncio.run(run_requests(make_engine(session_flare, bf16_core, 2, "cuda"), requests))
    draft = load_core(open_verified_core(load_config(session_flare.config_path), str(bf16_core),
                                         trust_publisher=True), load_registry(), torch.device("cuda"))
    engine = make_engine(session_flare, bf16_core, 2, "cuda", spec_method="draft", spec_draft_tokens=4,
                         spec_draft=draft)
    drafts = engine.core.scheduler.config.proposer
    assert sorted(drafts.runner.graphs.decode_graphs) == [1]
    # A draft as large as the served model does not pay: priced at its measured time, the width
    # rule would check no drafts after the first proposal. Priced free, it checks them.
    drafts.seconds = lambda width: 0.0
    results = asyncio.run(run_requests(engine, requests))
    for index, (got, want) in enumerate(zip(results, reference)):
        assert got[0] == want[0], f"request {index} ({samplings[index]}) differs"
    resources = engine.resources()
    assert resources.draft_rounds > 0 and resources.accepted_drafts > 0, resources
    assert drafts.runner.graphs.decode_graphs[1].replays > 0
    assert resources.request_page_refs == 0 and resources.free_pages + resources.cached_pages == resources.pages


def hybrid_checkpoint(directory):
    """A small Qwen3-Next (Gated DeltaNet state rows beside paged attention) of head dims FlashInfer
    and flash-linear-attention have kernels for; every token routed to all four experts, so that no
    near-tied route flips between a round's kernels and a decode step's."""
    from conftest import write_checkpoint
    from flare_testing.qwen import tiny_qwen3_next_config

    config = tiny_qwen3_next_config(hidden_size=256, head_dim=128, intermediate_size=512, moe_intermediate_size=128,
                                    shared_expert_intermediate_size=128, num_experts_per_tok=4,
                                    linear_key_head_dim=128, linear_value_head_dim=128)
    return write_checkpoint(directory, config)


@pytest.fixture(scope="module")
def hybrid_core(session_flare, tmp_path_factory):
    """`hybrid_checkpoint` exported in bf16."""
    return session_flare.export(hybrid_checkpoint(tmp_path_factory.mktemp("qwen3-next-head128")), *EXPORT)


def test_speculation_over_continuation_state_on_cuda(session_flare, hybrid_core):
    """Prompt lookup over a hybrid core on the CUDA executor, two steps in flight: rounds replay
    speculative graphs over the requests' state rows, the executor keeps each row before a round
    and a partly refused round is followed by a rewind chunk from it. A logit bias keeps the random
    model's output to three tokens, so that its n-grams recur and prompt lookup proposes (left
    free, this model's outputs never repeat an n-gram: on the H100 no round was planned at all).
    Greedy and penalised greedy requests produce the tokens they produce without speculation, a
    seeded one runs to its length, and every state row and page comes back."""
    from flare_core.requests import SamplingParams

    samplings = [REQUESTS[0].sampling] * 2 + [
        SamplingParams(temperature=0.0, frequency_penalty=0.3, presence_penalty=0.2),
        SamplingParams(temperature=0.8, top_k=5, seed=11)]
    bias = ((1001, 30.0), (1002, 30.0), (1003, 30.0))
    requests = [REQUESTS[0].__class__(prompt_ids=tuple(range(5 + 40 * i, 105 + 40 * i)), max_tokens=100,
                                      ignore_eos=True, logit_bias=bias, sampling=sampling)
                for i, sampling in enumerate(samplings)]
    reference = asyncio.run(run_requests(make_engine(session_flare, hybrid_core, 2, "cuda"), requests))
    engine = make_engine(session_flare, hybrid_core, 2, "cuda", spec_method="prompt-lookup", spec_draft_tokens=4)
    assert engine.core.executor.state.round_saves and engine.core.scheduler.speculation.rewinds
    graphs = engine.core.executor.graphs
    assert graphs.speculative_graphs, engine.executor_summary()
    results = asyncio.run(run_requests(engine, requests))
    # A seeded sample is not held to token equality on CUDA here: on the H100 the seeded request of
    # an earlier form of this test (no bias) parted from the run without speculation at its
    # seventh token although no round had run, while the greedy ones, whose margins are wide, did
    # not (cause not established). Seeded samples are held to equality on the CPU
    # (recipes-qwen/tests/test_serving_qwen3_next.py) and over a dense core on CUDA (test_speculation_on_cuda).
    for index, (got, want) in enumerate(zip(results[:3], reference)):
        assert got[0] == want[0], f"request {index} ({samplings[index]}) differs"
    assert len(results[3][0]) == 100 and results[3][2] == "length"
    resources = engine.resources()
    assert resources.draft_rounds > 0 and 0 < resources.accepted_drafts, resources
    assert sum(g.replays for g in graphs.speculative_graphs.values()) > 0
    assert resources.live == 0 and resources.free_state_rows == resources.state_rows, resources
    assert resources.request_page_refs == 0 and resources.free_pages + resources.cached_pages == resources.pages


@pytest.fixture(scope="module")
def hybrid_mtp_core(session_flare, tmp_path_factory):
    """`hybrid_core`'s model with a random MTP module under `mtp.`: its core carries a draft head."""
    from flare_testing.qwen_mtp import add_mtp_module

    checkpoint = hybrid_checkpoint(tmp_path_factory.mktemp("qwen3-next-mtp-head128"))
    add_mtp_module(checkpoint)
    return session_flare.export(checkpoint, *EXPORT)


def test_mtp_head_on_cuda(session_flare, hybrid_mtp_core):
    """`--spec-method mtp` on the CUDA executor, two steps in flight: the captured graphs hand the
    core's draft head their final hidden states, rounds of its drafts replay speculative graphs over
    the requests' state rows (the random head's guesses are mostly refused, so nearly every round is
    rewound), greedy and penalised greedy requests produce the tokens they produce without
    speculation, and every state row and page comes back."""
    from flare_core.requests import SamplingParams

    samplings = [REQUESTS[0].sampling] * 2 + [SamplingParams(temperature=0.0, frequency_penalty=0.3,
                                                             presence_penalty=0.2)]
    requests = [REQUESTS[0].__class__(prompt_ids=tuple(range(5 + 40 * i, 75 + 40 * i)), max_tokens=60,
                                      ignore_eos=True, sampling=sampling) for i, sampling in enumerate(samplings)]
    reference = asyncio.run(run_requests(make_engine(session_flare, hybrid_mtp_core, 2, "cuda"), requests))
    engine = make_engine(session_flare, hybrid_mtp_core, 2, "cuda", spec_method="mtp", spec_draft_tokens=3)
    graphs = engine.core.executor.graphs
    assert graphs.speculative_graphs, engine.executor_summary()
    results = asyncio.run(run_requests(engine, requests))
    for index, (got, want) in enumerate(zip(results, reference)):
        assert got[0] == want[0], f"request {index} ({samplings[index]}) differs"
    resources = engine.resources()
    assert resources.draft_rounds > 0, resources
    assert sum(g.replays for g in graphs.speculative_graphs.values()) > 0
    assert resources.live == 0 and resources.free_state_rows == resources.state_rows, resources
    assert resources.request_page_refs == 0 and resources.free_pages + resources.cached_pages == resources.pages
