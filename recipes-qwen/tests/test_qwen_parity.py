"""Logits parity of the Qwen3 / Qwen3-MoE recipes with the Transformers forward.

Tiny random-weight models are saved with `save_pretrained`; the on-disk tensors go through
`map_weights` into a serving model built on the meta device. Requests of different lengths
are prefilled in 64-token steps that mix requests, then decoded together, over non-contiguous
pages; every logits row the serving model produces must match the Transformers forward on the
full sequence.
"""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from flare_core.contract import ContractError
from flare_core.ops.loading import load_prepared_weights
from flare_testing.parity import assert_logits_parity, serve_paged
from flare_core.plugins import load_registry
from flare_recipe_qwen.recipes import QWEN3, QWEN3_MOE

VOCAB = 1024
SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512)


def qwen3_config(**overrides) -> Qwen3Config:
    return Qwen3Config(**{**SMALL, "intermediate_size": 96, "tie_word_embeddings": True, **overrides})


def qwen3_moe_config(**overrides) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**SMALL, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
                             "num_experts_per_tok": 2, "norm_topk_prob": True, "mlp_only_layers": [1], **overrides})


def saved_checkpoint(model_class, config, tmp_path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    reference = model_class(config).eval()
    reference.save_pretrained(tmp_path)
    return reference, load_file(tmp_path / "model.safetensors")


@pytest.mark.parametrize("page_tokens", [16, 64])
def test_qwen3_logits_match_transformers(tmp_path, page_tokens):
    config = qwen3_config()
    reference, checkpoint = saved_checkpoint(Qwen3ForCausalLM, config, tmp_path)
    assert "lm_head.weight" not in checkpoint  # tied: the head reads the embedding
    assert_logits_parity(QWEN3, reference, checkpoint, qwen3_config(), page_tokens=page_tokens)


def test_qwen3_moe_logits_match_transformers(tmp_path):
    config = qwen3_moe_config()
    reference, checkpoint = saved_checkpoint(Qwen3MoeForCausalLM, config, tmp_path)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in checkpoint  # per-expert names on disk
    assert_logits_parity(QWEN3_MOE, reference, checkpoint, qwen3_moe_config(), page_tokens=16)


def test_prepared_layout_is_fused_and_cast(tmp_path):
    config = qwen3_moe_config()
    _, checkpoint = saved_checkpoint(Qwen3MoeForCausalLM, config, tmp_path)
    prepared = dict(QWEN3_MOE.map_weights(qwen3_moe_config(), checkpoint, torch.bfloat16))
    assert prepared["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 16, 64)
    assert prepared["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 2 * 32, 64)
    assert prepared["model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)
    assert prepared["model.layers.1.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)
    expert_1_up = checkpoint["model.layers.2.mlp.experts.1.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(prepared["model.layers.2.mlp.experts.gate_up_proj"][1, 32:], expert_1_up)
    assert {t.dtype for t in prepared.values()} == {torch.bfloat16}
    assert "lm_head.weight" in prepared  # this config is untied


def test_bfloat16_model_runs_close_to_float32(tmp_path):
    config = qwen3_config()
    _, checkpoint = saved_checkpoint(Qwen3ForCausalLM, config, tmp_path)
    scheme = load_registry().cache_schemes["attention-kv"].build(config, "bfloat16")
    sequence = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = QWEN3.build_model(config, dtype)
        load_prepared_weights(model, dict(QWEN3.map_weights(config, checkpoint, dtype)), "cpu")
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        ((_, _, logits),) = list(serve_paged(model, scheme, [sequence], [40], page_tokens=16))
        results[dtype] = logits
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float32], atol=2e-2, rtol=0)


def test_missing_checkpoint_tensor_is_named(tmp_path):
    config = qwen3_moe_config()
    _, checkpoint = saved_checkpoint(Qwen3MoeForCausalLM, config, tmp_path)
    del checkpoint["model.layers.2.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.3\.down_proj\.weight"):
        dict(QWEN3_MOE.map_weights(config, checkpoint, torch.float32))


@pytest.mark.parametrize("recipe, config, field", [
    (QWEN3, qwen3_config(attention_bias=True), "attention_bias"),
    (QWEN3, qwen3_config(use_sliding_window=True, sliding_window=32, max_window_layers=1), "layer_types"),
    (QWEN3, qwen3_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0}),
     "rope_parameters.rope_type"),
    (QWEN3_MOE, qwen3_moe_config(use_sliding_window=True, sliding_window=32), "sliding_window"),
    (QWEN3_MOE, qwen3_config(), "model_type"),
])
def test_unsupported_structure_is_rejected(recipe, config, field):
    with pytest.raises(ContractError) as error:
        recipe.check_config(config)
    assert error.value.field == field


def test_recipe_declarations():
    assert {a.name: a.repo for a in QWEN3_MOE.aliases} == {
        "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B", "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B"}
    assert ("qwen3-0.6b", "Qwen/Qwen3-0.6B") in {(a.name, a.repo) for a in QWEN3.aliases}
    values, clamped = QWEN3.sampling.resolve({"presence_penalty": -1.0})
    assert values["temperature"] == 0.6 and values["top_k"] == 20 and values["presence_penalty"] == 0.0
    assert clamped == {"presence_penalty": -1.0}
    template = QWEN3.assets["chat_template.jinja"]().decode()
    assert "<|im_start|>" in template and "enable_thinking" in template
    assert b'"<|im_end|>"' in QWEN3.assets["tokenizer_config.json"]()
    assert QWEN3.frontend.template_patches
