"""Logits parity of the DeepSeek-V3 recipes with the Transformers forward.

Tiny random-weight DeepseekV3ForCausalLM models (a dense first layer as `first_k_dense_replace`
makes it, then MoE layers with shared experts and group-limited routing; YaRN rope; an MTP layer
declared) are saved with `save_pretrained`; the on-disk tensors go through `map_weights` (which
absorbs kv_b_proj into w_uk / w_uv) into a serving model over the paged latent cache. Requests of
different lengths are prefilled in chunks that share steps, then decoded together, over
non-contiguous pages; every logits row must match the Transformers forward on the full sequence.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config

from flare_core.contract import ContractError
from flare_core.ops.loading import load_prepared_weights
from flare_core.plugins import load_registry
from flare_testing.parity import assert_logits_parity, serve_paged
from flare_recipe_deepseek.recipes import DEEPSEEK_V3, DEEPSEEK_V3_1
from flare_testing.deepseek import random_model

VOCAB = 128
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def v3_config(**overrides) -> DeepseekV3Config:
    values = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                  n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, max_position_embeddings=512, rope_parameters=YARN,
                  num_nextn_predict_layers=1)
    return DeepseekV3Config(**{**values, **overrides})


def saved_checkpoint(config, tmp_path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    reference = random_model(config)
    reference.save_pretrained(tmp_path)
    return reference, load_file(tmp_path / "model.safetensors")


def prepared_model(recipe, config, checkpoint, dtype=torch.float32) -> torch.nn.Module:
    model = recipe.build_model(config, dtype)
    return load_prepared_weights(model, dict(recipe.map_weights(config, checkpoint, dtype)), "cpu")


def assert_parity(recipe, reference, checkpoint, config, page_tokens: int) -> None:
    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "float32")
    assert [(s.name, s.record_shape) for s in scheme.paged] == [("ckv", (config.kv_lora_rank,)),
                                                               ("kpe", (config.qk_rope_head_dim,))]
    assert_logits_parity(recipe, reference, checkpoint, config, page_tokens=page_tokens)


@pytest.mark.parametrize("page_tokens", [16, 64])
def test_deepseek_v3_logits_match_transformers(tmp_path, page_tokens):
    config = v3_config()
    reference, checkpoint = saved_checkpoint(config, tmp_path)
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in checkpoint  # per-expert names on disk
    assert "model.layers.0.mlp.gate_proj.weight" in checkpoint  # the dense first layer
    assert reference.model.layers[0].self_attn.scaling != 24 ** -0.5  # YaRN mscale reaches the softmax scale
    assert_parity(DEEPSEEK_V3, reference, checkpoint, config, page_tokens)


def test_plain_q_projection_tied_head_and_biases_match_transformers(tmp_path):
    # q_lora_rank None (DeepSeek-V2-Lite style q_proj), rope without interleave, tied embeddings,
    # attention biases on q / kv_a / o projections, default rope.
    config = v3_config(q_lora_rank=None, rope_interleave=False, tie_word_embeddings=True, attention_bias=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    reference, checkpoint = saved_checkpoint(config, tmp_path)
    assert "lm_head.weight" not in checkpoint and "model.layers.1.self_attn.q_proj.weight" in checkpoint
    assert_parity(DEEPSEEK_V3, reference, checkpoint, config, page_tokens=16)


def test_prepared_layout_absorbs_kv_b_proj(tmp_path):
    config = v3_config()
    _, checkpoint = saved_checkpoint(config, tmp_path)
    prepared = dict(DEEPSEEK_V3.map_weights(config, checkpoint, torch.bfloat16))
    assert "model.layers.1.self_attn.kv_b_proj.weight" not in prepared
    kv_b = checkpoint["model.layers.1.self_attn.kv_b_proj.weight"].view(4, 16 + 16, 32)
    w_uk, w_uv = prepared["model.layers.1.self_attn.w_uk"], prepared["model.layers.1.self_attn.w_uv"]
    assert w_uk.shape == (4, 16, 32) and w_uv.shape == (4, 32, 16)
    assert torch.equal(w_uk, kv_b[:, :16, :].to(torch.bfloat16))
    assert torch.equal(w_uv, kv_b[:, 16:, :].transpose(1, 2).to(torch.bfloat16))
    assert prepared["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 96, 64)
    assert prepared["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape == (2 * 32, 64)
    assert prepared["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 2 * 32, 64)
    assert prepared["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)
    expert_5_up = checkpoint["model.layers.2.mlp.experts.5.up_proj.weight"].to(torch.bfloat16)
    assert torch.equal(prepared["model.layers.2.mlp.experts.gate_up_proj"][5, 32:], expert_5_up)
    # Expert choice compares biased scores: the bias stays float32 as Transformers keeps it.
    bias = prepared.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    assert bias.dtype == torch.float32
    assert torch.equal(bias, checkpoint["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert {t.dtype for name, t in prepared.items() if "e_score_correction_bias" not in name} == {torch.bfloat16}


def test_bfloat16_model_runs_close_to_float32(tmp_path):
    config = v3_config()
    _, checkpoint = saved_checkpoint(config, tmp_path)
    sequence = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    results = {}
    for dtype, cache_dtype in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
        model = prepared_model(DEEPSEEK_V3, config, checkpoint, dtype)
        scheme = load_registry().cache_schemes["mla-latent"].build(config, cache_dtype)
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        ((_, _, logits),) = list(serve_paged(model, scheme, [sequence], [40], page_tokens=16))
        results[dtype] = logits
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float32], atol=0.1, rtol=0.05)


class ReadRecorder(Mapping[str, torch.Tensor]):
    """A checkpoint mapping that remembers which tensors were read (as the lazy export reader would)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.read = tensors, set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.read.add(name)
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def test_the_served_model_reads_no_mtp_layer_and_the_draft_head_reads_only_it(tmp_path):
    config = v3_config()
    _, checkpoint = saved_checkpoint(config, tmp_path)
    # DeepSeek-V3 checkpoints store the MTP module as one more layer (here layer 3 of 3).
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight",
                 "self_attn.kv_b_proj.weight", "mlp.experts.0.up_proj.weight"):
        checkpoint[f"model.layers.3.{name}"] = torch.zeros(2, 2)
    recorder = ReadRecorder(checkpoint)
    dict(DEEPSEEK_V3.map_weights(config, recorder, torch.float32))
    assert not [n for n in recorder.read if n.startswith("model.layers.3.")]
    head = DEEPSEEK_V3.draft_head
    assert head.shipped(config, checkpoint) and not head.shipped(v3_config(num_nextn_predict_layers=0), checkpoint)
    del checkpoint["model.layers.3.eh_proj.weight"]
    assert not head.shipped(config, checkpoint)  # declared by the config, dropped from the checkpoint
    # Layers past the first are not read: the plan says so.
    assert DEEPSEEK_V3.plan_notes(config) == ()
    (note,) = DEEPSEEK_V3.plan_notes(v3_config(num_nextn_predict_layers=2))
    assert "MTP" in note and "model.layers.4-4" not in note and "model.layers.4" in note and "not loaded" in note


def test_missing_checkpoint_tensor_is_named(tmp_path):
    config = v3_config()
    _, checkpoint = saved_checkpoint(config, tmp_path)
    del checkpoint["model.layers.2.self_attn.kv_b_proj.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.kv_b_proj\.weight"):
        dict(DEEPSEEK_V3.map_weights(config, checkpoint, torch.float32))


@pytest.mark.parametrize("config, field", [
    # fp8 block quantization is dequantized at export (test_deepseek_fp8); other methods are refused.
    (v3_config(quantization_config={"quant_method": "compressed-tensors"}), "quantization_config.quant_method"),
    (v3_config(num_key_value_heads=2), "num_key_value_heads"),
    (v3_config(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
     "rope_parameters.rope_type"),
    (v3_config(n_group=3), "n_group"),
    (v3_config(n_group=8, topk_group=4), "n_group"),  # one expert per group
    (v3_config(topk_group=5), "topk_group"),
    (v3_config(n_group=4, topk_group=1, num_experts_per_tok=3), "num_experts_per_tok"),
    (v3_config(scoring_func="softmax"), "scoring_func"),
    (v3_config(topk_method="greedy"), "topk_method"),
    (v3_config(moe_layer_freq=2), "moe_layer_freq"),
])
def test_unsupported_structure_is_rejected(config, field):
    with pytest.raises(ContractError) as error:
        DEEPSEEK_V3.check_config(config)
    assert error.value.field == field


def test_recipes_are_declared_and_discovered():
    registry = load_registry()
    assert not [e for e in registry.errors if "deepseek" in str(e)]
    for recipe in (DEEPSEEK_V3, DEEPSEEK_V3_1):
        assert registry.owners[recipe.name].distribution == "flare-recipe-deepseek"
        assert recipe.cache_scheme == "mla-latent" and recipe.model_types == ("deepseek_v3",)
        assert recipe.frontend.stop_tokens == ("<｜end▁of▁sentence｜>",)
    assert {a.name: a.repo for a in DEEPSEEK_V3.aliases} == {
        "deepseek-v3": "deepseek-ai/DeepSeek-V3", "deepseek-v3-0324": "deepseek-ai/DeepSeek-V3-0324"}
    assert ("deepseek-v3.1", "deepseek-ai/DeepSeek-V3.1") in {(a.name, a.repo) for a in DEEPSEEK_V3_1.aliases}
    assert DEEPSEEK_V3.sampling.resolve({})[0]["temperature"] == 0.3
    values, _ = DEEPSEEK_V3_1.sampling.resolve({})
    assert (values["temperature"], values["top_p"]) == (0.6, 0.95)
    assert DEEPSEEK_V3_1.frontend.template_options == {"thinking": False}


def test_compiled_layers_match_eager(tmp_path):
    """The layers as the CUDA executor compiles them (MLA as an opaque op, latent cache writes
    traced, grouped experts) give the eager model's logits."""
    from flare_core.ops.model import CompiledDecoder

    config = v3_config()
    _, checkpoint = saved_checkpoint(config, tmp_path)
    scheme = load_registry().cache_schemes[DEEPSEEK_V3.cache_scheme].build(config, "float32")
    sequences = [list(range(3, 3 + n + 2)) for n in (9, 21)]

    def serve(model):
        return [(r, c, row) for r, c, row in serve_paged(model, scheme, sequences, (9, 21), 16, step_tokens=16)]

    eager = serve(prepared_model(DEEPSEEK_V3, config, checkpoint))
    compiled = serve(CompiledDecoder(prepared_model(DEEPSEEK_V3, config, checkpoint)))
    assert [(r, c) for r, c, _ in compiled] == [(r, c) for r, c, _ in eager]
    for (r, consumed, expected), (_, _, got) in zip(eager, compiled):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"request {r} after {consumed} tokens: {m}")
