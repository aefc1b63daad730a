"""DeepSeek V4 checkpoints in the form DeepSeek publishes V4 Flash: routed experts in FP4 (e2m1
pairs in int8 bytes, one float8_e8m0fnu scale per row and 32 columns), the other linear weights
of the layers in FP8 with float8_e8m0fnu block scales, every scale named `X.scale`, and
"expert_dtype": "fp4" at the top of config.json (flare_core.prepare.fp8_checkpoint,
flare_core.kernels.fp4). The reference is Transformers reading the same files (its fp8 quantizer
dequantizes on a machine without a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from flare_core.kernels.fp4 import dequantize_fp4
from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, Fp8Blocks, Fp8ConfigError, fp8_blocks
from flare_testing.deepseek import assert_core_matches, export_checkpoint, publish_v4_quantized, \
    quantize_fp4_groups, write_v4_checkpoint
from flare_recipe_deepseek.v4 import map_weights

EXPERT = "layers.1.ffn.experts.3.w2"
LINEAR = "layers.1.attn.wq_a"


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """(checkpoint directory, the unquantized Transformers model, Transformers' model read from the
    published files)."""
    directory = tmp_path_factory.mktemp("v4-flash-form")
    original = write_v4_checkpoint(directory)
    publish_v4_quantized(directory)
    transformers_model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return directory, original, transformers_model


def test_the_checkpoint_is_stored_as_deepseek_publishes_v4_flash(published):
    directory, _, _ = published
    stored = load_file(directory / "model.safetensors")
    assert stored[f"{EXPERT}.weight"].dtype == torch.int8 and stored[f"{EXPERT}.weight"].shape == (64, 16)
    assert stored[f"{EXPERT}.scale"].dtype == torch.float8_e8m0fnu and stored[f"{EXPERT}.scale"].shape == (64, 1)
    assert stored[f"{LINEAR}.weight"].dtype == torch.float8_e4m3fn
    assert stored[f"{LINEAR}.scale"].dtype == torch.float8_e8m0fnu
    assert not any(name.endswith("_scale_inv") for name in stored)
    config = json.loads((directory / "config.json").read_text())
    assert config["expert_dtype"] == "fp4" and "expert_dtype" not in config["quantization_config"]


def test_flare_reads_the_weights_transformers_reads(published):
    directory, original, transformers_model = published
    config = AutoConfig.from_pretrained(directory)
    prepared = dict(map_weights(config, load_file(directory / "model.safetensors"), torch.float32))
    expected = transformers_model.state_dict()
    assert set(prepared) == set(expected)
    for name, tensor in prepared.items():
        assert torch.equal(tensor, expected[name]), name
    # The quantization changed the weights it touched (the comparison above is not of copies).
    experts = "model.layers.1.mlp.experts.down_proj"
    assert not torch.equal(prepared[experts], original.state_dict()[experts])


def test_the_export_serves_the_published_weights(published, tmp_path):
    directory, _, transformers_model = published
    core, printed, config_path = export_checkpoint(directory, tmp_path / "flare", "--dtype", "float32")
    assert ("fp8 checkpoint: float8_e4m3fn weights (one scale per 128x128 block) and FP4 routed experts (e2m1, one "
            "power-of-two scale per row and 32 columns) are dequantized") in printed
    assert_core_matches(core, config_path, transformers_model, prompt_lens=(7, 45, 70), decode_steps=6,
                        page_tokens=32)


def test_quantize_fp8_keeps_the_published_fp4_experts_and_fp8_blocks_and_serves_them(published, tmp_path):
    directory, _, transformers_model = published
    core, printed, config_path = export_checkpoint(directory, tmp_path / "flare", "--dtype", "float32",
                                                   "--quantize", "fp8")
    layers = AutoConfig.from_pretrained(directory).num_hidden_layers
    assert f"and {2 * layers} as its FP4 experts" in printed
    stored = {}
    for shard in core.glob("*.safetensors"):
        stored.update(load_file(shard))
    experts = "model.layers.1.mlp.experts"
    original = load_file(directory / "model.safetensors")
    # The checkpoint's bytes and scales, stacked over the experts (expert 3's down projection: w2).
    assert stored[f"{experts}.down_proj"].dtype == torch.uint8
    assert torch.equal(stored[f"{experts}.down_proj"][3], original[f"{EXPERT}.weight"].view(torch.uint8))
    assert stored[f"{experts}.down_proj_fp4_scale"].dtype == torch.float8_e8m0fnu
    assert torch.equal(stored[f"{experts}.down_proj_fp4_scale"][3].float(), original[f"{EXPERT}.scale"].float())
    gate_up = stored[f"{experts}.gate_up_proj"]
    assert gate_up.dtype == torch.uint8 and gate_up.shape[-1] * 2 == transformers_model.config.hidden_size
    # The FP8 blocks too, found by what the recipe read (DeepSeek's `attn.wq_a` is Transformers' `q_a_proj`).
    assert stored["model.layers.1.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(stored["model.layers.1.self_attn.q_a_proj.weight"].view(torch.uint8),
                       original[f"{LINEAR}.weight"].view(torch.uint8))
    # The grouped output projection too (served by Fp8GroupedLinear, group by group).
    assert torch.equal(stored["model.layers.1.self_attn.o_a_proj.weight"].view(torch.uint8),
                       original["layers.1.attn.wo_a.weight"].view(torch.uint8))
    assert torch.equal(stored["model.layers.1.self_attn.o_a_proj.weight_scale_inv"],
                       original["layers.1.attn.wo_a.scale"].float())
    # Served through flare::routed_experts, dequantized per step: Transformers' logits.
    assert_core_matches(core, config_path, transformers_model, prompt_lens=(7, 45, 70), decode_steps=6,
                        page_tokens=32)


def test_fp4_groups_dequantize_as_transformers_does():
    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (6, 48), dtype=torch.int8, generator=generator)
    scale = torch.exp2(torch.randint(-6, 6, (6, 3), generator=generator).float()).to(torch.float8_e8m0fnu)
    ours = dequantize_fp4(packed, scale)
    assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32))
    # Element 0 of a row is the low nibble of byte 0: 0x71 holds 0.5 (code 1) then 6 (code 7).
    one = torch.tensor([[0x71] + [0] * 15], dtype=torch.uint8)
    assert dequantize_fp4(one, torch.ones(1, 1))[0, :2].tolist() == [0.5, 6.0]
    # The same bytes as torch's FP4 dtype read the same.
    assert torch.equal(dequantize_fp4(packed.view(torch.float4_e2m1fn_x2), scale), ours)


def test_fp4_rounding_reaches_every_code_and_keeps_exact_values():
    values = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] * 4, [-0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.25] * 4])
    packed, scale = quantize_fp4_groups(values)
    assert scale.float().tolist() == [[1.0], [1.0]]
    restored = dequantize_fp4(packed, scale)
    assert torch.equal(restored[0], values[0]) and torch.equal(restored[1, :7], values[1, :7])


def _one_expert_checkpoint(scale_shape=(4, 2), expert_dtype="fp4"):
    packed, scale = quantize_fp4_groups(torch.randn(4, 64))
    raw = {f"{EXPERT}.weight": packed, f"{EXPERT}.scale": scale[:, :scale_shape[1]].expand(*scale_shape).contiguous()}
    return DequantizedCheckpoint(raw, Fp8Blocks((128, 128), expert_dtype)), packed, scale


def test_fp4_weights_are_checked_against_their_geometry_and_the_config():
    checkpoint, packed, scale = _one_expert_checkpoint()
    assert list(checkpoint) == [f"{EXPERT}.weight"] and checkpoint.scale_of(f"{EXPERT}.weight") == f"{EXPERT}.scale"
    assert torch.equal(checkpoint[f"{EXPERT}.weight"], dequantize_fp4(packed, scale))
    wrong, _, _ = _one_expert_checkpoint(scale_shape=(4, 1))
    with pytest.raises(ValueError, match=rf"'{EXPERT}.scale' has shape \(4, 1\); FP4 '{EXPERT}.weight' \(4, 32\) "
                                         r"\(64 columns, two per byte\) in groups of 32 columns needs \(4, 2\)"):
        wrong[f"{EXPERT}.weight"]
    fp8_experts, _, _ = _one_expert_checkpoint(expert_dtype="fp8")
    with pytest.raises(ValueError, match=rf"'{EXPERT}.weight' is torch.int8 with a scale '{EXPERT}.scale', an FP4 "
                                         r"weight, but config.json declares expert_dtype 'fp8'"):
        fp8_experts[f"{EXPERT}.weight"]


def test_an_fp8_weight_without_a_scale_names_both_spellings():
    checkpoint = DequantizedCheckpoint({f"{LINEAR}.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn)},
                                       Fp8Blocks((128, 128)))
    with pytest.raises(ValueError, match=rf"without its block scales '{LINEAR}.weight_scale_inv' or '{LINEAR}.scale'"):
        checkpoint[f"{LINEAR}.weight"]


def test_scale_is_a_tensor_name_of_its_own_in_an_unquantized_checkpoint():
    raw = {"norm.weight": torch.ones(4), "norm.scale": torch.full((4,), 2.0)}
    checkpoint = DequantizedCheckpoint(raw, None)
    assert sorted(checkpoint) == ["norm.scale", "norm.weight"] and torch.equal(checkpoint["norm.scale"], raw["norm.scale"])


def test_the_expert_dtype_is_read_where_either_release_puts_it():
    config = AutoConfig.for_model("deepseek_v4")
    config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert fp8_blocks(config).experts == "fp8"
    config.expert_dtype = "fp4"  # V4 Flash: at the top of config.json
    assert fp8_blocks(config).experts == "fp4"
    config.quantization_config = {"quant_method": "fp8", "expert_dtype": "int4"}  # quantization_config wins
    with pytest.raises(Fp8ConfigError, match=r"quantization_config.expert_dtype: is 'int4' \(supported: fp8, fp4\)"):
        fp8_blocks(config)
