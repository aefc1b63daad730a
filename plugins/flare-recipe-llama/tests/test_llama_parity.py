"""Logits parity of the Llama recipe with the Transformers forward, on a tiny random-weight
model saved with `save_pretrained`: requests of different lengths prefilled in 64-token steps
that mix requests, then decoded together over non-contiguous pages."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from flare_core.contract import ContractError
from flare_testing.parity import assert_logits_parity
from flare_core.plugins import load_registry
from flare_recipe_llama.plugin import LLAMA

VOCAB = 1024


def llama_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**{"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 2,
                          "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512,
                          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64},
                          **overrides})


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_llama_logits_match_transformers(tmp_path, tie_word_embeddings):
    torch.manual_seed(0)
    reference = LlamaForCausalLM(llama_config(tie_word_embeddings=tie_word_embeddings)).eval()
    reference.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")

    config = llama_config(tie_word_embeddings=tie_word_embeddings)
    assert_logits_parity(LLAMA, reference, checkpoint, config, page_tokens=16, decode_steps=3)


def test_missing_tensor_and_unsupported_config_are_named(tmp_path):
    LlamaForCausalLM(llama_config()).save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    del checkpoint["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight'"):
        dict(LLAMA.map_weights(llama_config(), checkpoint, torch.float32))
    with pytest.raises(ContractError, match="mlp_bias"):
        LLAMA.check_config(llama_config(mlp_bias=True))


def test_plugin_is_discovered_through_its_entry_point():
    registry = load_registry()
    assert registry.owners["llama"].distribution == "flare-recipe-llama"
    recipe, alias = registry.recipe_for_alias("llama-3.1-8b-instruct")
    assert recipe.name == "llama" and alias.repo == "meta-llama/Llama-3.1-8B-Instruct"
