"""Kimi Linear (Kimi Delta Attention + MLA without position encoding, flare_recipe_kimi.linear) on
the CPU, in fp32: logits parity with the Transformers forward over requests of mixed lengths,
prefilled in 64-token steps that cut prompts mid-way (KDA state carried in the runtime's state
rows, MLA latents in pages of the attention layer only), then decoded together. The checkpoint
is what Transformers' `save_pretrained` writes: Kimi Linear's own tensor names."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import KimiLinearConfig
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

from flare_core.plugins import load_registry
from flare_testing.parity import (WrongGuesses, assert_logits_parity, check_speculative_rollback,
                                  greedy_continuation, snapshot_serving)
from flare_recipe_kimi.linear import build_model, checkpoint_name, map_weights

# Layers: KDA, KDA, MLA, KDA; the first MLP dense, the others MoE with a shared expert.
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
             intermediate_size=96, moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
             n_shared_experts=1, n_group=1, topk_group=1, linear_num_heads=2, linear_head_dim=16,
             linear_conv_kernel_dim=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
             v_head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
             mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=512, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
RECIPE = types.SimpleNamespace(check_config=None, build_model=build_model, map_weights=map_weights,
                               cache_scheme="kda-mla-hybrid")


def test_scheme_keeps_latent_pages_for_the_mla_layer_and_state_rows_for_kda():
    scheme = load_registry().cache_schemes["kda-mla-hybrid"].build(KimiLinearConfig(**SMALL), "bfloat16")
    assert [(s.name, s.record_shape, s.layer_ids) for s in scheme.paged] == [("ckv", (32,), (2,)),
                                                                              ("kpe", (8,), (2,))]
    assert [(s.name, s.shape, s.dtype, s.layer_ids) for s in scheme.state] == [
        ("conv", (3 * 2 * 16, 3), "bfloat16", (0, 1, 3)), ("recurrent", (2, 16, 16), "float32", (0, 1, 3))]


def test_checkpoint_names():
    assert checkpoint_name("model.layers.1.mlp.experts.3.up_proj.weight") == \
        "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    assert checkpoint_name("model.layers.0.self_attn.forget_gate.A_log") == "model.layers.0.self_attn.A_log"
    assert checkpoint_name("model.layers.1.mlp.shared_experts.gate_proj.weight") == \
        "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight"


@pytest.mark.parametrize("page_tokens", [16, 64])
def test_kimi_linear_logits_match_transformers(tmp_path, page_tokens):
    torch.manual_seed(0)
    reference = KimiLinearForCausalLM(KimiLinearConfig(**SMALL)).eval()
    reference.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.self_attn.q_conv1d.weight" in checkpoint  # Kimi Linear's names on disk
    assert_logits_parity(RECIPE, reference, checkpoint, KimiLinearConfig(**SMALL), page_tokens=page_tokens,
                         prompt_lens=(5, 70, 131, 1))


def test_speculative_rounds_roll_the_state_back_exactly(tmp_path):
    """Requests decode with drafts, some of them wrong: where a round refuses some, its request
    computes again from its state row as the round found it (the KDA and convolution state hold
    only what was kept), and every row sampled matches the Transformers forward."""
    torch.manual_seed(0)
    config = KimiLinearConfig(**SMALL)
    reference = KimiLinearForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    guesses = WrongGuesses(greedy_continuation(reference), config.vocab_size)
    scheduler, executor, _ = snapshot_serving(RECIPE, config, load_file(tmp_path / "model.safetensors"), 3, 64,
                                              page_tokens=16, proposer=guesses, draft_tokens=4)
    check_speculative_rollback(reference, scheduler, executor, config.vocab_size, [9, 30, 47], lowest_id=3)
    assert max(guesses.widths) > 1


def test_the_published_config_reads_as_kimi_linear_48b():
    """The published config.json (tests/fixtures/kimi-linear): 1-based KDA / MLA layer lists, the
    MoE fields under their published names; the recipe accepts it and plans 7 MLA layers of latent
    pages and 20 KDA layers of state rows."""
    import json
    from pathlib import Path

    from flare_recipe_kimi.recipes import KIMI_LINEAR

    published = json.loads((Path(__file__).parent / "fixtures" / "kimi-linear" / "config.json").read_text())
    config = KimiLinearConfig(**published)
    KIMI_LINEAR.check_config(config)
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [3, 7, 11, 15, 19, 23, 26]
    assert config.mlp_layer_types == ["dense"] + ["sparse"] * 26
    assert (config.num_local_experts, config.num_experts_per_tok, config.n_shared_experts) == (256, 8, 1)
    assert (config.linear_num_heads, config.linear_head_dim, config.linear_conv_kernel_dim) == (32, 128, 4)
    scheme = load_registry().cache_schemes["kda-mla-hybrid"].build(config, "bfloat16")
    assert [s.layer_ids for s in scheme.paged] == [(3, 7, 11, 15, 19, 23, 26)] * 2
    assert len(scheme.state[0].layer_ids) == 20
    assert KIMI_LINEAR.plan_notes(config) == (
        "20 KDA layers keep per-request state rows (convolution window and recurrent state); "
        "7 MLA layers keep latent pages",)


def test_configs_the_recipe_does_not_serve_are_refused():
    from flare_core.contract import ContractError
    from flare_recipe_kimi.recipes import KIMI_LINEAR

    for field, changes in (("layer_types", dict(layer_types=["linear_attention"] * 4)),
                           ("num_experts_per_token", dict(num_experts_per_tok=9)),
                           ("attention_bias", dict(attention_bias=True))):
        with pytest.raises(ContractError, match=field):
            KIMI_LINEAR.check_config(KimiLinearConfig(**{**SMALL, **changes}))
