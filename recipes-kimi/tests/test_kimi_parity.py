"""The Kimi K2 recipe: Kimi-shaped tiny checkpoints (model_type "kimi_k2", DeepseekV3ForCausalLM,
many experts in a single routing group, YaRN with Kimi's beta values, no MTP layer) served through
the model kit's DeepSeek-V3 architecture must match the Transformers forward, and export must pick this
recipe for them by model_type.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from flare_core.api import build_deepseek_v3, map_deepseek_v3_weights
from flare_core.plugins import load_registry
from flare_core.prepare.checkpoint import Checkpoint, load_config
from flare_core.prepare.export import ExportError, choose_recipe
from flare_core.prepare.source import ModelSource
from flare_testing.deepseek import random_model, save_model
from flare_testing.parity import assert_logits_parity
from flare_recipe_kimi.config import KimiK2Config
from flare_recipe_kimi.recipes import KIMI_K2

VOCAB = 160
KIMI_TEMPLATE = Path(__file__).parents[2] / "tests" / "fixtures" / "chat_templates" / "moonshotai-Kimi-K2.jinja"


# Kimi-K2-Instruct's config.json in miniature: 384 experts -> 16, 8 per token -> 4, n_group 1,
# topk_group 1, first_k_dense_replace 1, routed_scaling_factor 2.827, yarn beta_fast = beta_slow = 1.
KIMI_VALUES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=24,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16,
                   n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                   routed_scaling_factor=2.827, norm_topk_prob=True, max_position_embeddings=512,
                   num_nextn_predict_layers=0, architectures=["DeepseekV3ForCausalLM"],
                   rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0,
                                    "beta_fast": 1.0, "beta_slow": 1.0})


def kimi_config(**overrides) -> KimiK2Config:
    return KimiK2Config(**{**KIMI_VALUES, **overrides})


def save_kimi_checkpoint(directory: Path, seed: int = 5) -> torch.nn.Module:
    """What Moonshot published: a DeepSeek-V3 checkpoint (per-expert tensors on disk) whose
    config.json says model_type "kimi_k2". Returns the Transformers model it holds."""
    reference = random_model(ds.DeepseekV3Config(**KIMI_VALUES), seed=seed)
    save_model(directory, reference, model_type="kimi_k2")
    return reference


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-kimi")
    reference = save_kimi_checkpoint(directory)
    return directory, reference, load_file(directory / "model.safetensors")


@pytest.mark.parametrize("page_tokens", [16, 64])
def test_kimi_logits_match_transformers(saved, page_tokens):
    directory, reference, checkpoint = saved
    assert "model.layers.1.mlp.experts.15.down_proj.weight" in checkpoint  # per-expert names on disk
    config = load_config(directory)
    assert isinstance(config, KimiK2Config)
    assert_logits_parity(KIMI_K2, reference, checkpoint, config, page_tokens=page_tokens, prompt_lens=(9, 64, 140),
                         decode_steps=3, seed=4, step_tokens=96)


def test_the_model_code_is_deepseeks():
    assert KIMI_K2.build_model is build_deepseek_v3
    assert KIMI_K2.map_weights is map_deepseek_v3_weights
    assert KIMI_K2.cache_scheme == "mla-latent" and KIMI_K2.architectures == ("DeepseekV3ForCausalLM",)
    assert KIMI_K2.plan_notes(kimi_config()) == ()  # Kimi K2 ships no MTP layer


def test_kimi_checkpoint_config_reads_without_remote_code(saved):
    directory, _, _ = saved
    config_file = directory / "config.json"
    on_disk = json.loads(config_file.read_text())
    assert on_disk["model_type"] == "kimi_k2" and on_disk["architectures"] == ["DeepseekV3ForCausalLM"]
    # Real Kimi checkpoints point auto_map at their own code; Flare never runs it.
    on_disk["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                           "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    copy = directory.parent / "kimi-with-auto-map"
    copy.mkdir(exist_ok=True)
    (copy / "config.json").write_text(json.dumps(on_disk))
    config = load_config(copy)
    assert isinstance(config, KimiK2Config) and config.n_group == 1 and config.rope_parameters["beta_fast"] == 1.0


def test_export_chooses_by_model_type():
    registry = load_registry()
    local = ModelSource(Path("."), "local", ("tiny",))
    assert choose_recipe(registry, local, Checkpoint(Path("."), kimi_config(), dict), None).recipe.name == "kimi-k2"
    deepseek = Checkpoint(Path("."), ds.DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"]), dict)
    # DeepSeek-V3 and V3.1 checkpoints share architecture and model_type: the choice must be explicit.
    with pytest.raises(ExportError, match=r"deepseek-v3, deepseek-v3\.1; choose one with --recipe"):
        choose_recipe(registry, local, deepseek, None)
    assert choose_recipe(registry, local, deepseek, "deepseek-v3.1").recipe.name == "deepseek-v3.1"


def test_recipe_declarations():
    registry = load_registry()
    assert registry.owners["kimi-k2"].distribution == "flare-recipe-kimi"
    assert not [e for e in registry.errors if "kimi" in str(e)]
    assert {a.name: a.repo for a in KIMI_K2.aliases} == {
        "kimi-k2-instruct": "moonshotai/Kimi-K2-Instruct", "kimi-k2-instruct-0905": "moonshotai/Kimi-K2-Instruct-0905"}
    assert KIMI_K2.model_types == ("kimi_k2",)
    assert KIMI_K2.sampling.resolve({})[0]["temperature"] == 0.6
    template = KIMI_TEMPLATE.read_text()
    for token in KIMI_K2.frontend.required_tokens + KIMI_K2.frontend.stop_tokens:
        assert token in template
