"""DeepSeek-V3.1 end to end: a tiny random-weight checkpoint of the DeepSeek-V3 architecture (MLA +
MoE, a dense first layer, an MTP layer) with DeepSeek-V3.1's real chat template and a small
byte-level tokenizer holding its special tokens, exported through the CLI and served by real
`flare run` processes on the CPU eager path over the paged latent cache. Greedy output must equal
Transformers `generate` on the same weights, for raw token prompts (several at once, one longer
than the prefill chunk) and for chat prompts rendered by Transformers' own `apply_chat_template`.
The core is also served with its MTP layer proposing draft tokens (`--spec-method mtp`): the same
outputs. (Kimi K2, the same architecture: recipes-kimi/tests/test_serving_kimi_k2.py.)"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from flare_core.core import open_core
from flare_testing.deepseek_serving import (MAX_TOKENS, TINY, YARN, Family, assert_greedy_chat,
                                            assert_greedy_completions, assert_second_turn_reuses_the_first,
                                            served_cores)
from flare_testing.server import Flare, stop_all, write_config

# DeepSeek-V3.1's published template, kept with the core suite's templates.
TEMPLATES = Path(__file__).parents[2] / "tests" / "fixtures" / "chat_templates"
DEEPSEEK = Family(
    "tiny-deepseek-v3.1",
    {**TINY, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
     "num_nextn_predict_layers": 1, "rope_parameters": {**YARN, "rope_theta": 10000.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0}},
    None, TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja",
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
     "</think>"),
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ("--recipe", "deepseek-v3.1"))
MTP_NAME = "tiny-deepseek-v3.1-mtp"  # the same core, its draft head proposing


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek-serving")
    flare = Flare(write_config(root / "flare"))
    cores = served_cores(flare, root, {DEEPSEEK.name: (DEEPSEEK, ()),
                                       MTP_NAME: (DEEPSEEK, ("--spec-method", "mtp", "--spec-draft-tokens", "3"))})
    try:
        yield cores
    finally:
        stop_all(core.process for core in cores.values())


def test_export_plans_and_manifests(served):
    deepseek = served[DEEPSEEK.name]
    assert "recipe        deepseek-v3.1 0.1.0 (DeepseekV3ForCausalLM)" in deepseek.plan
    assert "cache scheme  mla-latent" in deepseek.plan
    assert "note          draft head: the checkpoint's multi-token-prediction module is stored" in deepseek.plan
    assert "draft head    " in deepseek.plan and "(flare run --spec-method mtp)" in deepseek.plan
    manifest = open_core(deepseek.core).manifest
    assert manifest["draft_head"]["tensors"] == sum(n.startswith("draft_head.")
                                                    for n in open_core(deepseek.core).tensor_names())
    assert [s["name"] for s in manifest["cache_scheme"]["paged"]] == ["ckv", "kpe"]
    assert manifest["frontend"]["template_options"] == {"thinking": False}
    assert manifest["sampling"]["defaults"]["temperature"] == 0.6


def test_deepseek_checkpoint_without_recipe_is_ambiguous(served, tmp_path):
    flare = Flare(write_config(tmp_path / "flare"))
    result = flare("export", served[DEEPSEEK.name].directory, "--no-progress", expect_ok=False)
    assert result.exit_code != 0
    assert "deepseek-v3, deepseek-v3.1" in result.output and "--recipe" in result.output


@pytest.mark.parametrize("name", [DEEPSEEK.name, MTP_NAME])
def test_greedy_completions_match_transformers(served, name):
    assert_greedy_completions(served[name])


def test_greedy_chat_matches_transformers_template_and_generate(served):
    assert_greedy_chat(served[DEEPSEEK.name])


def test_second_chat_turn_reuses_the_first_turns_complete_messages(served):
    assert_second_turn_reuses_the_first(served[DEEPSEEK.name])


def test_the_draft_head_proposed_what_was_checked(served):
    # Runs after the completions above on the MTP server (any order: it sends its own request first).
    # Whether a request gets drafts is the server's call (its width rule prices rounds by measured
    # step costs; one that gets none decodes plainly past these 12 tokens): on a loaded 2-core CI
    # machine one request got none (the draft head then also dropped the states of steps whose
    # input was in flight, since kept). So requests are sent, each checked against Transformers,
    # until the head has proposed.
    server = served[MTP_NAME]
    generator = torch.Generator().manual_seed(9)
    for _ in range(8):
        prompt = torch.randint(1, 98, (40,), generator=generator).tolist()
        response = server.client().completions.create(model=MTP_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_body={"skip_special_tokens": False})
        assert response.choices[0].text == server.expected(prompt)[0]
        metrics = httpx.get(server.process.url + "/metrics", timeout=30).text
        proposed = [line for line in metrics.splitlines() if line.startswith("flare_spec_proposed_tokens_total")]
        if proposed and float(proposed[0].split()[-1]) > 0:
            break
    assert proposed and float(proposed[0].split()[-1]) > 0, proposed
    # The head's records come from a pool planned with the KV pool, which the start-up line reports.
    assert "draft_pool_mib=" in server.process.log() and "draft_pool_mib=" not in served[DEEPSEEK.name].process.log()
