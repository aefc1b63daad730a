"""Kimi K2 end to end (recipe kimi-k2, chosen by model_type for a DeepseekV3ForCausalLM
checkpoint): a tiny random-weight checkpoint of the DeepSeek-V3 architecture with Kimi K2's real
chat template and a small byte-level tokenizer holding its special tokens, exported through the
CLI and served by a real `flare run` process on the CPU eager path. Greedy output equals
Transformers `generate` for raw token prompts and for chat prompts rendered by Transformers'
`apply_chat_template`; turn 2 reuses turn 1's messages; a core without a draft head refuses
`--spec-method mtp`. (DeepSeek-V3.1, the same architecture:
recipes-deepseek/tests/test_serving_deepseek_v3.py.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flare_core.core import open_core
from flare_testing.deepseek_serving import (TINY, YARN, Family, assert_greedy_chat, assert_greedy_completions,
                                            assert_second_turn_reuses_the_first, served_cores)
from flare_testing.server import Flare, stop_all, write_config

# Kimi K2's published template, kept with the core suite's templates.
TEMPLATES = Path(__file__).parents[2] / "tests" / "fixtures" / "chat_templates"
KIMI = Family(
    "tiny-kimi-k2",
    {**TINY, "n_routed_experts": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4,
     "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
     "rope_parameters": {**YARN, "rope_theta": 50000.0, "beta_fast": 1.0, "beta_slow": 1.0}},
    "kimi_k2", TEMPLATES / "moonshotai-Kimi-K2.jinja",
    ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    "[BOS]", "<|im_end|>", ())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi-k2-serving")
    cores = served_cores(Flare(write_config(root / "flare")), root, {KIMI.name: (KIMI, ())})
    try:
        yield cores[KIMI.name]
    finally:
        stop_all(core.process for core in cores.values())


def test_export_plans_the_kimi_recipe_by_model_type(served):
    assert ("recipe        kimi-k2 0.1.0 (DeepseekV3ForCausalLM), chosen as the recipe for DeepseekV3ForCausalLM "
            "with model_type kimi_k2") in served.plan
    assert "draft head" not in served.plan
    assert "draft_head" not in open_core(served.core).manifest


def test_greedy_completions_match_transformers(served):
    assert_greedy_completions(served)


def test_greedy_chat_matches_transformers_template_and_generate(served):
    assert_greedy_chat(served)


def test_second_chat_turn_reuses_the_first_turns_complete_messages(served):
    assert_second_turn_reuses_the_first(served)


def test_a_core_without_a_draft_head_refuses_mtp(served):
    run = subprocess.run([sys.executable, "-m", "flare_core.cli", "--config", str(served.config_path),
                          "run", str(served.core), "--device", "cpu", "--port", "0", "--no-dashboard",
                          "--trust-publisher", "--spec-method", "mtp"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "--spec-method mtp: the core carries no draft head" in run.stderr, run.stderr
